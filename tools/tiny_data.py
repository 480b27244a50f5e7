"""Data side of the tiny model: the stdlib corpus, its deterministic split, the BPE tokenizer, the held-out
task files and the bigram baseline. Used by tools/train_tiny.py and tools/build_tasks.py.

Corpus: every `*.py` file under the running interpreter's stdlib directory (sysconfig's "stdlib"), test
directories included, `site-packages`/`dist-packages` and unreadable (non-UTF-8) files excluded. A file is
held out when the first 8 hex digits of sha1(relative path) mod 1000 < 1000 * holdout (default 10 %).
Task files are built from held-out files outside test directories only.
"""
from __future__ import annotations

import ast
import builtins
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


def read_corpus(root: Path, max_files: int | None = None, max_bytes: int = 2_000_000) -> list[SourceFile]:
    files = []
    for p in sorted(root.rglob("*.py")):
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


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenization, no prefix space) with <|endoftext|>, <|pad|>, <|mask|> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    assert [tok.token_to_id(s) for s in SPECIALS] == [EOS, PAD, MASK]
    return tok


def tokenizer_config(max_len: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[EOS], "pad_token": SPECIALS[PAD],
            "mask_token": SPECIALS[MASK], "model_max_length": max_len, "clean_up_tokenization_spaces": False}


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


def _char_to_token(offsets: list[tuple[int, int]]):
    """char position -> index of the first token starting at or after it."""
    import bisect

    starts = [s for s, _ in offsets]
    return lambda c: bisect.bisect_left(starts, c)


def _functions(tree) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _definitions(tree) -> dict[str, int]:
    """name -> line of its first definition (def/class/assignment target/import/argument-free attribute)."""
    defs: dict[str, int] = {}

    def add(name, line):
        if name and name not in defs:
            defs[name] = line

    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(n.name, n.lineno)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        add(x.id, n.lineno)
                    elif isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                        add(x.attr, n.lineno)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                add((a.asname or a.name).split(".")[0], n.lineno)
    return defs


def _body_cuts(tree) -> list[tuple[int, int]]:
    """(function def line, statement line) for statements inside function bodies, from the 2nd statement on."""
    cuts = []
    for fn in _functions(tree):
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(getattr(s, "value", None), ast.Constant))]
        first = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
        for s in body[1:]:
            cuts.append((first, s.lineno))
    return sorted(set(cuts))


def build_tasks(tok, held: list[SourceFile], *, n_short: int = 64, n_long: int = 64, ref_len: int = 32,
                short_max_prompt: int = 384, long_min_prompt: int = 1500, long_max_prompt: int = 1920,
                far: int = 1000, quiet: int = 384, short_pre: int = 64, per_file: int = 3, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Short-context tasks (continue a function body; prompt = the function from its def line, plus up to
    `short_pre` tokens before it, at most short_max_prompt tokens) and long-context tasks (long_min_prompt..long_max_prompt
    tokens of the same file as context; the reference uses an identifier defined >= `far` tokens above the cut
    and absent from the last `quiet` prompt tokens). Cuts are at statement starts; prompt and reference are
    contiguous slices of the file's own tokenization. At most `per_file` tasks of each kind per file, spread
    over as many files as possible."""
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
        to_tok = _char_to_token(offsets)
        lines = _line_starts(f.text)
        defs = _definitions(tree)
        def_tok = {name: to_tok(lines[line - 1]) for name, line in defs.items()
                   if len(name) >= 4 and not name.startswith("__") and name not in _COMMON}
        shorts, longs = [], []
        for first, line in _body_cuts(tree):
            c = to_tok(lines[line - 1])
            if c + ref_len > len(ids) or c <= 0:
                continue
            ref = ids[c : c + ref_len]
            if EOS in ref:
                continue
            start = max(0, to_tok(lines[first - 1]) - short_pre)
            if c - start <= short_max_prompt and c - to_tok(lines[first - 1]) >= 8:
                shorts.append(_task(tok, f, "code_short", ids, start, c, ref_len, line))
            if c >= long_min_prompt:
                p0 = c - min(c, long_max_prompt)
                ref_text = f.text[offsets[c][0] : offsets[c + ref_len - 1][1]]
                recent = f.text[offsets[c - quiet][0] : offsets[c - 1][1]]
                used = [n for n in dict.fromkeys(_IDENT.findall(ref_text)) if n in def_tok
                        and p0 <= def_tok[n] <= c - far and not re.search(rf"\b{re.escape(n)}\b", recent)]
                if used:
                    t = _task(tok, f, "code_long", ids, p0, c, ref_len, line)
                    t["meta"]["far_identifiers"] = used
                    t["meta"]["definition_distance"] = c - max(def_tok[n] for n in used)
                    longs.append(t)
        if shorts:
            short_pool.append(rng.sample(shorts, min(per_file, len(shorts))))
        if longs:
            long_pool.append(rng.sample(longs, min(per_file, len(longs))))
    return _pick(short_pool, n_short, rng, "code_short"), _pick(long_pool, n_long, rng, "code_long")


def _task(tok, f: SourceFile, kind: str, ids: list[int], start: int, cut: int, ref_len: int, line: int) -> dict:
    prompt, ref = ids[start:cut], ids[cut : cut + ref_len]
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
