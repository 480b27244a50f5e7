"""Generated tasks with exact answers for the tiny models: multi-digit addition and multiplication, sorting,
reversing and copying lists, key -> value retrieval over long context, and variable-binding chains in code.

Every generator draws from a seeded random.Random and renders text: a prompt and a reference, the exact answer
after one space and followed by TERMINATOR ("\\n"; training appends EOS after it). The prompt ends at a
pre-token boundary (" =" or " =="), so encoding prompt and reference apart gives the ids of the whole text.

Split: an item is an evaluation item iff sha1(SPLIT_SALT + canonical key)[:8] mod 1000 < EVAL_PERMILLE. Training
draws reject evaluation items and evaluation draws reject training items, so the two sets are disjoint by
construction, with no set stored (and evaluation files also come from their own seed). The canonical key is the
prompt of a short task ("add/47+815") and the asked (key, value) pair or binding chain of a long one. Long tasks
take their filler code from the stdlib split of tools/train/tiny_data.py: training files for training, held-out files
for the task files.

Long tasks (LongSample) are pieces of text with stdlib filler between them (a share of the filler after each
piece) and question lines at the end: retrieval puts a `table = {...}` of look-alike keys first, variable binding
puts definitions first and alias lines (`b = a`) inside the filler. They render either as text sized by tokens with
the tokenizer at hand (`fit_text`: task files) or straight to token ids (`render_ids`: training windows).
"""
from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

Split = Literal["train", "eval"]
TERMINATOR = "\n"
SPLIT_SALT = "compiledllm-synth/"
EVAL_PERMILLE = 50  # 5 % of canonical keys are evaluation items
ROLE_TEXT, ROLE_PROMPT, ROLE_ANSWER, ROLE_PAD = 0, 1, 2, 3  # per-token roles of rendered ids (tiny_mix.py)


def split_of(canonical: str) -> Split:
    h = int(hashlib.sha1((SPLIT_SALT + canonical).encode()).hexdigest()[:8], 16)
    return "eval" if h % 1000 < EVAL_PERMILLE else "train"


@dataclass(frozen=True)
class Sample:
    """A short task: the model reads `prompt` and must write `reference` (" <answer>\\n")."""
    kind: str
    prompt: str
    reference: str
    canonical: str

    @property
    def answer(self) -> str:
        return self.reference.strip()


@dataclass(frozen=True)
class Question:
    text: str         # e.g. 'table["mk4821"] =='
    reference: str    # " 93017\n"
    canonical: str
    needles: tuple[tuple[int, int, int], ...]  # (piece index, start, end): the text the answer depends on


@dataclass(frozen=True)
class LongSample:
    kind: str
    pieces: tuple[str, ...]    # each ends with "\n"; filler follows piece i by shares[i] of the filler
    shares: tuple[float, ...]
    questions: tuple[Question, ...]
    n_entries: int             # table entries (retrieval) or variables defined (binding)


# ------------------------------------------------------------------------------------------ short tasks

def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1) if digits > 1 else rng.randint(0, 9)


def _draw(rng: random.Random, split: Split, make: Callable[[], tuple[str, str, str]], kind: str) -> Sample:
    for _ in range(100_000):
        prompt, answer, canonical = make()
        if split_of(canonical) == split:
            return Sample(kind, prompt, f" {answer}{TERMINATOR}", canonical)
    raise RuntimeError(f"{kind}: no {split} item in 100,000 draws")


def addition(rng: random.Random, split: Split = "train", digits: tuple[int, int] = (2, 5)) -> Sample:
    def make():
        a, b = (_number(rng, rng.randint(*digits)) for _ in range(2))
        return f"{a} + {b} =", str(a + b), f"add/{a}+{b}"
    return _draw(rng, split, make, "add")


def multiplication(rng: random.Random, split: Split = "train") -> Sample:
    """(2-4 digits) x (1 digit 2-9) or (2 digits) x (2 digits)."""
    def make():
        if rng.random() < 0.6:
            a, b = _number(rng, rng.randint(2, 4)), rng.randint(2, 9)
        else:
            a, b = _number(rng, 2), _number(rng, 2)
        return f"{a} * {b} =", str(a * b), f"mul/{a}*{b}"
    return _draw(rng, split, make, "mul")


def _list_task(rng, split, kind: str, fn, length: tuple[int, int]) -> Sample:
    def make():
        xs = [rng.randint(0, 99) for _ in range(rng.randint(*length))]
        shown = "[" + ", ".join(map(str, xs)) + "]"
        return f"{kind}: {shown} =", "[" + ", ".join(map(str, fn(xs))) + "]", f"{kind}/{shown}"
    return _draw(rng, split, make, kind)


