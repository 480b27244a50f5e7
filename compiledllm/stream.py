"""Text as it is decoded: each request's finished blocks turned into text deltas that never split a character.

A request's tokens arrive a block at a time (engine BlockEvents). Decoding them one block at a time would break a
character whose UTF-8 bytes span two tokens (byte-level BPE), and decoding the whole output every time costs
O(n^2). `TextStream` keeps vLLM's two offsets instead: it decodes only from a few tokens before the text already
sent (`prefix`) and holds back a delta that ends in U+FFFD (an incomplete character) until the next tokens
complete it. The deltas of a request, joined, are the decode of its whole output.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from compiledllm.engine.request import BlockEvent, Event, FinishEvent, GenerationResult

CONTEXT_TOKENS = 5  # tokens decoded before the new ones: enough for a tokenizer's merges and spaces to settle


class TextStream:
    """The text deltas of one request's output; `push(tokens)` -> the new text (possibly ''). hold: characters kept
    back at the end (a request with stop strings: the longest one's length - 1, so that no text a stop string cut
    away is ever sent)."""

    def __init__(self, tokenizer, hold: int = 0):
        self.tokenizer, self.hold = tokenizer, hold
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to the end of `decoded`
        self.read = 0
        self.decoded = ""  # the text decoded so far
        self.text = ""     # the part of it sent

    def push(self, tokens: Sequence[int]) -> str:
        self.ids += list(tokens)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read])
        now = decode(self.ids[self.prefix :])
        if not now.endswith("\ufffd") and len(now) > len(before) and now.startswith(before):
            # else a character is not complete yet (or nothing is new): wait for the next tokens
            self.decoded += now[len(before):]
            self.prefix, self.read = max(0, len(self.ids) - CONTEXT_TOKENS), len(self.ids)
        delta = self.decoded[len(self.text) : max(len(self.text), len(self.decoded) - self.hold)]
        self.text += delta
        return delta

    def finish(self, final: str) -> str:
        """The rest of the text once the request ended, given its final text (a stop string may cut it): what
        `push` held back, or '' (without `hold`, a stop string's cut can end before text already sent)."""
        rest = final[len(self.text):] if final.startswith(self.text) else ""
        self.text += rest
        return rest


@dataclass(frozen=True)
class StreamDelta:
    """One step of a request's text: `text` is new since its last delta; `result` is set on the last one."""

    request_id: int
    text: str
    token_ids: list[int]
    result: GenerationResult | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None


def text_deltas(events: Iterator[Event], tokenizer, hold: int = 0) -> Iterator[StreamDelta]:
    """Session events -> text deltas per request (a request's FinishEvent gives its last delta, with the result);
    without a tokenizer the deltas carry tokens only (text ''). hold: TextStream's (stop strings' length - 1)."""
    streams: dict[int, TextStream] = {}
    for ev in events:
        s = streams.setdefault(ev.request_id, TextStream(tokenizer, hold))
        if isinstance(ev, BlockEvent):
            text = s.push(ev.tokens) if tokenizer is not None else ""
            if text or ev.tokens:
                yield StreamDelta(ev.request_id, text, list(ev.tokens))
        elif isinstance(ev, FinishEvent):
            final = ev.result.text if ev.result.text is not None else (
                tokenizer.decode(ev.result.output_ids) if tokenizer is not None else "")
            rest = s.finish(final)
            del streams[ev.request_id]
            yield StreamDelta(ev.request_id, rest, [], ev.result)
