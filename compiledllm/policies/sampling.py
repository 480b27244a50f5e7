"""Sampling for every policy's token choice: temperature, top-k, top-p and a seed (docs/design.md §4).

What is drawn - LLaDA2's published `generate` (`_sample_with_temperature_topk_topp`): the logits are divided by the
temperature T, filtered by top-k, then by top-p, and v_i is drawn from the softmax of what is left. Here:

* MASK never is a candidate (the greedy rule excludes it too): its logit counts as -inf before any filter.
* top-k keeps the tokens whose logit is >= the k-th largest (ties at the k-th value all kept, as LLaDA2's
  `logits < min_values` filter); top_k >= the vocabulary keeps every token.
* top-p, on q = softmax(logits / T) over the tokens top-k kept (renormalised): keeps the smallest set of the most
  probable tokens whose mass is >= top_p, plus any token tied with its least probable one; in the sorted order,
  token j stays iff the mass before it is < top_p (LLaDA2 keeps it iff that mass is <= top_p: they differ only
  where the mass equals top_p exactly). top_p = 1 filters nothing (as LLaDA2).
  Both filters come down to one per-row logit cutoff c (`cutoff`): a token is kept iff its logit >= c.
* v_i = argmax over kept tokens of x_j + T * g_j (x: the float32 logits, g_j: Gumbel noise, ties -> lower id):
  Gumbel-max, i.e. a draw from softmax(x / T) over the kept tokens - LLaDA2's torch.multinomial, in distribution.
* p_i stays what the greedy rule defines: the probability of v_i under the model's full-vocabulary softmax of the
  untempered logits, in float32 (MASK in the denominator) - so threshold / tau_mask / tau_edit keep their meaning.
  LLaDA2 instead reads p from the tempered, filtered distribution it sampled from.
* temperature 0 (the default) is the greedy rule exactly (top_k / top_p have no effect: the argmax is always kept).

The noise is counter-based, so a request's tokens never depend on its slot, its batch, or any generator state:
    request key  r = H(H(ROOT, seed), index)         on the host at admission (SlotState.key);
                 index = the prompt's position in the run (its place in generate()'s list, the recipe's prompts)
    row key      k = H(H(r, position), draws)        in the step; draws = the row's count of kept updates (its
                                                     forwards for threshold and t2t; for flowblock a counter in its
                                                     state, so flowblock_sync's discarded steps keep flowblock's tokens)
    per token    u_j = ((H(k, j) >> 9) + 0.5) * 2^-23 in (0, 1),  g_j = -log(-log(u_j))
with H(h, x) = lowbias32(h ^ (x * 0x9E3779B9 mod 2^32)) on 32-bit words (lowbias32: C. Wellons' hash prospector).
It is integer arithmetic on int64 tensors that never overflows (`mul32`), so the same function gives the same bits
eagerly, compiled and inside a CUDA graph, and on Python ints. Sampling runs as torch ops on every device (the
fused greedy kernel of confidence_kernel.py is not used at temperature > 0; compiled, Inductor fuses the noise).
Keys are 32-bit: two (position, draws) pairs of one request share a noise row with probability 2^-32.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive counters over the word before mixing
ROOT = 0x2545F491    # the key chain's start (any constant: it keeps seed 0, index 0 off lowbias32's fixed point 0)
SEED_LIMIT = 1 << 32


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0     # 0: greedy
    top_k: int | None = None     # keep the k most likely tokens (None: all)
    top_p: float | None = None   # keep the smallest most likely set with mass >= top_p (None or 1: all)
    seed: int = 0                # with the request's index, keys its noise (the request key, SlotState.key)

    def __post_init__(self) -> None:
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not _number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {t!r}")
        if k is not None and (not _integer(k) or k < 1):
            raise ValueError(f"top_k: must be an integer >= 1 (or null), got {k!r}")
        if p is not None and (not _number(p) or not 0 < p <= 1):
            raise ValueError(f"top_p: must be within (0, 1] (or null), got {p!r}")
        if not _integer(seed) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed: must be an integer in [0, 2**32), got {seed!r}")
        # plain Python numbers: they are constants of the compiled step (guarded by value)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", None if k is None else int(k))
        object.__setattr__(self, "top_p", None if p is None or p >= 1 else float(p))
        object.__setattr__(self, "seed", int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def mul32(x, c: int):
    """x * c mod 2^32 for x in [0, 2^32) (int64 tensor or int): c split in 16-bit halves, so no product leaves
    int64's range (signed overflow is not defined behaviour everywhere torch compiles to)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x):
    """lowbias32: a bijection of [0, 2^32) with low avalanche bias."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def absorb(h, x):
    """H(h, x): the 32-bit state h with the counter x mixed in."""
    return mix32(h ^ mul32(x & M32, GOLDEN))


def request_key(seed: int, index: int) -> int:
    """The key of the run's request number `index` (its SlotState.key), on the host."""
    return absorb(absorb(ROOT, seed), index)