def sort_list(rng: random.Random, split: Split = "train", length: tuple[int, int] = (3, 8)) -> Sample:
    return _list_task(rng, split, "sort", sorted, length)


def reverse_list(rng: random.Random, split: Split = "train", length: tuple[int, int] = (3, 8)) -> Sample:
    return _list_task(rng, split, "reverse", lambda xs: xs[::-1], length)


def copy_list(rng: random.Random, split: Split = "train", length: tuple[int, int] = (3, 8)) -> Sample:
    return _list_task(rng, split, "copy", list, length)


SHORT = {"add": addition, "mul": multiplication, "sort": sort_list, "reverse": reverse_list, "copy": copy_list}


# ------------------------------------------------------------------------------------------- long tasks

def _look_alike(rng: random.Random, digits: str) -> str:
    """The same key with one digit changed or two neighbours swapped."""
    d = list(digits)
    i = rng.randrange(len(d) - 1)
    if rng.random() < 0.5 and d[i] != d[i + 1]:
        d[i], d[i + 1] = d[i + 1], d[i]
    else:
        d[i] = rng.choice([c for c in string.digits if c != d[i]])
    return "".join(d)


def retrieval(rng: random.Random, split: Split = "train", n_entries: int | None = None,
              n_questions: int = 1) -> LongSample:
    """`table = {"mk4821": 93017, ...}` first, then filler, then `table["mk4821"] ==` -> " 93017\\n". The asked
    keys (needles) each come with look-alike distractors (one digit changed or swapped, same letters)."""
    n = n_entries or rng.randint(8, 16)
    n_questions = min(n_questions, n)
    letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(2))
    keys: list[str] = []
    while len(keys) < n:
        key = letters + f"{rng.randint(0, 9999):04d}"
        if key not in keys:
            keys.append(key)
    asked = rng.sample(range(n), n_questions)
    others = [i for i in range(n) if i not in asked]
    for j, o in enumerate(others):  # every needle gets a look-alike; the other keys half the time
        if j >= len(asked) and rng.random() < 0.5:
            continue
        src = keys[asked[j % len(asked)]] if j < len(asked) else keys[rng.randrange(n)]
        for _ in range(100):
            key = letters + _look_alike(rng, src[2:])
            if key not in keys:
                keys[o] = key
                break
    values: list[int] = []
    while len(values) < n:
        v = rng.randint(10000, 99999)
        if v not in values:
            values.append(v)
    for i in asked:  # the asked pairs come from the split's side; the others are only table text
        while split_of(f"ret/{keys[i]}={values[i]}") != split:
            v = rng.randint(10000, 99999)
            if v not in values:
                values[i] = v
    order = list(range(n))
    rng.shuffle(order)
    lines, spans, pos = ["table = {\n"], {}, len("table = {\n")
    for i in order:
        line = f'    "{keys[i]}": {values[i]},\n'
        spans[i] = (0, pos, pos + len(line))
        lines.append(line)
        pos += len(line)
    lines.append("}\n")
    qs = tuple(Question(f'table["{keys[i]}"] ==', f" {values[i]}{TERMINATOR}", f"ret/{keys[i]}={values[i]}",
                        (spans[i],)) for i in asked)
    return LongSample("retrieval", ("".join(lines),), (1.0,), qs, n)


_PREFIXES = ("cfg", "opt", "val", "ref", "arg", "env", "tmp", "key")


