"""Training batches of the tiny-llada2.1 and tiny-llada kinds (tools/train/train_tiny.py): windows of stdlib code and
generated tasks (tools/train/synth_tasks.py), noised for the kind's objective, as numpy arrays.

A batch is a pure function of (seed, step): a run resumed at step s builds exactly the batches an uninterrupted
run would have built, with no generator state to save, the CPU and the GPU see the same data, and any number of
worker processes can build steps side by side (tools/train/train_kinds.py's loader).

Curriculum (MixConfig.schedule, also a function of the step): over the first grow_steps steps the window shares
move from early_shares (more short tasks) to shares, and the longest lookup sample of a short window grows from
lookup_start to lookup_len[1]: arithmetic, lists and lookups at short distance first, then farther.

Window types (one per window; a short step draws each window's type by MixConfig.shares):
  code    L tokens of the training-file stream, every token trained (ROLE_TEXT);
  tasks   short tasks packed back to back: prompt (ROLE_PROMPT: seen clean, no loss), reference + EOS
          (ROLE_ANSWER), then EOS padding (ROLE_PAD, loss weight pad_weight), so that the masks a decode leaves
          after an answer (the rest of its block) are learnt as EOS; whatever is left of the window is code;
  lookup  retrieval / variable-binding samples of `lookup_len` tokens, packed (table, filler and questions are
          ROLE_PROMPT, the references ROLE_ANSWER); the rest code;
  long    (long steps) lookup samples of `long_len` tokens (log-uniform) packed into one long window.
Objectives:
  block diffusion (tiny-llada2.1): the model sees [x0 ; x_t of the noisy positions] under the block-diffusion mask
    (bids: block id per token; noisy block b sees noisy block b and clean blocks < b, clean block b sees clean
    blocks <= b). Short steps: every position is noisy (the legacy layout). Long steps: only the blocks holding
    answers plus random other blocks up to `noisy_cap` tokens are noisy (the rest of the window is clean context):
    a long window costs L + noisy_cap tokens instead of 2L, and is exactly the decode situation (a long clean
    prompt, a block being decoded at its end). Unused noisy slots are dummies that see only themselves.
  masked diffusion (tiny-llada): x_t of the whole window, fully bidirectional, one ratio t ~ U(0, 1) per window.
"""
from __future__ import annotations

import functools
import math
import random
import re
from dataclasses import dataclass

import numpy as np

import synth_tasks as S
from synth_tasks import ROLE_ANSWER, ROLE_PAD, ROLE_PROMPT, ROLE_TEXT


@dataclass(frozen=True)
class MixConfig:
    shares: tuple[float, float, float] = (0.35, 0.45, 0.20)        # code, tasks, lookup windows of short steps
    short_kinds: tuple[tuple[str, float], ...] = (("add", 0.2), ("mul", 0.2), ("sort", 0.2), ("reverse", 0.2),
                                                 ("copy", 0.2))
    lookup_kinds: tuple[tuple[str, float], ...] = (("retrieval", 0.6), ("binding", 0.4))
    lookup_len: tuple[int, int] = (128, 1024)   # tokens of a lookup sample in a short window
    long_len: tuple[int, int] = (512, 8192)     # tokens of a lookup sample in a long window (log-uniform)
    questions: tuple[int, int] = (1, 4)         # questions per retrieval sample (at most entries // 2: each
                                                # needle keeps a look-alike distractor)
    long_questions: tuple[int, int] | None = None  # the same in long windows (None: questions)
    entries: tuple[int, int] = (8, 16)          # table entries of a retrieval sample
    variables: tuple[int, int] = (4, 8)         # definitions of a binding sample
    eos_pad: tuple[int, int] = (0, 0)           # EOS padding after each answer
    early_shares: tuple[float, float, float] | None = None  # shares at step 0 (None: shares throughout)
    lookup_start: int = 0                       # longest short-window lookup sample at step 0 (0: lookup_len[1])
    grow_steps: int = 0                         # steps over which early_shares -> shares, lookup_start -> max

    def schedule(self, step: int) -> tuple[tuple[float, ...], tuple[int, int]]:
        """(window shares, short-window lookup lengths) at `step`: linear in the step up to grow_steps."""
        f = 1.0 if self.grow_steps <= 0 else min(1.0, step / self.grow_steps)
        shares = tuple(a + (b - a) * f for a, b in zip(self.early_shares or self.shares, self.shares))
        lo, hi = self.lookup_len
        start = min(hi, max(lo, self.lookup_start or hi))
        return shares, (lo, int(round(start + (hi - start) * f)))


