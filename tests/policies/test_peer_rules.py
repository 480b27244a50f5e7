"""The peer rules of `threshold` (`rule:`, compiledllm/policies/peer_rules.py) against literal loop-based
implementations of the published decoders, written here from their code, one block at a time, on the model's
no-cache reference forward of tiny random checkpoints:

* SDAR's block_diffusion_generate, low_confidence_static / low_confidence_dynamic (JetAstra/SDAR, generate.py);
* Fast-dLLM's LLaDA generate, with a threshold and in its fixed-step mode (NVlabs/Fast-dLLM, llada/generate.py).

Each variant also has a case that plain `threshold` decodes otherwise, so these tests can fail."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import MASK_ID, write_checkpoint
from oracle import literal_decode

import compiledllm
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError
from compiledllm.policies import policy_config
from compiledllm.policies.peer_rules import sdar_confidence, select
from compiledllm.policies.sampling import Sampling, noise_key

V = 96
NEAR_TIE = 1e-5  # a decision this close to a threshold may flip between float paths (float32 here, float64 there)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random SDAR and LLaDA whose MASK logit is 0 (a zero head row): MASK is never the argmax, as in a trained
    model; the peers would write it back (the variants never choose MASK)."""
    out = {}
    for arch, seed, head in (("sdar", 3, "lm_head.weight"), ("llada", 6, "model.transformer.ff_out.weight")):
        d = write_checkpoint(tmp_path_factory.mktemp(arch), arch, seed)
        tensors = load_file(d / "model.safetensors")
        tensors[head][MASK_ID] = 0.0
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        out[arch] = compiledllm.load_model(d, device="cpu", dtype=torch.float32)
    return out


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]  # never MASK (1)


def _engine(model, policy: dict, prompts: list[list[int]], n: int, **kw) -> list[list[int]]:
    config = EngineConfig(policy, max_new_tokens=n, ignore_eos=True, **{"batch_size": len(prompts), **kw})
    return [r.output_ids for r in Engine(model, config).generate(prompts)]


def _forward(model):
    def fn(ids: torch.Tensor, block: int | None) -> torch.Tensor:
        with torch.no_grad():
            return model.reference_forward(ids, block)
    return fn


def _schedule(block: int, steps: int) -> list[int]:
    base, extra = divmod(block, steps)
    return [base + (i < extra) for i in range(steps)]


# ----------------------------------------------------------------------------- the literal references


def sdar_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SDAR's sampler with the draw replaced by the argmax (every vocabulary entry a candidate, MASK too)."""
    probs = torch.softmax(logits, dim=-1)
    x0 = logits.argmax(-1)
    return x0, probs.gather(-1, x0[:, None])[:, 0]


