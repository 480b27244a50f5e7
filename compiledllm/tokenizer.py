"""Text side of a checkpoint: tokenizer.json (HF `tokenizers`) and the chat template (sandboxed jinja2).

Both are hostile input. tokenizer.json is read up to TOKENIZER_LIMIT bytes, tokenizer_config.json up to JSON_LIMIT.
The chat template is compiled when the tokenizer loads, but a template that does not compile, or that is neither a
string nor Hugging Face's list of {name, template} entries with a "default" one, does not stop loading: text and id
prompts never need it. Its problem is raised, one line naming tokenizer_config.json, when a messages prompt is
rendered (`check_chat_template` raises it up front). Rendering runs in jinja2's immutable sandbox with the helpers
Hugging Face's renderer gives templates (raise_exception, strftime_now, its tojson, the loopcontrols extension) and
is bounded: at most CHAT_TEMPLATE_MAX_CHARS of output, at most CHAT_TEMPLATE_TIMEOUT_S of time, checked in the
calling thread at every loop iteration, call and output chunk (Bounds rewrites the template's syntax tree for the
loops). `+`, `*` and `**` refuse results past the bounds before computing them, and every value a call, a filter or
`~` makes is refused past CHAT_TEMPLATE_MAX_CHARS. One call of a filter or method is not interrupted (e.g. `replace`
asked for a huge string): that ends in a MemoryError, reported as one line like any other failure of the template."""
from __future__ import annotations

import functools
import json
import math
import time
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path

from jinja2 import Template, nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from tokenizers import Tokenizer

from compiledllm.errors import UserError
from compiledllm.models.config import read_json, read_limited, show

TOKENIZER_LIMIT = 64 << 20          # bytes of tokenizer.json (real ones are 2-35 MiB)
CHAT_TEMPLATE_MAX_CHARS = 1 << 20   # characters of one rendered prompt
CHAT_TEMPLATE_TIMEOUT_S = 5.0       # seconds of one render
POW_MAX_BITS = 1 << 16              # `**` in a template: larger integer results are refused before computing them
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")  # the tokenizer_config.json entries read (and templated)
_TIMED, _SIZED = "compiledllm_timed", "compiledllm_sized"  # the filters Bounds puts into every template

_deadline: ContextVar[float] = ContextVar("chat_template_deadline", default=math.inf)


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class TemplateRaised(TemplateError):
    """raise_exception(message) in a template: the template refuses the messages."""


class RenderLimit(Exception):
    """A render ran past CHAT_TEMPLATE_MAX_CHARS or CHAT_TEMPLATE_TIMEOUT_S."""


def check_time() -> None:
    if time.monotonic() > _deadline.get():
        raise RenderLimit(f"rendering took over {CHAT_TEMPLATE_TIMEOUT_S:g} s")


def timed(iterable):
    """A loop's iterable, checking the deadline per item: a loop that writes nothing still ends in time."""
    for item in iterable:
        check_time()
        yield item


def raise_exception(message) -> None:
    raise TemplateRaised(str(message))


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's tojson: plain json.dumps (jinja2's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def sized(value):
    """A value a template computed, refused past CHAT_TEMPLATE_MAX_CHARS: intermediate strings and lists stay
    bounded, so no chain of doublings (`~`, join, replace, ...) outgrows the output bound by more than one step."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > CHAT_TEMPLATE_MAX_CHARS:
        raise RenderLimit(f"a value in the template is over {CHAT_TEMPLATE_MAX_CHARS} characters or items")
    return value


def bounded(fn):
    """A filter whose results go through `sized` (functools.wraps keeps jinja2's pass_context marks)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return sized(fn(*args, **kwargs))
    return run


def _binop_size(operator: str, left, right) -> int:
    """How large `left operator right` would be (characters / items, or bits for `**`), 0 where it is small."""
    seqs = (str, list, tuple)
    if operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
        return len(left) + len(right)
    a, n = (left, right) if isinstance(right, int) else (right, left)
    if operator == "*" and isinstance(a, seqs) and isinstance(n, int):
        return len(a) * n
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        return abs(left).bit_length() * right
    return 0


class Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the time bound checked at every call, call results sized, and `+`, `*`, `**`
    refused before computing a result past the bounds."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        check_time()
        return sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator: str, left, right):
        limit = POW_MAX_BITS if operator == "**" else CHAT_TEMPLATE_MAX_CHARS
        if _binop_size(operator, left, right) > limit:
            raise RenderLimit(f"`{operator}` would make a result over the limit of {limit}")
        return super().call_binop(context, operator, left, right)