@dataclass(frozen=True)
class Objective:
    kind: str                                   # "bd" (block diffusion) or "mdm" (masked diffusion)
    block_sizes: tuple[int, ...] = (8, 16, 32, 64)
    p_bidir: float = 0.1                        # bd: code windows of short steps as one bidirectional block
    p_t2t: float = 0.5                          # bd: share of windows with random-token corruption (LLaDA2.1 T2T)
    max_corrupt: float = 0.2
    keep_weight: float = 0.1                    # bd: loss weight of visible (uncorrupted) trainable tokens
    noisy_cap: int = 1024                       # bd long steps: noisy tokens per window
    pad_weight: float = 0.25                    # loss weight of the EOS padding after answers
    other_weight: float = 1.0                   # bd long steps: loss weight of the noisy blocks without answers


@dataclass(frozen=True)
class Shapes:
    short_len: int
    short_batch: int
    long_len: int = 0          # 0: no long steps
    long_batch: int = 0
    long_from: int = 500       # first long step
    long_every: int = 2        # then every long_every-th step is long

    def is_long(self, step: int) -> bool:
        return self.long_len > 0 and step >= self.long_from and (step - self.long_from) % self.long_every == 0


class DigitSplitEncoder:
    """Exact ids of ASCII text for a tokenizer whose pre-tokenizer splits every digit off first (tiny_data's
    digits=True): no token spans a digit boundary, so a text's ids are its digit-free segments' ids (cached: the
    generated tasks repeat a few dozen of them) with one digit id per digit between them. Several times faster than
    the tokenizer on the generated tasks, which are mostly digits. Non-ASCII text goes to the tokenizer."""

    _split = re.compile(r"([0-9])")

    def __init__(self, tokenizer, cache_size: int = 1 << 16):
        self.tok = tokenizer
        self.digit = {d: tokenizer.token_to_id(d) for d in "0123456789"}
        self.segment = functools.lru_cache(maxsize=cache_size)(self._segment)

    def _segment(self, text: str) -> tuple[int, ...]:
        return tuple(self.tok.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        if not text.isascii():
            return self.tok.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for i, seg in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self.digit[seg])
            elif seg:
                out += self.segment(seg)
        return out

    def exact_on(self, texts: list[str]) -> bool:
        return all(self.encode(t) == self.tok.encode(t, add_special_tokens=False).ids for t in texts)


def _pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    return rng.choices([k for k, _ in weighted], [w for _, w in weighted])[0]


