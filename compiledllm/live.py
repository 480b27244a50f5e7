"""What `compiledllm run` shows while it decodes: a bar of generated tokens with tokens/s and each request's text.

Before the first step, while the engine compiles and / or captures its steps per (phase, batch bucket), a start-up
bar counts those pieces (Stepper's on_startup) in the decoding bar's place.

On a terminal the text of the requests being decoded grows in place, a finished block at a time (stream.py's
deltas, so a character is never split), and each request's whole text is printed above the bar as it ends. Off a
terminal (a pipe, a log file) each result's text is printed once, when it ends. The bar counts generated tokens
against prompts x max_new_tokens (an EOS ends a request early: the bar then jumps at the end).
"""
from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from compiledllm.engine import GenerationResult
from compiledllm.stream import TextStream

LIVE_REQUESTS = 4   # requests whose growing text is shown at once (the most recently advanced)
LIVE_LINES = 6      # lines of each one's text (its last lines)
PROMPT_LINES = 2    # the prompt's last lines, dimmed, before a finished request's text
REDRAW_S = 0.1      # a block event redraws at once if the last redraw is older


class TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        return Text("" if not task.speed else f"{task.speed:,.1f} tokens/s", style="progress.data.speed")


class RunDisplay:
    def __init__(self, console: Console, tokenizer, prompts: int, max_new_tokens: int, text: bool = True):
        """console: where it shows; tokenizer: the model's (None: no text, only the bar); text: show the text."""
        self.console, self.tokenizer = console, tokenizer if text else None
        self.bar = Progress(TextColumn("[bold]decoding"), BarColumn(), TextColumn("{task.completed:,.0f} tokens"),
                            TokensPerSecond(), TextColumn("{task.fields[done]}/{task.fields[requests]} requests"),
                            TimeElapsedColumn(), console=console)
        self.task = self.bar.add_task("decode", total=prompts * max_new_tokens, done=0, requests=prompts)
        self.startup = Progress(TextColumn("[bold]start-up[/] {task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        self.startup_task = None  # while the engine compiles / captures its steps
        self.streams: dict[int, TextStream] = {}
        self.recent: list[int] = []  # request ids, most recently advanced last
        self.drawn = 0.0
        self.live = Live(self._view(), console=console, transient=True, refresh_per_second=8) \
            if console.is_terminal and not console.quiet else None

    def __enter__(self) -> "RunDisplay":
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def on_startup(self, done: int, total: int, what: str) -> None:
        """The engine's start-up progress: `done` of `total` (phase, bucket) pieces compiled / captured."""
        if self.startup_task is None:
            self.startup_task = self.startup.add_task(what, total=total)
        self.startup.update(self.startup_task, completed=done, total=total, description=what)
        if done >= total:
            self.startup.remove_task(self.startup_task)
            self.startup_task = None
            self.bar.reset(self.task)  # the decoding clock starts now, as the run's wall time does
        if self.live is not None:
            self.live.update(self._view(), refresh=True)

    def on_block(self, index: int, tokens: list[int]) -> None:
        self.bar.advance(self.task, len(tokens))
        stream = self.streams.setdefault(index, TextStream(self.tokenizer))
        if self.tokenizer is not None:
            stream.push(tokens)
            self.recent = [i for i in self.recent if i != index] + [index]
        else:
            stream.ids += tokens
        self._refresh()

    def on_result(self, res: GenerationResult) -> None:
        sent = self.streams.pop(res.index, None)
        self.bar.advance(self.task, len(res.output_ids) - (len(sent.ids) if sent is not None else 0))
        self.bar.update(self.task, done=self.bar.tasks[0].fields["done"] + 1)
        self.recent = [i for i in self.recent if i != res.index]
        if self.tokenizer is not None and res.text is not None:
            lead = "\n".join(self.tokenizer.decode(res.prompt_ids).splitlines()[-PROMPT_LINES:])
            body = Text(lead, style="dim") + Text(res.text)
            self.console.print(Panel(body, title=f"prompt {res.index}", title_align="left",
                                     subtitle=f"{len(res.output_ids)} tokens, {res.steps} forwards, "
                                              f"{res.finish_reason}", subtitle_align="right"))
        self._refresh()

    def _refresh(self) -> None:
        if self.live is not None:  # drawn now at most every REDRAW_S (else at Live's own refresh rate)
            now = time.monotonic()
            draw = now - self.drawn >= REDRAW_S
            self.drawn = now if draw else self.drawn
            self.live.update(self._view(), refresh=draw)

    def _view(self) -> Group:
        panels = []
        for i in self.recent[-LIVE_REQUESTS:]:
            lines = self.streams[i].text.splitlines()[-LIVE_LINES:]
            panels.append(Panel(Text("\n".join(lines)), title=f"prompt {i} (decoding)", title_align="left"))
        return Group(*panels, self.bar if self.startup_task is None else self.startup)
