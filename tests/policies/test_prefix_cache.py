"""`fast_dllm_cache` (compiledllm/policies/fast_dllm_cache.py, Fast-dLLM v1's prefix cache for a bidirectional model)
on the engine's extension points (Policy.caches_kv, prefill_end, first_block, two phases with a row-subset refresh:
hooks.PhaseRun).

Its tokens and forward counts are those of a literal loop written here from the description (no engine: LLaDA in
float64 from the checkpoint, tests/oracle.py's pieces, with the refresh's K/V of the prefix kept in a list), alone,
batched with admissions mid-run, compiled, and captured as CUDA graphs on a GPU."""
from __future__ import annotations

import math

import pytest
import torch
from checkpoints import MASK_ID, write_checkpoint
from oracle import OracleModel, confidence, llada_forward, oracle_logits

import compiledllm
from compiledllm.engine import Engine, EngineConfig
from compiledllm.engine.hooks import PhaseRun
from compiledllm.errors import UserError
from compiledllm.policies import register_policy
from compiledllm.policies.fast_dllm_cache import FastDLLMCacheConfig, FastDLLMCachePolicy, query_windows


class RecordedConfig(FastDLLMCacheConfig):
    pass  # its own config class: make_policy finds a policy by its config's class


class RecordedPolicy(FastDLLMCachePolicy):
    """The package's policy, recording per step (decoding slots, slots the refresh ran on): this instance's own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedules: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.windows: list[tuple[str, int]] = []  # per step: (the decode phase it ran, its rows' longest suffix)
        self.queries: list[tuple[str, int]] = []  # per prefix-cache decode plan: (phase, query positions)
        self.longest = 0  # the step's longest suffix (before_step)

    def before_step(self, host, step):
        rows = list(step.rows)  # the step's longest suffix from the block's start, from the state itself
        self.longest = int((host.st.work_len[rows] - host.st.block_start[rows]).max()) if rows else 0

    def schedule(self, step):
        self.schedules.append((step.rows, step.begun))
        out = super().schedule(step)
        self.windows.append((out[-1], self.longest))
        return out

    def plan(self, phase, st):
        fwd = super().plan(phase, st)
        if phase.startswith("decode") and not self.config.dual:
            self.queries.append((phase, fwd.tokens.shape[1]))
        return fwd


class EveryRowRefreshConfig(FastDLLMCacheConfig):
    pass


class EveryRowRefreshPolicy(RecordedPolicy):
    """The same policy with a careless host schedule: refresh on every decoding row each step. The `fresh` flag
    makes the refresh a no-op for rows that already hold their block's refresh, so the tokens must not change."""

    def schedule(self, step):
        self.schedules.append((step.rows, step.rows))
        return [PhaseRun("refresh", step.rows), "decode"]


register_policy("fast_dllm_cache_recorded", RecordedConfig, RecordedPolicy)
register_policy("fast_dllm_cache_every_row", EveryRowRefreshConfig, EveryRowRefreshPolicy)
NEAR_TIE = 1e-5  # a decision this close to a threshold may flip between float32 (engine) and float64 (literal)
BLOCK, CAPACITY = 4, 32


# ----------------------------------------------------------------------------- the literal loop


class CachedLLaDA(OracleModel):
    """tests/oracle.llada_forward (float64) for tokens at positions start.. that see each other and, given `past`,
    the per-layer K/V of positions [0, start)."""

    @torch.no_grad()
    def forward(self, ids: list[int], start: int = 0, past: list | None = None):
        """logits [L, V] float64, and the K/V [1, KVH, L, hd] (after RoPE) of these tokens per layer."""
        fresh: list = []
        logits = llada_forward(self.cfg, self.w, torch.tensor([ids]), None, start, past, fresh)
        return logits[0], fresh