def noise_key(request: torch.Tensor, draws: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, K] long: the key of each logits row, from the request key [B], the row's draw count [B] and each row's
    sequence position [B, K]."""
    return absorb(absorb(request[:, None], positions), draws[:, None])


def gumbel(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., V] float32 Gumbel(0, 1) noise of each token of each row; key [...] long."""
    bits = absorb(key[..., None], torch.arange(vocab, device=key.device))
    u = ((bits >> 9).float() + 0.5) * 2.0 ** -23  # 23 bits: exact in float32, strictly inside (0, 1)
    return -torch.log(-torch.log(u))


def _without_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    x = logits.float()
    return torch.where(torch.arange(x.shape[-1], device=x.device) == mask_id, float("-inf"), x)


def cutoff(logits: torch.Tensor, mask_id: int, s: Sampling) -> torch.Tensor | None:
    """[...] float32: the smallest float32 logit a token may have to be drawn (top-k, then top-p on the tempered
    distribution of what top-k kept), or None where neither filter is set. Both paths (torch, fused kernel) keep
    token j iff x_j >= cutoff."""
    if s.top_k is None and s.top_p is None:
        return None
    x = _without_mask(logits, mask_id)
    if s.top_k is not None:
        vals = x.topk(min(s.top_k, x.shape[-1]), dim=-1).values  # descending
    else:
        vals = x.sort(dim=-1, descending=True).values
    if s.top_p is None:
        return vals[..., -1]
    q = torch.softmax((vals - vals[..., :1]) / s.temperature, dim=-1)  # max first: no overflow at small T
    kept = ((q.cumsum(-1) - q) < s.top_p).sum(-1, keepdim=True).clamp(min=1)  # >= 1 (0 only for NaN logits)
    return vals.gather(-1, kept - 1)[..., 0]


def sample(logits: torch.Tensor, mask_id: int, s: Sampling, key: torch.Tensor) -> torch.Tensor:
    """[...] long: v drawn from softmax(logits / T) over the kept non-MASK tokens (Gumbel-max); logits [..., V]
    (any float dtype), key [...] long (noise_key)."""
    x = logits.float()
    keep = torch.arange(x.shape[-1], device=x.device) != mask_id
    c = cutoff(logits, mask_id, s)
    if c is not None:
        keep = keep & (x >= c[..., None])
    score = torch.where(keep, x + s.temperature * gumbel(key, x.shape[-1]), float("-inf"))
    return score.argmax(dim=-1)  # the first (lowest) index among ties


def sampled_confidence(logits: torch.Tensor, mask_id: int, need: torch.Tensor, s: Sampling, key: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`confidence` (policies/base.py) with v drawn instead of the argmax: (v, p) [B, L], p the untempered
    full-vocabulary probability of v; where need is False, v = MASK and p = -1."""
    logits = torch.where(need[..., None], logits, 0.0)  # rows not needed may be unwritten (the head skips them)
    v = sample(logits, mask_id, s, key)
    p = torch.softmax(logits.float(), dim=-1).gather(-1, v[..., None])[..., 0]
    return torch.where(need, v, mask_id), torch.where(need, p, -1.0)