def binding(rng: random.Random, split: Split = "train", hops: int | None = None,
            n_vars: int | None = None) -> LongSample:
    """Definitions `cfg_qxv = 4821` (look-alike names) first; alias lines `cfg_vzk = cfg_qxv` spread through the
    filler (hops - 1 of them, plus distractor aliases); then `assert <last alias> ==` -> " 4821\\n"."""
    hops = hops or rng.randint(1, 3)
    n = n_vars or rng.randint(4, 8)
    prefix = rng.choice(_PREFIXES)
    stem = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
    names: list[str] = []
    while len(names) < n + hops + 2:
        s = list(stem)
        if names:  # look-alikes of the stem: permuted, or one letter changed
            if rng.random() < 0.5:
                rng.shuffle(s)
            else:
                s[rng.randrange(3)] = rng.choice(string.ascii_lowercase)
        name = f"{prefix}_{''.join(s)}"
        if name not in names:
            names.append(name)
    defs, aliases = names[:n], names[n:]
    values = rng.sample(range(10, 10000), n)
    target = rng.randrange(n)
    chain = [defs[target], *aliases[: hops - 1]]
    while split_of(f"bind/{'>'.join(chain)}={values[target]}") != split:
        v = rng.randint(10, 9999)
        if v not in values:
            values[target] = v
    head, pos, def_span = [], 0, None
    for i in range(n):
        line = f"{defs[i]} = {values[i]}\n"
        if i == target:
            def_span = (0, pos, pos + len(line))
        head.append(line)
        pos += len(line)
    pieces = ["".join(head)] + [f"{chain[i + 1]} = {chain[i]}\n" for i in range(hops - 1)]
    spans = [def_span] + [(i + 1, 0, len(pieces[i + 1])) for i in range(hops - 1)]
    others = [d for i, d in enumerate(defs) if i != target]
    for extra in aliases[hops - 1:][: rng.randint(0, 2)]:  # distractor aliases of other definitions
        at = rng.randint(1, len(pieces))
        pieces.insert(at, f"{extra} = {rng.choice(others)}\n")
        spans = [(p + (p >= at), a, b) for p, a, b in spans]
    weights = [rng.random() + 0.2 for _ in pieces]
    shares = tuple(w / sum(weights) for w in weights)
    q = Question(f"assert {chain[-1]} ==", f" {values[target]}{TERMINATOR}",
                 f"bind/{'>'.join(chain)}={values[target]}", tuple(spans))
    return LongSample("binding", tuple(pieces), shares, (q,), n)


LONG = {"retrieval": retrieval, "binding": binding}


# -------------------------------------------------------------------------------------------- rendering

def _gaps(total: int, shares: Sequence[float]) -> list[int]:
    """Split `total` filler units over the gaps in proportion to shares (sums to total)."""
    cuts = [round(total * sum(shares[: i + 1])) for i in range(len(shares))]
    cuts[-1] = total
    return [b - a for a, b in zip([0, *cuts[:-1]], cuts)]


def render_text(s: LongSample, filler: Sequence[str], question: int = 0) -> tuple[str, str, list[tuple[int, int]]]:
    """(prompt, reference, needle char spans in the prompt): pieces with the filler lines between them, then
    the question."""
    parts, starts, pos, at = [], [], 0, 0
    for piece, n in zip(s.pieces, _gaps(len(filler), s.shares)):
        starts.append(pos)
        fill = "".join(filler[at : at + n])
        at += n
        parts += [piece, fill]
        pos += len(piece) + len(fill)
    q = s.questions[question]
    prompt = "".join(parts) + q.text
    return prompt, q.reference, [(starts[p] + a, starts[p] + b) for p, a, b in q.needles]


def fit_text(s: LongSample, filler: Sequence[str], count: Callable[[str], int], target: int):
    """render_text with as many filler lines as keep the prompt within `target` tokens (binary search);
    returns (prompt, reference, needle spans, prompt tokens, filler lines used)."""
    lo, hi = 0, len(filler)
    if count(render_text(s, filler[:hi])[0]) <= target:
        raise ValueError(f"{len(filler)} filler lines are not enough for {target} tokens")
    while lo < hi:  # the largest n with count(prompt(n)) <= target
        mid = (lo + hi + 1) // 2
        if count(render_text(s, filler[:mid])[0]) <= target:
            lo = mid
        else:
            hi = mid - 1
    prompt, ref, spans = render_text(s, filler[:lo])
    return prompt, ref, spans, count(prompt), lo


class FillerLines:
    """Consecutive source lines from random places in a list of texts (the task files' filler)."""

    def __init__(self, texts: Sequence[str], max_line: int = 160):
        self.files = [ls for ls in ([ln for ln in t.splitlines(keepends=True) if len(ln) <= max_line] for t in texts)
                      if len(ls) > 20]
        if not self.files:
            raise ValueError("no filler text")

    def take(self, rng: random.Random, chars: int) -> list[str]:
        out, n = [], 0
        while n < chars:
            lines = self.files[rng.randrange(len(self.files))]
            for ln in lines[rng.randrange(len(lines)) :]:
                out.append(ln if ln.endswith("\n") else ln + "\n")
                n += len(ln)
                if n >= chars:
                    break
        return out


