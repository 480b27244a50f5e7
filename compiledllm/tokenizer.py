"""Text side of a checkpoint: tokenizer.json (HF `tokenizers`) and the chat template (sandboxed jinja2)."""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from compiledllm.errors import UserError


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict):
        self.tokenizer = tokenizer
        self.config = config
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self.chat_template: str | None = template

    @classmethod
    def from_dir(cls, path: Path) -> "TextTokenizer | None":
        file = path / "tokenizer.json"
        if not file.exists():
            return None
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exceptions for malformed files
            raise UserError(f"{file}: cannot be read as a tokenizer ({str(e).splitlines()[0]})") from None
        cfg_file = path / "tokenizer_config.json"
        config = {}
        if cfg_file.exists():
            try:
                config = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{cfg_file}: malformed JSON ({e})") from None
        return cls(tok, config)

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
        return self.token_id(_token_text(self.config.get(key)))

    def mask_id(self) -> int | None:
        """The added special token whose text names a mask (<|mask|>, <|mdm_mask|>, <|MASK|>, ...)."""
        for tid, tok in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            if tok.special and "mask" in tok.content.lower():
                return tid
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise UserError("the checkpoint's tokenizer_config.json has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        specials = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **specials
        )
