"""The OpenAI API's request and response shapes, as far as this server implements them.

Requests are parsed strictly: an unknown field, a wrong type or a value out of range is a 400 naming the field.
Fields of the OpenAI API that this engine does not implement are refused unless they carry their neutral value
(`echo: false`, `logprobs: null`, ...), so a client's default never fails and a real ask never goes unanswered.
The decoding policy's per-request settings travel in the extension field `policy` ({"threshold": 0.8}).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from compiledllm.errors import UserError

MAX_BODY_BYTES = 16 << 20   # a request body (a 128K-token prompt is ~0.5 MiB of text)
MAX_PROMPTS = 64            # prompts in one completions request
MAX_STOPS = 16              # stop strings in one request (OpenAI allows 4)

# fields of the OpenAI API not implemented here -> the values that ask for nothing
NEUTRAL = {
    "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1), "suffix": (None,),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
}


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, message, offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Common(_Strict):
    model: StrictStr | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    seed: int | None = Field(None, ge=0, lt=2**32)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    user: StrictStr | None = None                      # OpenAI's end-user id: accepted, not used
    policy: dict[StrictStr, float] = Field(default_factory=dict)  # extension: the policy's per-request settings

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise RequestError(400, "stop: stop strings must be non-empty", "stop")
        return tuple(stop)


class CompletionRequest(_Common):
    prompt: StrictStr | list[int] | list[StrictStr] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        many = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not many or any(len(x) == 0 for x in many):
            raise RequestError(400, "prompt: empty", "prompt")
        if len(many) > MAX_PROMPTS:
            raise RequestError(400, f"prompt: {len(many)} prompts; at most {MAX_PROMPTS} in one request", "prompt")
        return many


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def length(self) -> int | None:
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise RequestError(400, "max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
        return a if a is not None else b


def parse(body: bytes, kind: type[_Common]) -> _Common:
    """A request body -> the request, or a RequestError (400) naming the first offending field."""
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is {len(body)} bytes; at most {MAX_BODY_BYTES}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RequestError(400, f"the request body is not JSON ({str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the request body is a JSON object, got {type(data).__name__}")
    for key, neutral in NEUTRAL.items():
        if key in data:
            value = data.pop(key)
            if value not in neutral:
                raise RequestError(400, f"{key}: not supported by this server", key)
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        raise _refusal(e.errors()[0]) from None
    if req.n != 1:
        raise RequestError(400, f"n: {req.n}; this server makes one choice per prompt (n = 1)", "n")
    return req


SHAPES = {"prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
          "stop": "a string or a list of strings", "content": "a string or a list of {type: text, text} parts"}


def _refusal(err: dict) -> RequestError:
    """pydantic's first error -> a 400 naming the field (the union members pydantic tried are not fields)."""
    loc = [x for x in err["loc"] if isinstance(x, int) or not (x[:1].isupper() or "[" in x or x in _TYPES)]
    field = ".".join(map(str, loc)) or None
    last = next((x for x in reversed(loc) if isinstance(x, str)), "")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif err["type"] == "missing":
        msg = "required"
    elif last in SHAPES and len(loc) <= 3:
        field, msg = ".".join(map(str, loc[: loc.index(last) + 1])), SHAPES[last]
    else:
        msg = err["msg"]
    return RequestError(400, f"{field}: {msg}" if field else msg, field)


_TYPES = {"str", "int", "float", "bool", "dict", "list", "none"}


def user_error(e: UserError, param: str | None = None) -> RequestError:
    """The engine's refusal of a request (a prompt too long for the context, a token id outside the vocabulary,
    an unknown policy setting) as a 400; the engine's "request N" prefix means nothing to a client."""
    msg = str(e)
    if msg.startswith("request ") and ": " in msg:
        msg = msg.split(": ", 1)[1]
    if msg.startswith("policy."):
        param = "policy"
    return RequestError(400, msg.replace("max_new_tokens", "max_tokens"), param)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, forwards: int, blocks: int) -> dict[str, Any]:
    """OpenAI's usage, with the engine's own counts beside it: the forwards (denoising steps) and blocks made."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "forwards": forwards, "blocks": blocks}


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "length"}  # engine -> OpenAI
