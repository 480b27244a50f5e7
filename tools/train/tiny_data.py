"""Data side of the tiny model: the stdlib corpus, its deterministic split, the BPE tokenizer, the held-out
task files and the bigram baseline. Used by tools/train/train_tiny.py and tools/train/build_tasks.py.

Corpus: every `*.py` file under the running interpreter's stdlib directory (sysconfig's "stdlib"), test
directories included, `site-packages`/`dist-packages` and unreadable (non-UTF-8) files excluded. A file is
held out when the first 8 hex digits of sha1(relative path) mod 1000 < 1000 * holdout (default 10 %).
Task files are built from held-out files outside test directories only.
"""
from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import json
import keyword
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|pad|>", "<|mask|>")  # ids 0, 1, 2
EOS, PAD, MASK = 0, 1, 2
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class SourceFile:
    rel: str
    text: str
    is_test: bool


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: str, holdout: float) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 1000 < round(1000 * holdout)


@functools.lru_cache(maxsize=4)
def _python_files(root: Path) -> tuple[Path, ...]:
    return tuple(sorted(root.rglob("*.py")))  # the stdlib walk takes seconds: once per process


def read_corpus(root: Path, max_files: int | None = None, max_bytes: int = 2_000_000) -> list[SourceFile]:
    files = []
    for p in _python_files(Path(root)):
        parts = p.relative_to(root).parts
        if any(s in SKIP_DIRS for s in parts) or not p.is_file() or p.stat().st_size > max_bytes:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile("/".join(parts), text, any(s in TEST_DIRS for s in parts[:-1])))
        if max_files is not None and len(files) >= max_files:
            break
    return files


def split(files: list[SourceFile], holdout: float) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_held_out(f.rel, holdout)]
    held = [f for f in files if is_held_out(f.rel, holdout)]
    return train, held


def corpus_split(root: Path, max_files: int | None, holdout: float):
    """(files, training files, held-out files) of the corpus under root; both splits must be non-empty."""
    files = read_corpus(root, max_files)
    train_files, held_files = split(files, holdout)
    if not train_files or not held_files:
        raise SystemExit(f"{root}: {len(train_files)} training and {len(held_files)} held-out files; need both")
    return files, train_files, held_files