class FillerIds:
    """Token slices of a training stream cut at line ends (the training windows' filler): a slice starts after a
    token holding a newline and ends with one (replaced by the plain newline id); EOS inside becomes a newline."""

    def __init__(self, stream: np.ndarray, has_newline: np.ndarray, newline_id: int, eos_id: int):
        self.stream = stream
        self.ends = np.flatnonzero(has_newline[stream])
        self.newline, self.eos = newline_id, eos_id

    def take(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if n <= 0:
            return self.stream[:0]
        i = int(rng.integers(0, max(1, len(self.ends) - 1)))
        start = int(self.ends[i]) + 1
        j = int(np.searchsorted(self.ends, start + n - 1, side="right")) - 1  # last line end within n tokens
        end = int(self.ends[j]) + 1 if j > i else start + n
        out = self.stream[start : min(end, len(self.stream))].copy()
        out[out == self.eos] = self.newline
        if len(out):
            out[-1] = self.newline
        return out


def render_ids(s: LongSample, encode: Callable[[list[str]], list[list[int]]], filler: FillerIds,
               rng: np.random.Generator, total: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, roles) of about `total` tokens: pieces and filler, every question followed by its reference, then
    EOS. Roles: ROLE_ANSWER for references and the EOS, ROLE_PROMPT for the rest."""
    texts = list(s.pieces) + [t for q in s.questions for t in (q.text, q.reference)]
    enc = [np.asarray(e, dtype=np.int32) for e in encode(texts)]
    pieces, qa = enc[: len(s.pieces)], enc[len(s.pieces):]
    fixed = sum(map(len, enc)) + 1
    ids, roles = [], []
    for piece, n in zip(pieces, _gaps(max(0, total - fixed), s.shares)):
        fill = filler.take(rng, n)
        ids += [piece, fill]
        roles += [np.full(len(piece) + len(fill), ROLE_PROMPT, np.uint8)]
    for i, e in enumerate(qa):
        ids.append(e)
        roles.append(np.full(len(e), ROLE_ANSWER if i % 2 else ROLE_PROMPT, np.uint8))
    ids.append(np.array([eos_id], np.int32))
    roles.append(np.array([ROLE_ANSWER], np.uint8))
    return np.concatenate(ids), np.concatenate(roles)


# ------------------------------------------------------------------------------------------- task files

EVAL_SEED = 20_240_615  # task files come from their own seed (besides the split)
SHORT_FILES = {"arithmetic": ("add", "mul"), "lists": ("sort", "reverse", "copy")}


def short_task_file(name: str, n: int, seed: int = EVAL_SEED) -> list[dict]:
    """n tasks cycling over the file's kinds, from the evaluation side of the split, no prompt twice."""
    rng = random.Random(f"{seed}/{name}")
    kinds = SHORT_FILES[name]
    out, seen = [], set()
    while len(out) < n:
        s = SHORT[kinds[len(out) % len(kinds)]](rng, "eval")
        if s.canonical in seen:
            continue
        seen.add(s.canonical)
        out.append({"id": f"{name}/{len(out):03d}", "prompt": s.prompt, "reference": s.reference,
                    "metric": "exact", "meta": {"kind": s.kind, "answer": s.answer, "canonical": s.canonical}})
    return out


def long_task_file(kind: str, n: int, context: int, tokenizer, filler: FillerLines, *, reserve: int = 128,
                   seed: int = EVAL_SEED, name: str | None = None, **gen_kw) -> list[dict]:
    """n `kind` tasks whose prompts hold context - reserve tokens (at most; within one filler line of it) under
    `tokenizer` (a `tokenizers.Tokenizer`). Each records its needles: the character spans of the prompt the
    answer depends on, and the tokens [first, last + 1) that overlap them under this tokenizer."""
    name = name or f"{kind}_{context}"
    rng = random.Random(f"{seed}/{name}")
    target = context - reserve
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    fingerprint = tokenizer_fingerprint(tokenizer)
    out, seen = [], set()
    while len(out) < n:
        s = LONG[kind](rng, "eval", **gen_kw)
        if s.questions[0].canonical in seen:
            continue
        seen.add(s.questions[0].canonical)
        lines = filler.take(rng, target * 6)
        prompt, ref, spans, n_tok, _ = fit_text(s, lines, count, target)
        offsets = tokenizer.encode(prompt, add_special_tokens=False).offsets
        tok_spans = [char_span_to_tokens(offsets, a, b) for a, b in spans]
        q = s.questions[0]
        out.append({"id": f"{name}/{len(out):03d}", "prompt": prompt, "reference": ref, "metric": "exact",
                    "meta": {"kind": kind, "answer": ref.strip(), "canonical": q.canonical, "context": context,
                             "prompt_tokens": n_tok, "needle_chars": [list(x) for x in spans],
                             "needle_tokens": [list(x) for x in tok_spans], "tokenizer": fingerprint,
                             "distance_tokens": n_tok - max(b for _, b in tok_spans[:1]),
                             "entries": s.n_entries}})
    return out


def char_span_to_tokens(offsets: Sequence[tuple[int, int]], a: int, b: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens whose characters overlap [a, b)."""
    idx = [i for i, (s, e) in enumerate(offsets) if s < b and e > a]
    return idx[0], idx[-1] + 1


def tokenizer_fingerprint(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:12]
