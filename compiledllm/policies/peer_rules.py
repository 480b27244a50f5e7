"""Other decoders' acceptance rules as a setting of `threshold` (`rule:`), so a run gives their tokens.

The rules, as the published code runs them (read there; not copied):

* `engine` (the default): docs/design.md §4.
* `sdar_static`, `sdar_dynamic`: SDAR's `block_diffusion_generate` (JetAstra/SDAR, generate.py) with
  `remasking_strategy` low_confidence_static / low_confidence_dynamic. Blocks align to position 0 and each is
  decoded against the cached prefix, as `engine` decodes them. Step s of a block has a count n_s: block // steps,
  one more in the first block % steps steps (`steps` default: the block size, so one a step; SDAR's
  `denoising_steps`). static fills exactly the n_s most confident masked positions; threshold is not used.
  dynamic fills every masked position with p > threshold when there are at least n_s of them, else the n_s most
  confident. Once the block has no MASK, one more forward writes its KV; after a block that holds an EOS the
  request stops. Both are what `engine` does with `steps` (threshold 1.0 for static), apart from the confidence:
  SDAR draws v from softmax(logits / T) after its top-k and top-p filters, which count every vocabulary entry,
  MASK too, and p is v's probability in that same distribution (`sdar_confidence`). `engine` uses the untempered
  full-vocabulary probability instead. So top_k: 1 gives p = 1 everywhere: SDAR's only deterministic setting.
  SDAR has no temperature 0 (its sampler divides by T). Here temperature 0 takes the argmax and its full softmax
  probability: SDAR's rule at T = 1 with the draw replaced by the argmax.
* `fast_dllm`: Fast-dLLM's LLaDA `generate` (NVlabs/Fast-dLLM, llada/generate.py: generate and
  get_transfer_index), for bidirectional models. The sequence is the prompt, then MASK in blocks that start at
  the prompt's end, not at position 0. There N must be a multiple of the block; here the last block is simply
  completed. Every forward covers the whole sequence, later blocks still MASK. A step fills the most confident
  masked position of the block and every other masked position with p >= threshold (v the argmax, p its softmax
  probability). The block ends as soon as it has no MASK. With `steps`: that generate's fixed-step mode
  (threshold None there), exactly n_s per step with the same schedule, and threshold is not used. Its sampling
  is Gumbel-max on softmax(logits / T) with p the untempered probability, as every policy samples here.

Not reproduced: Fast-dLLM computes p in float64 and SDAR in the logits' dtype; here it is float32. Ties go to
the lower position here, where the peers have torch.topk's order, which is not specified. Neither peer leaves
MASK out of the argmax or the draw (a MASK there writes MASK back, and Fast-dLLM's greedy loop may then never
end); here MASK is never chosen. SDAR's top-p keeps a token whose preceding mass equals top_p, which this filter drops
(policies/sampling.py). SDAR selects n_s positions of the whole block even when fewer are MASK (the count is
capped here). That happens in the prompt's partial block, or after a dynamic step filled more than its count,
and only with steps < block size. There its torch.topk also picks, in unspecified order, n_s - masked already
fixed positions and rewrites them with this forward's token, prompt tokens included; the engine never changes
a prompt token. Fast-dLLM's KV caches (prefix / dual cache) approximate this forward and are not reproduced;
its `generate` decodes all N tokens whereas the engine stops after the block with the first EOS, so the tokens
are the same up to that EOS.
"""
from __future__ import annotations

from typing import Literal, get_args

import torch

from compiledllm.policies.base import top_confident
from compiledllm.policies.sampling import Sampling, cutoff, sampled_confidence

Rule = Literal["engine", "sdar_static", "sdar_dynamic", "fast_dllm"]
RULES: tuple[str, ...] = get_args(Rule)
SDAR_RULES = ("sdar_static", "sdar_dynamic")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule: must be one of {', '.join(RULES)}, got {rule!r}")


def check_steps(steps: int | None, block_size: int | None) -> None:
    if steps is not None and not 1 <= steps <= (block_size or steps):
        raise ValueError(f"steps: must be within [1, block_size={block_size}], got {steps}")


def fixed_count(steps: int, block: int, decoded: torch.Tensor) -> torch.Tensor:
    """[B] this step's count of the `steps` schedule (block // steps, one more in the first block % steps steps)
    from the count already decoded in the block, for policies that keep no step counter: after s steps of exact
    counts `decoded` is s * base + min(s, extra), below extra * (base + 1) exactly while s < extra."""
    base, extra = divmod(block, steps)
    return base + (decoded < extra * (base + 1)).long()


def select(rule: str, p: torch.Tensor, masked: torch.Tensor, k: torch.Tensor, tau: float | torch.Tensor,
           fixed: bool) -> torch.Tensor:
    """[B, L] bool: the masked positions a step fills. p [B, L] confidences, k [B]: this step's count, already capped
    at the masks left (1 without `steps`), tau: a number or [B, 1] per row, fixed: `steps` is set."""
    if rule == "sdar_static" or (rule == "fast_dllm" and fixed):
        return top_confident(p, masked, k)
    if rule == "fast_dllm":  # the most confident one always, then every one at or above tau
        return top_confident(p, masked, k) | (masked & (p >= tau))
    accept = masked & (p > tau)  # engine, sdar_dynamic: all above tau if they are at least k, else the k best
    return torch.where((accept.sum(1) < k)[:, None], top_confident(p, masked, k), accept)


def sdar_confidence(logits: torch.Tensor, mask_id: int, need: torch.Tensor, s: Sampling, keys: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, p) [B, L]: v drawn as every policy draws it (sampled_confidence), p = v's probability under SDAR's
    sampling distribution: softmax(logits / T) over the tokens its top-k then top-p filters keep, MASK counted as
    a vocabulary entry there. Where need is False, v = MASK and p = -1."""
    v, _ = sampled_confidence(logits, mask_id, need, s, keys)
    x = torch.where(need[..., None], logits, 0.0).float()  # rows not needed may be unwritten
    c = cutoff(x, -1, s)  # mask_id -1: no entry left out of the filters, as SDAR's filters see MASK too
    z = x / s.temperature
    if c is not None:
        z = torch.where(x >= c[..., None], z, float("-inf"))
    p = torch.softmax(z, dim=-1).gather(-1, v[..., None])[..., 0]
    return v, torch.where(need, p, -1.0)