def train_tokenizer(texts: list[str], vocab_size: int, digits: bool = False):
    """Byte-level BPE (GPT-2 pre-tokenization, no prefix space) with <|endoftext|>, <|pad|>, <|mask|> first.
    digits: every digit is a token of its own (the arithmetic and retrieval tasks read numbers digit by digit)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    assert [tok.token_to_id(s) for s in SPECIALS] == [EOS, PAD, MASK]
    return tok


# LLaDA2.0's chat format (without tool calls): the API's shape for chat prompts; the tiny models are not chat-tuned
CHAT_TEMPLATE = "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content + '\\n' %}{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}{{- '<role>SYSTEM</role>' + system + 'detailed thinking off<|role_end|>' }}{%- for message in messages %}{%- if message.role == 'user' %}{{- '<role>HUMAN</role>' + message.content + '<|role_end|>' }}{%- elif message.role == 'assistant' %}{{- '<role>ASSISTANT</role>' + message.content + '<|role_end|>' }}{%- elif message.role == 'system' %}{{- '<role>SYSTEM</role>' + message.content + '<|role_end|>' }}{%- else %}{{- raise_exception('roles are system, user and assistant, got ' + message.role) }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{%- endif %}"


def tokenizer_config(max_len: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[EOS], "pad_token": SPECIALS[PAD],
            "mask_token": SPECIALS[MASK], "model_max_length": max_len, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE}


def encode_files(tok, files: list[SourceFile]):
    """Encodings (ids + char offsets) of whole files, in parallel."""
    return tok.encode_batch([f.text for f in files], add_special_tokens=False)


def token_stream(encodings) -> list[int]:
    """Files concatenated, each followed by EOS."""
    out: list[int] = []
    for enc in encodings:
        out.extend(enc.ids)
        out.append(EOS)
    return out


# ----------------------------------------------------------------------------------------------- tasks

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COMMON = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls", "args", "kwargs", "None", "True", "False"}


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n":
            starts.append(i + 1)
    return starts


def _functions(tree) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _definitions(tree) -> dict[str, int]:
    """name -> line of its first definition: functions, classes, imports, module- and class-level assignment
    targets, and `self.<attr>` assignments (function-local variables are not definitions a reader looks up)."""
    defs: dict[str, int] = {}

    def add(name, line):
        if name and name not in defs:
            defs[name] = line

    scoped = {id(s) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef)) for s in n.body}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(n.name, n.lineno)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name) and id(n) in scoped:
                        add(x.id, n.lineno)
                    elif isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                        add(x.attr, n.lineno)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                add((a.asname or a.name).split(".")[0], n.lineno)
    return defs


def _load_sites(tree, text: str, lines: list[int]) -> set[int]:
    """Char offsets where a name is read (a Name or an attribute in Load context): uses, not definitions."""
    sites = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            name, line, col = n.id, n.lineno, n.col_offset
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.end_lineno == n.lineno:
            name, line, col = n.attr, n.end_lineno, n.end_col_offset - len(n.attr)
        else:
            continue
        pos = lines[line - 1] + col  # col offsets count UTF-8 bytes: keep only sites where the text agrees
        if text[pos : pos + len(name)] == name:
            sites.add(pos)
    return sites


def _body_lines(tree) -> list[tuple[int, int]]:
    """(first line of the function incl. decorators, line) for every line of every function body statement."""
    out = set()
    for fn in _functions(tree):
        first = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
        for stmt in fn.body:
            if isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant):
                continue  # docstrings
            out.add((first, stmt.lineno))
    return sorted(out)


def _rest_of_line(ids: list[int], tokens: list[str], c: int, max_ref: int) -> list[int] | None:
    """ids[c:] up to (not including) the first token holding a newline; None if empty or longer than max_ref."""
    end = c
    while end < len(ids) and "\n" not in tokens[end] and ids[end] != EOS:
        end += 1
        if end - c > max_ref:
            return None
    return ids[c:end] if end < len(ids) and end > c else None


def build_tasks(tok, held: list[SourceFile], *, n_short: int = 64, n_long: int = 64, max_ref: int = 16,
                min_ref: int = 2, short_max_prompt: int = 384, long_min_prompt: int = 1500,
                long_max_prompt: int = 1920, far: int = 1000, quiet: int = 384, short_pre: int = 64,
                per_file: int = 3, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Line-completion tasks (as in CodeXGLUE's line-level completion): the prompt ends inside a line, the
    reference is the rest of that line (min_ref..max_ref tokens, without the newline).

    code_short: a line of a function body, cut after at least one token of the line; the prompt is the
      function from its def line (plus up to `short_pre` tokens before it), at most short_max_prompt tokens.
    code_long: long_min_prompt..long_max_prompt tokens of the same file as context, cut right before a use
      (a read) of a name defined >= `far` tokens above the cut (inside the prompt; a function, class, import,
      module/class-level assignment or self attribute) and absent from the last `quiet` prompt tokens:
      completing the line needs that far-away definition.
    Prompt and reference are contiguous slices of the file's own tokenization. At most `per_file` tasks of
    each kind per file, spread over as many files as possible."""
    import bisect

    rng = random.Random(seed)
    short_pool: list[list[dict]] = []
    long_pool: list[list[dict]] = []
    for f in sorted((f for f in held if not f.is_test), key=lambda f: f.rel):
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        enc = tok.encode(f.text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
        tokens = [f.text[a:b] for a, b in offsets]
        starts = [a for a, _ in offsets]
        lines = _line_starts(f.text)
        to_tok = lambda ch: bisect.bisect_left(starts, ch)  # noqa: E731  first token starting at/after ch
        containing = lambda ch: bisect.bisect_right(starts, ch) - 1  # noqa: E731  token holding char ch
        shorts, longs = [], []
        for first, line in _body_lines(tree):
            a = to_tok(lines[line - 1])
            b = to_tok(lines[line]) if line < len(lines) else len(ids)
            content = [i for i in range(a + 1, b) if "\n" not in tokens[i]]
            if not content:
                continue
            c = rng.choice(content)
            ref = _rest_of_line(ids, tokens, c, max_ref)
            start = max(0, to_tok(lines[first - 1]) - short_pre)
            if ref is not None and len(ref) >= min_ref and c - start <= short_max_prompt:
                shorts.append(_task(tok, f, "code_short", ids, start, c, ref, line))
        defs = _definitions(tree)
        uses = _load_sites(tree, f.text, lines)
        for name, dline in defs.items():
            if len(name) < 4 or name.startswith("__") or name in _COMMON:
                continue
            d = to_tok(lines[dline - 1])
            for m in re.finditer(rf"\b{re.escape(name)}\b", f.text):
                if m.start() not in uses:
                    continue
                c = containing(m.start())
                if c < max(long_min_prompt, d + far) or c - d > long_max_prompt:
                    continue
                recent = f.text[offsets[c - quiet][0] : offsets[c - 1][1]]
                if re.search(rf"\b{re.escape(name)}\b", recent):
                    continue
                ref = _rest_of_line(ids, tokens, c, max_ref)
                if ref is None or len(ref) < min_ref:
                    continue
                line = bisect.bisect_right(lines, m.start())
                t = _task(tok, f, "code_long", ids, c - min(c, long_max_prompt), c, ref, line)
                t["meta"] |= {"far_identifier": name, "definition_distance": c - d}
                longs.append(t)
                break  # one cut per identifier
        if shorts:
            short_pool.append(rng.sample(shorts, min(per_file, len(shorts))))
        if longs:
            long_pool.append(rng.sample(longs, min(per_file, len(longs))))
    return _pick(short_pool, n_short, rng, "code_short"), _pick(long_pool, n_long, rng, "code_long")


def _task(tok, f: SourceFile, kind: str, ids: list[int], start: int, cut: int, ref: list[int], line: int) -> dict:
    prompt = ids[start:cut]
    return {"id": "", "prompt_ids": prompt, "reference_ids": ref,
            "prompt": tok.decode(prompt, skip_special_tokens=False), "reference": tok.decode(ref, skip_special_tokens=False),
            "meta": {"file": f.rel, "line": line, "kind": kind, "prompt_tokens": len(prompt)}}


def _pick(pool: list[list[dict]], n: int, rng: random.Random, kind: str) -> list[dict]:
    """One task per file first (round robin over files in a seeded order), then second ones, ..."""
    rng.shuffle(pool)
    out = [p[i] for i in range(max(map(len, pool), default=0)) for p in pool if len(p) > i]
    out = out[:n]
    for i, t in enumerate(out):
        t["id"] = f"{kind}/{i:03d}"
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


# ------------------------------------------------------------------------------------------- baseline

def bigram_table(stream, vocab_size: int):
    """next-token argmax table of the training stream's bigram counts (ties -> lower id)."""
    import torch

    s = torch.as_tensor(stream, dtype=torch.long)
    counts = torch.bincount(s[:-1] * vocab_size + s[1:], minlength=vocab_size * vocab_size)
    return counts.view(vocab_size, vocab_size).argmax(1)


def bigram_generate(table, prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(table[last])
        out.append(last)
    return out