class Windows:
    """Builds the (ids, roles) windows from a token stream and the generators."""

    def __init__(self, tokenizer, stream: np.ndarray, mix: MixConfig, eos_id: int):
        self.tok, self.stream, self.mix, self.eos = tokenizer, stream, mix, eos_id
        vocab = tokenizer.get_vocab()
        has_nl = np.zeros(tokenizer.get_vocab_size(), dtype=bool)
        for piece, i in vocab.items():
            has_nl[i] = "Ċ" in piece  # byte-level BPE spells "\n" as Ċ
        has_nl[eos_id] = True
        self.newline = tokenizer.token_to_id("Ċ")
        self.filler = S.FillerIds(stream, has_nl, self.newline, eos_id)
        fast = DigitSplitEncoder(tokenizer)
        probe = ["12 + 345 =", " 357\n", "sort: [7, 40, 3] =", 'table["ab0123"] ==', "    \"ab0123\": 45678,\n",
                 "cfg_abc = 12\n", "x9y", "00"]
        self.fast = fast if None not in fast.digit.values() and fast.exact_on(probe) else None  # digits not split

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.fast is not None:
            return [self.fast.encode(t) for t in texts]
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def code(self, rng: np.random.Generator, L: int) -> tuple[np.ndarray, np.ndarray]:
        off = int(rng.integers(0, len(self.stream) - L))
        return self.stream[off : off + L].astype(np.int32), np.full(L, ROLE_TEXT, np.uint8)

    def _pad(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.mix.eos_pad
        n = int(rng.integers(lo, hi + 1)) if hi > 0 else 0
        return np.full(n, self.eos, np.int32), np.full(n, ROLE_PAD, np.uint8)

    def _fill(self, parts, rng, L: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
        roles = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.uint8)
        if len(ids) < L:
            c_ids, c_roles = self.code(rng, L - len(ids))
            ids, roles = np.concatenate([ids, c_ids]), np.concatenate([roles, c_roles])
        return ids[:L], roles[:L]

    def tasks(self, rng_py: random.Random, rng: np.random.Generator, L: int):
        ids: list[int] = []
        roles: list[int] = []
        lo, hi = self.mix.eos_pad
        while True:  # about as many samples as the rest of the window holds (~24 tokens each, with the padding)
            k = max(4, min(64, (L - len(ids)) // (24 + (lo + hi) // 2)))
            samples = [S.SHORT[_pick(rng_py, self.mix.short_kinds)](rng_py, "train") for _ in range(k)]
            enc = self.encode([t for s in samples for t in (s.prompt, s.reference)])
            pads = rng.integers(lo, hi + 1, k) if hi > 0 else np.zeros(k, np.int64)
            for p, r, pad in zip(enc[::2], enc[1::2], pads.tolist()):
                if len(ids) + len(p) + len(r) + 1 + pad > L:
                    part = (np.asarray(ids, np.int32), np.asarray(roles, np.uint8))
                    return self._fill([part], rng, L)
                ids += p + r + [self.eos] * (1 + pad)
                roles += [ROLE_PROMPT] * len(p) + [ROLE_ANSWER] * (len(r) + 1) + [ROLE_PAD] * pad

    def lookup(self, rng_py: random.Random, rng: np.random.Generator, L: int, lengths: tuple[int, int],
               log_uniform: bool, questions: tuple[int, int] | None = None):
        parts, n = [], 0
        lo, hi = lengths
        questions = questions or self.mix.questions
        while L - n >= lo:
            top = min(hi, L - n)
            total = int(math.exp(rng_py.uniform(math.log(lo), math.log(top)))) if log_uniform else rng_py.randint(lo, top)
            kind = _pick(rng_py, self.mix.lookup_kinds)
            if kind == "retrieval":
                entries = rng_py.randint(*self.mix.entries)
                kw = {"n_questions": min(rng_py.randint(*questions), max(1, entries // 2)), "n_entries": entries}
            else:
                kw = {"n_vars": rng_py.randint(*self.mix.variables)}
            s = S.LONG[kind](rng_py, "train", **kw)
            pad = self._pad(rng)
            ids, roles = S.render_ids(s, self.encode, self.filler, rng, total - len(pad[0]), self.eos)
            if n + len(ids) + len(pad[0]) > L:
                break
            parts += [(ids, roles), pad]
            n += len(ids) + len(pad[0])
        return self._fill(parts, rng, L)


# ------------------------------------------------------------------------------------------------ noise

def bd_noise(ids: np.ndarray, roles: np.ndarray, obj: Objective, rng: np.random.Generator, vocab: int,
             n_special: int, mask_id: int, pad_id: int, sparse: bool, bidir: bool) -> dict:
    """One window's block-diffusion arrays: tokens [L + T] (x0 then x_t), positions, bids, and per noisy slot
    targets / weights / masked / answer (T = L, or noisy_cap when sparse)."""
    L = len(ids)
    sizes = [b for b in obj.block_sizes if not sparse or b <= obj.noisy_cap] or [min(obj.block_sizes)]
    bs = L if bidir else int(rng.choice(sizes))
    bid = np.arange(L) // bs
    roles = roles.copy()
    other = np.zeros(L, bool)  # sparse: the tokens of the noisy blocks that hold no answer
    if sparse:
        n_blocks, cap = -(-L // bs), obj.noisy_cap // bs
        answer_blocks = np.unique(bid[roles == ROLE_ANSWER])
        if len(answer_blocks) > cap:
            answer_blocks = np.sort(rng.choice(answer_blocks, cap, replace=False))
        rest = np.setdiff1d(np.arange(n_blocks), answer_blocks)
        others = rng.choice(rest, min(len(rest), cap - len(answer_blocks)), replace=False)
        for b in others:  # the other noisy blocks are trained as plain text (weight other_weight)
            sl = slice(b * bs, (b + 1) * bs)
            roles[sl] = np.where(roles[sl] == ROLE_PROMPT, ROLE_TEXT, roles[sl])
            other[sl] = True
        blocks = np.sort(np.concatenate([answer_blocks, others])).astype(np.int64)
        pos = (blocks[:, None] * bs + np.arange(bs)).ravel()
        pos = pos[pos < L]
    else:
        pos = np.arange(L)
    T = obj.noisy_cap if sparse else L
    n = len(pos)
    x0n, rn = ids[pos], roles[pos]
    t = rng.random(bid[-1] + 1)[bid[pos]]
    trainable = rn != ROLE_PROMPT
    masked = trainable & (rng.random(n) < t)
    corrupt = np.zeros(n, bool)
    rand_tok = rng.integers(n_special, vocab, n)
    if rng.random() < obj.p_t2t:
        rate = rng.random() * obj.max_corrupt
        corrupt = trainable & ~masked & (rng.random(n) < rate) & (rand_tok != x0n)
    xt = np.where(masked, mask_id, np.where(corrupt, rand_tok, x0n))
    w = masked + corrupt + obj.keep_weight * (trainable & ~masked & ~corrupt)
    w = w * np.where(rn == ROLE_PAD, obj.pad_weight, 1.0) * np.where(other[pos], obj.other_weight, 1.0)

    def slots(a, fill):
        out = np.full(T, fill, dtype=a.dtype)
        out[:n] = a
        return out

    dummy_bid = -1 - np.arange(T)  # dummies see only themselves
    return {"tokens": np.concatenate([ids, slots(xt.astype(np.int32), pad_id)]),
            "positions": np.concatenate([np.arange(L), slots(pos, 0)]),
            "bids": np.concatenate([bid, np.where(np.arange(T) < n, slots(bid[pos], 0), dummy_bid)]).astype(np.int32),
            "targets": slots(x0n.astype(np.int32), pad_id), "weights": slots(w.astype(np.float32), 0.0),
            "masked": slots(masked, False), "answer": slots(rn == ROLE_ANSWER, False)}


def mdm_noise(ids: np.ndarray, roles: np.ndarray, obj: Objective, rng: np.random.Generator, mask_id: int) -> dict:
    """One window's masked-diffusion arrays: every non-prompt token masked with one ratio t ~ U(0, 1)."""
    L = len(ids)
    trainable = roles != ROLE_PROMPT
    masked = trainable & (rng.random(L) < rng.random())
    if not masked.any() and trainable.any():
        masked[rng.choice(np.flatnonzero(trainable))] = True
    w = masked * np.where(roles == ROLE_PAD, obj.pad_weight, 1.0)
    return {"tokens": np.where(masked, mask_id, ids).astype(np.int32), "positions": np.arange(L),
            "targets": ids.astype(np.int32), "weights": w.astype(np.float32), "masked": masked,
            "answer": roles == ROLE_ANSWER}


class Batches:
    """make(step) -> the step's batch: dict of stacked numpy arrays plus "long" (bool) and "n_clean"."""

    def __init__(self, windows: Windows, shapes: Shapes, obj: Objective, seed: int, vocab: int, n_special: int,
                 mask_id: int, pad_id: int):
        self.w, self.shapes, self.obj, self.seed = windows, shapes, obj, seed
        self.vocab, self.n_special, self.mask_id, self.pad_id = vocab, n_special, mask_id, pad_id

    def make(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        rng_py = random.Random(f"{self.seed}/{step}")
        long = self.shapes.is_long(step)
        L, B = ((self.shapes.long_len, self.shapes.long_batch) if long
                else (self.shapes.short_len, self.shapes.short_batch))
        mix = self.w.mix
        shares, short_lookup = mix.schedule(step)
        rows = []
        for _ in range(B):
            kind = "long" if long else rng_py.choices(("code", "tasks", "lookup"), shares)[0]
            if kind == "code":
                ids, roles = self.w.code(rng, L)
            elif kind == "tasks":
                ids, roles = self.w.tasks(rng_py, rng, L)
            elif long:
                ids, roles = self.w.lookup(rng_py, rng, L, mix.long_len, log_uniform=True,
                                           questions=mix.long_questions)
            else:
                lengths = (short_lookup[0], min(short_lookup[1], L))
                ids, roles = self.w.lookup(rng_py, rng, L, lengths, log_uniform=False)
            if self.obj.kind == "bd":
                bidir = kind == "code" and rng.random() < self.obj.p_bidir
                rows.append(bd_noise(ids, roles, self.obj, rng, self.vocab, self.n_special, self.mask_id,
                                     self.pad_id, sparse=long, bidir=bidir))
            else:
                rows.append(mdm_noise(ids, roles, self.obj, rng, self.mask_id))
            rows[-1]["code"] = np.array(kind == "code")
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        batch["long"] = long
        batch["n_clean"] = L if self.obj.kind == "bd" else 0
        return batch

    def held_out(self, stream: np.ndarray, n: int, seed: int) -> dict:
        """Code windows of another stream (held-out files), noised as short steps: the held-out loss batch."""
        rng = np.random.default_rng([seed, 1 << 30])
        L = self.shapes.short_len
        rows = []
        for _ in range(n):
            off = int(rng.integers(0, max(1, len(stream) - L)))
            ids = stream[off : off + L].astype(np.int32)
            roles = np.full(L, ROLE_TEXT, np.uint8)
            rows.append(bd_noise(ids, roles, self.obj, rng, self.vocab, self.n_special, self.mask_id, self.pad_id,
                                 sparse=False, bidir=False) if self.obj.kind == "bd"
                        else mdm_noise(ids, roles, self.obj, rng, self.mask_id))
            rows[-1]["code"] = np.array(True)
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        return batch | {"long": False, "n_clean": L if self.obj.kind == "bd" else 0}