def sdar_top_k_1(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SDAR's sampler at temperature 1, top_k 1: logits below the k-th largest to -inf, softmax, multinomial."""
    kth = torch.topk(logits, 1).values[:, -1:]
    probs = torch.softmax(torch.where(logits < kth, float("-inf"), logits), dim=-1)
    x0 = torch.multinomial(probs, 1)[:, 0]  # one-hot: always the argmax
    return x0, probs.gather(-1, x0[:, None])[:, 0]


def sdar_literal(fn, prompt, *, block, steps, strategy, threshold, n, sampler, stats):
    """SDAR's block_diffusion_generate for one prompt, no stopping token. stats["rewrote"]: a step picked a
    position that was not MASK (SDAR's count exceeding the masks left), stats["margin"]: min |p - threshold|."""
    P = len(prompt)
    blocks = -(-(P + n) // block)
    x = torch.full((blocks * block,), MASK_ID)
    x[:P] = torch.tensor(prompt)
    count = _schedule(block, steps)
    for b in range(P // block, blocks):
        s, e = b * block, (b + 1) * block
        for step in range(steps + 1):
            mask = x[s:e] == MASK_ID
            if not mask.any():
                break  # SDAR's forward that stores the finished block's KV
            logits = fn(x[None, :e], block)[0, s:e]
            x0, x0_p = sampler(logits)
            assert not (x0[mask] == MASK_ID).any(), "the peer chose MASK: outside what the variant reproduces"
            conf = torch.where(mask, x0_p, float("-inf"))
            pick = torch.zeros(block, dtype=torch.bool)
            if strategy == "dynamic":
                high = conf > threshold
                stats["margin"] = min(stats.get("margin", math.inf), (conf[mask] - threshold).abs().min().item())
            if strategy == "dynamic" and high.sum() >= count[step]:
                pick = high
            else:
                pick[torch.topk(conf, count[step]).indices] = True
            stats["rewrote"] = stats.get("rewrote", False) or bool((pick & ~mask).any())
            cur = x[s:e].clone()
            cur[pick] = x0[pick]
            x[s:e] = cur
    return x[P:P + n].tolist()


def fast_dllm_literal(fn, prompt, *, block, n, threshold=None, steps=None, stats):
    """Fast-dLLM's LLaDA generate (no cache) for one prompt: threshold given, or its fixed-step mode."""
    assert n % block == 0
    P = len(prompt)
    x = torch.full((P + n,), MASK_ID)
    x[:P] = torch.tensor(prompt)
    for b in range(n // block):
        s, e = P + b * block, P + (b + 1) * block
        count = _schedule(block, steps) if threshold is None else None
        i = 0
        while True:
            logits = fn(x[None], None)[0].double()  # the whole sequence, bidirectional
            mask = x == MASK_ID
            mask[e:] = False
            x0 = logits.argmax(-1)
            assert not (x0[mask] == MASK_ID).any(), "the peer chose MASK: outside what the variant reproduces"
            p = torch.softmax(logits, dim=-1).gather(-1, x0[:, None])[:, 0]
            conf = torch.where(mask, p, -math.inf)
            pick = torch.zeros(P + n, dtype=torch.bool)
            if threshold is None:
                pick[torch.topk(conf, count[i]).indices] = True
            else:
                order = torch.topk(conf, int(mask.sum())).indices
                pick[order] = True
                for j in order[1:].tolist():  # every one but the most confident must reach the threshold
                    pick[j] = bool(conf[j] >= threshold)
                stats["margin"] = min(stats.get("margin", math.inf), (conf[mask] - threshold).abs().min().item())
            x[pick] = x0[pick]
            i += 1
            if not (x[s:e] == MASK_ID).any():
                break
    return x[P:].tolist()


def _assert_same(got, want, stats, what):
    if got != want and stats.get("margin", math.inf) < NEAR_TIE:
        pytest.skip(f"{what}: numerical near-tie (margin {stats['margin']:.1e}), not a rule mismatch")
    assert got == want, f"{what}\n engine : {got}\n literal: {want}"


# ----------------------------------------------------------------------------- a step's choice


def _select_literal(rule: str, p: list[float], masked: list[bool], k: int, tau: float, fixed: bool) -> list[bool]:
    """One row of a step's choice, as the rules read (ties -> the lower position)."""
    cand = sorted((j for j in range(len(p)) if masked[j]), key=lambda j: (-p[j], j))
    top = set(cand[:k])
    if rule == "sdar_static" or (rule == "fast_dllm" and fixed):
        pick = top
    elif rule == "fast_dllm":
        pick = top | {j for j in cand if p[j] >= tau}
    else:
        high = {j for j in cand if p[j] > tau}
        pick = high if len(high) >= k else top
    return [j in pick for j in range(len(p))]


@pytest.mark.parametrize("rule", ["engine", "sdar_static", "sdar_dynamic", "fast_dllm"])
def test_select_equals_the_rule_on_ties_and_the_threshold(rule):
    """Confidences from a few values, the threshold among them: exact ties and p == tau in every row."""
    g = torch.Generator().manual_seed(1)
    values = torch.tensor([0.1, 0.3, 0.5, 0.7, 1.0])
    p = values[torch.randint(0, 5, (64, 8), generator=g)]
    masked = torch.rand(64, 8, generator=g) < 0.7
    for fixed in (False, True):
        k = torch.minimum(torch.randint(1, 4, (64,), generator=g) if fixed else torch.ones(64, dtype=torch.long),
                          masked.sum(1))
        got = select(rule, torch.where(masked, p, -1.0), masked, k, 0.5, fixed)
        want = [_select_literal(rule, p[b].tolist(), masked[b].tolist(), int(k[b]), 0.5, fixed) for b in range(64)]
        assert got.tolist() == want, (rule, fixed)


# ----------------------------------------------------------------------------- SDAR

# (strategy, block, steps, threshold, prompt lengths, new tokens); none makes SDAR pick a non-MASK position.
# static ignores the threshold; dynamic decodes as threshold with the same steps (greedy: the same confidence)
SDAR_CASES = [
    ("static", 4, 4, 0.5, [5, 8, 3], 10),
    ("static", 8, 4, 0.3, [8, 6], 16),
    ("dynamic", 4, 4, 0.5, [5, 8, 3], 10),
    ("dynamic", 8, 8, 0.3, [8, 3], 13),
]


@pytest.mark.parametrize("strategy,block,steps,tau,lengths,n", SDAR_CASES)
def test_sdar_greedy_equals_literal(models, strategy, block, steps, tau, lengths, n):
    model = models["sdar"]
    prompts = _prompts(lengths, seed=block * 10 + steps)
    policy = {"name": "threshold", "rule": f"sdar_{strategy}", "block_size": block, "steps": steps, "threshold": tau}
    got = _engine(model, policy, prompts, n)
    for prompt, out in zip(prompts, got):
        st = {}
        want = sdar_literal(_forward(model), prompt, block=block, steps=steps, strategy=strategy, threshold=tau,
                            n=n, sampler=sdar_greedy, stats=st)
        assert not st["rewrote"], "the case must stay inside what the variant reproduces"
        _assert_same(out, want, st, f"sdar_{strategy} P={len(prompt)}")
    if strategy == "static":  # threshold's own rule accepts what passes tau as well
        assert got != _engine(model, {**policy, "rule": "engine"}, prompts, n)


def test_sdar_top_k_1_equals_literal_and_differs_from_threshold(models):
    """top_k 1 makes SDAR deterministic with p = 1 everywhere, so low_confidence_dynamic fills whole blocks; the
    engine's own rule reads the untempered p and fills fewer."""
    model = models["sdar"]
    prompts = _prompts([5, 8, 3], seed=11)
    policy = {"name": "threshold", "block_size": 4, "threshold": 0.85, "temperature": 1.0, "top_k": 1}
    got = _engine(model, {**policy, "rule": "sdar_dynamic"}, prompts, 10)
    for prompt, out in zip(prompts, got):
        st = {}
        want = sdar_literal(_forward(model), prompt, block=4, steps=4, strategy="dynamic", threshold=0.85, n=10,
                            sampler=sdar_top_k_1, stats=st)
        assert not st["rewrote"]
        _assert_same(out, want, st, f"sdar_dynamic top_k 1 P={len(prompt)}")
    assert got != _engine(model, policy, prompts, 10)


def test_sdar_count_above_the_masks_left_is_capped(models):
    """With steps < block, SDAR's count can exceed the masks left (here the prompt's partial block: 1 MASK, count
    2); SDAR then also rewrites a fixed position in torch.topk's order. The variant fills only the masks."""
    model = models["sdar"]
    prompt = _prompts([7], seed=3)[0]
    st = {}
    sdar_literal(_forward(model), prompt, block=4, steps=2, strategy="static", threshold=None, n=9,
                 sampler=sdar_greedy, stats=st)
    assert st["rewrote"]
    got = _engine(model, {"name": "threshold", "rule": "sdar_static", "block_size": 4, "steps": 2}, [prompt], 9)
    same = _engine(model, {"name": "threshold", "block_size": 4, "steps": 2, "threshold": 1.0}, [prompt], 9)
    assert got == same  # the capped count: engine's fixed schedule


def test_sdar_confidence_is_the_sampling_distributions():
    """p = the drawn token's probability under SDAR's tempered, top-k, then top-p filtered softmax (MASK a
    vocabulary entry like any other), against that pipeline written out."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g) * 3
    logits[0, :3, MASK_ID] = 12.0  # MASK the most likely token: SDAR's filters keep it, its mass counts
    need = torch.ones(2, 5, dtype=torch.bool)
    need[0, 1] = False
    keys = noise_key(torch.tensor([7, 8]), torch.zeros(2, dtype=torch.long), torch.arange(5).expand(2, 5))
    for s in (Sampling(0.7, 5, 0.9), Sampling(1.3, None, 0.8), Sampling(0.5, 3, None), Sampling(2.0)):
        v, p = sdar_confidence(logits, MASK_ID, need, s, keys)
        z = logits / s.temperature
        if s.top_k is not None:
            z = torch.where(z < torch.topk(z, s.top_k).values[..., -1:], float("-inf"), z)
        if s.top_p is not None:
            srt, idx = torch.sort(z, descending=True)
            cum = torch.softmax(srt, dim=-1).cumsum(-1)
            drop = torch.cat([torch.zeros_like(cum[..., :1], dtype=torch.bool), (cum > s.top_p)[..., :-1]], -1)
            z = z.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
        want = torch.softmax(z, dim=-1).gather(-1, v[..., None])[..., 0]
        torch.testing.assert_close(p[need], want[need], rtol=1e-5, atol=1e-6)
        assert (p[~need] == -1).all() and not (v[need] == MASK_ID).any()


@pytest.mark.slow
def test_sdar_static_compiled_equals_eager(models, compile_kw):
    """The variant's step through torch.compile. The shapes of the other compile tests (conftest.compile_kw), so in
    the suite their compiled SDAR layers serve and only the acceptance compiles (~4 s; ~25 s in this file alone)."""
    policy = {"name": "threshold", "rule": "sdar_static", "block_size": 4, "steps": 2, "threshold": 0.5}
    prompts = _prompts([5, 8, 2], seed=5)
    compiled = _engine(models["sdar"], policy, prompts, 10, compile=True, **compile_kw)
    assert compiled == _engine(models["sdar"], policy, prompts, 10, **compile_kw)
    assert compiled != _engine(models["sdar"], {**policy, "rule": "engine"}, prompts, 10, **compile_kw)


# ----------------------------------------------------------------------------- Fast-dLLM


# (threshold, steps, block, prompt lengths, new tokens)
FAST_DLLM_CASES = [
    (0.5, None, 4, [5, 8, 3], 8),
    (0.9, None, 8, [6, 16], 16),
    (0.3, None, 4, [1, 10], 12),
    (None, 2, 4, [6, 9], 8),
]


@pytest.mark.parametrize("tau,steps,block,lengths,n", FAST_DLLM_CASES)
def test_fast_dllm_equals_literal(models, tau, steps, block, lengths, n):
    model = models["llada"]
    prompts = _prompts(lengths, seed=block + n)
    policy = {"name": "threshold", "rule": "fast_dllm", "block_size": block,
              **({"threshold": tau} if tau is not None else {"steps": steps})}
    got = _engine(model, policy, prompts, n)
    for prompt, out in zip(prompts, got):
        st = {}
        want = fast_dllm_literal(_forward(model), prompt, block=block, n=n, threshold=tau, steps=steps, stats=st)
        _assert_same(out, want, st, f"fast_dllm P={len(prompt)}")


@pytest.mark.parametrize("extra", [{"threshold": 0.5}, {"steps": 2, "threshold": 1.0}])
def test_fast_dllm_differs_from_threshold(models, extra):
    """Its blocks start at the prompt's end and its sequence ends N after it: where the prompt ends mid-block,
    plain threshold (the same acceptance but for >= at tau) decodes otherwise."""
    prompts = _prompts([5, 3, 6], seed=12)
    policy = {"name": "threshold", "block_size": 4, **extra}
    fast = _engine(models["llada"], {**policy, "rule": "fast_dllm"}, prompts, 8)
    assert fast != _engine(models["llada"], policy, prompts, 8)


def test_default_rule_is_the_design_decode(models):
    """`rule: engine` (the default) still decodes docs/design.md §4 (tests/oracle.py) on both kinds of model."""
    for arch in ("sdar", "llada"):
        model = models[arch]
        prompts = _prompts([5, 8], seed=2)
        got = _engine(model, {"name": "threshold", "block_size": 4, "threshold": 0.5}, prompts, 9)
        for prompt, out in zip(prompts, got):
            want = literal_decode(_forward(model), prompt, policy="threshold", block_size=4, max_new_tokens=9,
                                  mask_id=MASK_ID, eos_id=-1, threshold=0.5, bidirectional=arch == "llada")
            assert out == want, arch


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("value", ["sdar", "FAST_DLLM", 3, None])
def test_bad_rule_is_one_line_error(value):
    with pytest.raises(UserError) as e:
        policy_config({"name": "threshold", "rule": value})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("policy.rule:") and repr(value) in msg


def test_fast_dllm_refuses_a_block_causal_model(models):
    with pytest.raises(UserError, match=r"^policy\.rule: fast_dllm .*block-causal"):
        Engine(models["sdar"], EngineConfig({"name": "threshold", "rule": "fast_dllm"}, max_new_tokens=4))


def test_rule_in_a_recipe():
    from compiledllm.recipe import load_recipe

    recipe = {"model": {"path": "tiny-llada2-random"}, "prompts": [{"ids": [3, 4]}],
              "policy": {"name": "threshold", "rule": "sdar_dynamic", "steps": 2, "block_size": 4}}
    assert load_recipe(recipe).policy_config().rule == "sdar_dynamic"
    with pytest.raises(UserError, match=r"policy\.rule: .*'sdar_fast'"):
        load_recipe(recipe, ["policy.rule=sdar_fast"])