def literal_prefix_cache(lm: CachedLLaDA, prompt: list[int], block: int, n: int, tau: float, eos: int,
                         dual: bool = False, steps: int | None = None) -> tuple[list[int], dict]:
    """Fast-dLLM's generate_with_prefix_cache (dual: generate_with_dual_cache) as compiledllm/policies/
    fast_dllm_cache.py describes it, one prompt, stopping after the block that holds the first EOS; with `steps` its
    fixed-step mode (step i of a block fills the counts[i] most confident, tau unused). stats: nfe
    (forwards), refreshed (blocks their refresh completed, the row going on: the engine's `steps` counts the idle
    decode phase of that step), margin (the closest decision)."""
    P = len(prompt)
    W = P + -(-n // block) * block
    x = list(prompt) + [MASK_ID] * (W - P)
    stats = {"nfe": 0, "refreshed": 0, "accepted": [], "margin": math.inf}

    counts = [block // steps + (i < block % steps) for i in range(steps)] if steps else []

    def transfer(logits: torch.Tensor, s: int, i: int) -> None:  # logits [Bk, V] of positions s .. s + Bk - 1
        v, p, gap = confidence(logits, MASK_ID)
        v, p, gap = v.tolist(), p.tolist(), gap.tolist()
        masked = [j for j in range(block) if x[s + j] == MASK_ID]
        ranked = sorted(masked, key=lambda j: (-p[j], j))
        if steps:  # exactly this step's count of the most confident; the margin: the last taken vs the first left
            k = min(counts[i], len(masked))
            acc = set(ranked[:k])
            m = [p[ranked[k - 1]] - p[ranked[k]]] if k < len(ranked) else []
        else:
            best = ranked[0]
            acc = {best} | {j for j in masked if p[j] >= tau}
            m = [abs(p[j] - tau) for j in masked if j != best] + [p[best] - p[j] for j in masked if j != best]
        stats["margin"] = min([stats["margin"], *m, *(gap[j] for j in acc)])
        stats["accepted"].append(len(acc))
        for j in acc:
            x[s + j] = v[j]

    for s in range(P, W, block):
        logits, kv = lm.forward(x)  # refresh: the whole sequence, every position's K/V
        stats["nfe"] += 1
        transfer(logits[s : s + block], s, 0)
        i, e = 1, s + block
        # the cached prefix [0, s), with `dual` also the cached suffix [e, W) (key order does not change attention)
        past = [(torch.cat([k[:, :, :s], k[:, :, e:]], 2), torch.cat([v[:, :, :s], v[:, :, e:]], 2)) if dual
                else (k[:, :, :s], v[:, :, :s]) for k, v in kv]
        refreshed = MASK_ID not in x[s : s + block]
        while MASK_ID in x[s : s + block]:  # decode: x[s:] (dual: x[s:e]) against the cache
            logits, _ = lm.forward(x[s:e] if dual else x[s:], s, past)
            stats["nfe"] += 1
            transfer(logits[:block], s, i)
            i += 1
        if eos in x[s : s + block]:
            break
        stats["refreshed"] += refreshed and s + block < W
    out = x[P : P + n]
    return (out[: out.index(eos) + 1] if eos in out else out), stats


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada"), "llada", 6)


@pytest.fixture(scope="module")
def literal(ckpt):
    return CachedLLaDA(ckpt)


def prompts(lengths, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (k,), generator=g).tolist() for k in lengths]


def policy(tau: float, name: str = "fast_dllm_cache", dual: bool = False, steps: int | None = None) -> dict:
    return {"name": name, "block_size": BLOCK, "threshold": tau, "dual": dual, "steps": steps}


def run(model, pol: dict, ps, n: int, batch: int, **kw):
    config = EngineConfig(pol, max_new_tokens=n, batch_size=batch, max_seq_len=CAPACITY, **kw)
    engine = Engine(model, config)
    return engine.generate(ps), engine


def expected(literal, ps, n, tau, eos, dual: bool = False, steps: int | None = None):
    wants = [literal_prefix_cache(literal, p, BLOCK, n, tau, eos, dual, steps) for p in ps]
    margin = min(st["margin"] for _, st in wants)
    if margin < NEAR_TIE:
        pytest.skip(f"numerical near-tie (margin {margin:.1e})")
    return wants


# ----------------------------------------------------------------------------- tests


def test_literal_loop_is_the_oracle_forward(ckpt, literal):
    """The literal's forward with no prefix is tests/oracle.py's LLaDA; split at s with the prefix's K/V it gives the
    same logits when the prefix is what the full forward saw (a prefix cache is exact for an unchanged sequence)."""
    ids = prompts([13])[0]
    full, kv = literal.forward(ids)
    torch.testing.assert_close(full, oracle_logits(ckpt, torch.tensor([ids]), None)[0], rtol=0, atol=1e-10)
    tail, _ = literal.forward(ids[5:], 5, [(k[:, :, :5], v[:, :, :5]) for k, v in kv])
    torch.testing.assert_close(tail, full[5:], rtol=0, atol=1e-10)


# (tau, prompt lengths, new tokens): at 0.3 a step accepts several positions, so some refreshes fill their block
CASES = [(0.9, [5, 9, 2], 11), (0.3, [5, 9, 2], 13), (0.6, [1, 7, 12], 8)]


@pytest.mark.parametrize("dual", [False, True], ids=["prefix", "dual"])
@pytest.mark.parametrize("tau,lengths,n", CASES)
def test_engine_equals_literal_prefix_cache(ckpt, literal, tau, lengths, n, dual):
    model = compiledllm.load_model(ckpt)
    ps = prompts(lengths, seed=len(lengths) + n)
    wants = expected(literal, ps, n, tau, eos=-1, dual=dual)
    got, _ = run(model, policy(tau, dual=dual), ps, n, batch=1, ignore_eos=True)
    for p, r, (want, st) in zip(ps, got, wants):
        assert r.output_ids == want, f"P={len(p)}\n engine : {r.output_ids}\n literal: {want}"
        assert r.extra["nfe"] == st["nfe"], (len(p), r.extra, st)
        assert r.steps == st["nfe"] + st["refreshed"]  # + the idle decode phase after a refresh that retired a block
    accepted = [a for _, st in wants for a in st["accepted"]]
    if tau < 0.5:
        assert max(accepted) > 1 and sum(st["refreshed"] for _, st in wants) > 0, accepted


@pytest.mark.parametrize("dual", [False, True], ids=["prefix", "dual"])
@pytest.mark.parametrize("steps", [3, 2])
def test_fixed_steps_equal_the_literal_and_fill_the_schedule(ckpt, literal, dual, steps):
    """Fast-dLLM's fixed-step mode: a block of 4 in `steps` forwards (3: counts 2, 1, 1), threshold unused (0.0 would
    accept every position), batched with admissions == the literal alone."""
    model = compiledllm.load_model(ckpt)
    ps, n = prompts([5, 9, 2], seed=11), 12
    wants = expected(literal, ps, n, 0.0, eos=-1, dual=dual, steps=steps)
    got, _ = run(model, policy(0.0, dual=dual, steps=steps), ps, n, batch=2, ignore_eos=True, buckets=(1, 2))
    assert [r.output_ids for r in got] == [w for w, _ in wants]
    assert [r.extra["nfe"] for r in got] == [st["nfe"] for _, st in wants] == [n // BLOCK * steps] * len(ps)


def test_the_cache_changes_tokens(ckpt):
    """The prefix cache is an approximation (the prefix's KV is from the block's start): its tokens differ from
    Fast-dLLM's no-cache decode (threshold's rule fast_dllm), so the tests above can tell the two apart."""
    model = compiledllm.load_model(ckpt)
    ps, n, tau = prompts([5, 9, 2], seed=3), 12, 0.9
    cached, _ = run(model, policy(tau), ps, n, batch=3, ignore_eos=True)
    plain, _ = run(model, {"name": "threshold", "rule": "fast_dllm", "block_size": BLOCK, "threshold": tau}, ps, n,
                   batch=3, ignore_eos=True)
    assert all(a.output_ids != b.output_ids for a, b in zip(cached, plain))
    dual, _ = run(model, policy(tau, dual=True), ps, n, batch=3, ignore_eos=True)  # the suffix's cached KV too
    assert [r.output_ids for r in dual] != [r.output_ids for r in cached]


def eos_for(literal, ps, n, tau) -> int:
    """An EOS id some rows generate mid-way (so rows stop at different steps), found without stopping."""
    outs = [literal_prefix_cache(literal, p, BLOCK, n, tau, eos=-1)[0] for p in ps]
    counts = {t: sum(t in o[: n - BLOCK] for o in outs) for o in outs for t in o}
    return max(counts, key=lambda t: (0 < counts[t] < len(outs), -t))


@pytest.mark.parametrize("tau,dual", [(0.9, False), (0.4, False), (0.6, True)])
def test_batched_equals_alone_and_refresh_runs_on_a_subset(ckpt, literal, tau, dual):
    """Batch 3 of 5 prompts (admissions mid-run, compaction, rows stopping at an EOS) with buckets: every prompt's
    tokens and forwards are its own, and the literal's. The refresh ran on a strict subset of the decoding rows."""
    ps, n = prompts([5, 11, 2, 8, 3], seed=3), 14
    eos = eos_for(literal, ps, n, tau)
    model = compiledllm.load_model(ckpt, eos_token_id=eos)
    wants = expected(literal, ps, n, tau, eos, dual)
    alone = [run(model, policy(tau, dual=dual), [p], n, batch=1)[0][0] for p in ps]
    batched, engine = run(model, policy(tau, "fast_dllm_cache_recorded", dual), ps, n, batch=3, buckets=(1, 2, 3))
    assert [r.output_ids for r in alone] == [w for w, _ in wants]
    assert [r.output_ids for r in batched] == [w for w, _ in wants]
    assert [r.extra["nfe"] for r in batched] == [r.extra["nfe"] for r in alone] == [st["nfe"] for _, st in wants]
    assert [r.steps for r in batched] == [r.steps for r in alone]
    assert len({len(r.output_ids) for r in batched}) > 1, "rows should stop at different lengths"
    subsets = [(rows, ref) for rows, ref in engine.policy.schedules if 0 < len(ref) < len(rows)]
    assert subsets, engine.policy.schedules
    assert all(set(ref) <= set(rows) for rows, ref in engine.policy.schedules)
    if tau > 0.5:  # steps where no row begins a block: the PhaseRun has no rows and does not run
        assert any(not ref for _, ref in engine.policy.schedules)


def test_refresh_on_every_row_changes_nothing(ckpt):
    """Correctness does not depend on the host schedule: refreshing every decoding row each step gives the same tokens
    and real forwards (the fresh flag makes it a no-op where the cache holds the block's refresh); only the
    engine's per-phase count grows."""
    model = compiledllm.load_model(ckpt)
    ps, n = prompts([5, 11, 2, 8], seed=4), 12
    kw = dict(batch=3, ignore_eos=True, buckets=(1, 2, 3))
    exact, _ = run(model, policy(0.6), ps, n, **kw)
    every, engine = run(model, policy(0.6, "fast_dllm_cache_every_row"), ps, n, **kw)
    assert [r.output_ids for r in every] == [r.output_ids for r in exact]
    assert [r.extra["nfe"] for r in every] == [r.extra["nfe"] for r in exact]
    assert sum(r.steps for r in every) > sum(r.steps for r in exact)
    assert isinstance(engine.policy, EveryRowRefreshPolicy)
    assert all(ref == rows for rows, ref in engine.policy.schedules)


def test_sampling_is_batch_invariant(ckpt):
    """At temperature > 0 a request's draws are keyed by its id and its own forward count (nfe), not its slot."""
    model = compiledllm.load_model(ckpt)
    ps, n = prompts([5, 9, 2], seed=5), 10
    pol = policy(0.7) | {"temperature": 0.8, "seed": 3}
    config = EngineConfig(pol, max_new_tokens=n, batch_size=1, max_seq_len=CAPACITY, ignore_eos=True)
    alone = [Engine(model, config).generate([p], request_ids=[i])[0].output_ids for i, p in enumerate(ps)]
    batched, _ = run(model, pol, ps, n, batch=3, ignore_eos=True)
    greedy, _ = run(model, policy(0.7), ps, n, batch=3, ignore_eos=True)
    assert [r.output_ids for r in batched] == alone
    assert alone != [r.output_ids for r in greedy]


def test_refuses_a_block_causal_model(tmp_path):
    model = compiledllm.load_model(write_checkpoint(tmp_path / "s", "sdar", 1))
    with pytest.raises(UserError, match="fast_dllm_cache"):
        Engine(model, EngineConfig(policy(0.9), max_new_tokens=4))


@pytest.mark.parametrize("dual", [False, True], ids=["prefix", "dual"])
def test_compiled_equals_eager(ckpt, compile_kw, dual):
    model = compiledllm.load_model(ckpt, eos_token_id=0)
    ps = prompts([5, 2, 9, 3], seed=6)
    kw = dict(max_new_tokens=8, **compile_kw)
    eager = Engine(model, EngineConfig(policy(0.6, dual=dual), **kw)).generate(ps)
    compiled = Engine(model, EngineConfig(policy(0.6, dual=dual), compile=True, **kw)).generate(ps)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    assert [r.extra["nfe"] for r in compiled] == [r.extra["nfe"] for r in eager]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("dtype,compile,dual", [(torch.bfloat16, False, False), (torch.float32, True, False),
                                               (torch.bfloat16, False, True)], ids=["bf16", "fp32-compiled", "bf16-dual"])
def test_cuda_graphs_equal_eager(tmp_path, dtype, compile, dual):
    """Each (phase, bucket) captured once; a refresh on a subset of rows replays on the bucket that holds them. bf16
    with head_dim 64 runs the packed-attention kernel for the decode phase (Bidirectional against the prefix)."""
    ckpt = write_checkpoint(tmp_path / "l", "llada", 11, d_model=256, n_heads=4, n_kv_heads=4)
    model = compiledllm.load_model(ckpt, device="cuda", dtype=dtype, eos_token_id=0)
    ps = prompts([5, 11, 2, 8, 3, 14], seed=8)
    kw = dict(max_new_tokens=21, batch_size=4, max_seq_len=48)
    eager = Engine(model, EngineConfig(policy(0.9, dual=dual), cuda_graphs=False, **kw)).generate(ps)
    engine = Engine(model, EngineConfig(policy(0.9, "fast_dllm_cache_recorded", dual), cuda_graphs=True,
                                        compile=compile, **kw))
    graphs = engine.generate(ps)
    assert any(0 < len(ref) < len(rows) for rows, ref in engine.policy.schedules), engine.policy.schedules
    assert [r.output_ids for r in graphs] == [r.output_ids for r in eager]
    assert [r.extra["nfe"] for r in graphs] == [r.extra["nfe"] for r in eager]
    assert [r.steps for r in graphs] == [r.steps for r in eager]


def test_prefix_window_shrinks_with_the_suffix(ckpt, literal):
    """The prefix cache's decode window is the smallest of capacity, 1/2, 1/4, 1/8 (whole blocks) that holds the
    step's longest suffix from its block's start, as Fast-dLLM's window shrinks with the blocks; batched with
    admissions the tokens stay the literal's (the tests above cover every window through it)."""
    model = compiledllm.load_model(ckpt)
    ps, n, tau = prompts([5, 9, 2], seed=3), 12, 0.6
    wants = expected(literal, ps, n, tau, eos=-1)
    got, engine = run(model, policy(tau, name="fast_dllm_cache_recorded"), ps, n, batch=2, ignore_eos=True,
                      buckets=(1, 2))
    assert [r.output_ids for r in got] == [w for w, _ in wants]
    pol = engine.policy
    size = query_windows(CAPACITY, pol.block_size)  # phase -> query positions
    assert all(q == size[phase] for phase, q in pol.queries)
    used = {q for _, q in pol.queries}
    assert used >= {16, 8, 4} and CAPACITY not in used, sorted(used)
    smaller = dict(zip(size, [*list(size)[1:], None]))  # each window's next smaller one
    for phase, longest in pol.windows:
        assert size[phase] >= longest, (phase, longest)
        assert smaller[phase] is None or size[smaller[phase]] < longest, (phase, longest)
    counts = engine.stats.policy["decode_windows"]  # bench's policy_stats: decode steps per window size
    assert counts == {q: sum(size[ph] == q for ph, _ in pol.windows) for q in counts}
    assert sum(counts.values()) == len(pol.windows)