class Bounds(NodeTransformer):
    """Rewrites a template's syntax tree: every `for` loop iterates through `timed`, every `~` result is sized."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _TIMED, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        return nodes.Filter(self.generic_visit(node), _SIZED, [], [], None, None, lineno=node.lineno)


def sandbox() -> Sandbox:
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    env.filters.update(tojson=tojson)
    env.filters = {name: bounded(fn) for name, fn in env.filters.items()}
    env.filters.update({_TIMED: timed, _SIZED: sized})
    return env


_ENV = sandbox()


def compile_template(source: str) -> Template:
    """The template, its syntax tree rewritten by Bounds."""
    return _ENV.from_string(Bounds().visit(_ENV.parse(source)))


def select_template(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the one named default)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise ValueError(f"chat_template lists templates {sorted(named)}, none named \"default\"")
    raise ValueError(f"chat_template must be a string or a list of {{name, template}} entries, got {show(value)}")


def prepare_template(value, source: str) -> tuple[str | None, Template | None, str | None]:
    """(the template's text, compiled, None), or its problem as a one-line message in place of the compiled one."""
    try:
        text = select_template(value)
    except ValueError as e:
        return None, None, f"{source}: {e}"
    if text is None:
        return None, None, None
    try:
        return text, compile_template(text), None
    except TemplateSyntaxError as e:
        return text, None, f"{source}: chat_template does not compile (line {e.lineno}: {one_line(e)})"
    except Exception as e:  # jinja2's parser and Python's compiler raise several types for hostile sources
        return text, None, f"{source}: chat_template does not compile ({type(e).__name__}: {one_line(e)})"


def render_bounded(template: Template, context: dict) -> str:
    """Render chunk by chunk, in this thread, within CHAT_TEMPLATE_MAX_CHARS and CHAT_TEMPLATE_TIMEOUT_S."""
    token = _deadline.set(time.monotonic() + CHAT_TEMPLATE_TIMEOUT_S)
    try:
        out, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > CHAT_TEMPLATE_MAX_CHARS:
                raise RenderLimit(f"the rendered prompt is over {CHAT_TEMPLATE_MAX_CHARS} characters")
            check_time()
            out.append(chunk)
        return "".join(out)
    finally:
        _deadline.reset(token)


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict, source: str = "tokenizer_config.json"):
        self.tokenizer = tokenizer
        self.config = config
        self.source = source  # the file config came from, named in errors
        self.specials = {k: self._token_text(k) for k in SPECIAL_TOKENS}
        self.chat_template, self._template, self._template_problem = prepare_template(config.get("chat_template"),
                                                                                      source)

    @classmethod
    def from_dir(cls, path: Path) -> "TextTokenizer | None":
        file = path / "tokenizer.json"
        if not file.exists():
            return None
        try:
            tok = Tokenizer.from_str(read_limited(file, TOKENIZER_LIMIT).decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{file}: cannot be read as a tokenizer (not UTF-8 text)") from None
        except Exception as e:  # tokenizers raises plain Exceptions for malformed files
            raise UserError(f"{file}: cannot be read as a tokenizer ({str(e).splitlines()[0]})") from None
        cfg_file = path / "tokenizer_config.json"
        return cls(tok, read_json(cfg_file) if cfg_file.exists() else {}, str(cfg_file))

    def _token_text(self, key: str) -> str | None:
        """A special token entry: a string, or {"content": string} as Hugging Face saves added tokens."""
        value = self.config.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        if text is not None and not isinstance(text, str):
            raise UserError(f"{self.source}: {key} must be a token string, got {show(value)}")
        return text

    def save(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into `path` (the layout from_dir reads)."""
        self.tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(text)

    def special_id(self, key: str) -> int | None:
        """Id of a special token named in tokenizer_config.json (e.g. eos_token)."""
        return self.token_id(self._token_text(key))

    def mask_id(self) -> int | None:
        """The added special token whose text names a mask (<|mask|>, <|mdm_mask|>, <|MASK|>, ...)."""
        for tid, tok in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            if tok.special and "mask" in tok.content.lower():
                return tid
        return None

    def check_chat_template(self) -> None:
        """Raise the chat template's problem (missing, malformed, not compiling) as a one-line UserError."""
        if self._template_problem is not None:
            raise UserError(self._template_problem)
        if self._template is None:
            raise UserError(f"{self.source}: no chat_template (messages prompts need one)")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        self.check_chat_template()
        try:
            return render_bounded(self._template, dict(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       **self.specials))
        except TemplateRaised as e:
            raise UserError(f"{self.source}: the chat template refused the messages: {one_line(e)}") from None
        except RenderLimit as e:
            raise UserError(f"{self.source}: chat template: {e}") from None
        except SecurityError as e:
            raise UserError(f"{self.source}: the chat template tried an unsafe operation ({one_line(e)})") from None
        except Exception as e:  # the template's own bugs (undefined names, type errors, recursion, memory)
            raise UserError(f"{self.source}: the chat template failed ({type(e).__name__}: {one_line(e)})") from None
