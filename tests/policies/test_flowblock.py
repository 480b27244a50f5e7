"""`flowblock` and `flowblock_sync` (FlowBlock: gated wavefront decoding, heterogeneous wavefront packing).

* the engine's cached, batched decode == a literal no-cache implementation of Algorithm 1 written here from the
  policy's description, over random tiny models, prompts ending mid-block and on a boundary, EOS in a downstream
  block, max_new_tokens not a multiple of the block, gates from ungated to strict, both readiness readings;
* W = 1 is exactly t2t; batch invariance (1 / 3 / 8 rows) for both variants; the lock-step variant gives
  flowblock's tokens with at least as many forwards; compiled == eager.
"""
from __future__ import annotations

import math

import pytest
import torch
from checkpoints import MASK_ID, write_checkpoint
from oracle import confidence

import compiledllm
from compiledllm.engine import Engine, EngineConfig, generate
from compiledllm.errors import UserError

NEAR_TIE = 1e-5


def literal_flowblock(model, prompt, *, block, n, window, spawn, threshold, edit_threshold, max_post_steps, eos,
                      readiness="before"):
    """Algorithm 1 for one sequence, no cache: each forward is the prefix up to the window's end, block-causal from
    position 0 (so a query of block g sees blocks <= g: the W-shaped mask)."""
    P = len(prompt)
    total = -(-(P + n) // block) * block
    x = list(prompt) + [MASK_ID] * (total - P)
    blocks, L = total // block, P // block
    R, post, st = L + 1, {}, {"forwards": 0, "margin": math.inf, "widths": []}

    def near(*gaps):
        st["margin"] = min([st["margin"], *map(abs, gaps)])

    while L < blocks:
        v, p, gap = confidence(model.reference_forward(torch.tensor([x[: R * block]]), block)[0], MASK_ID)
        v, p, gap = v.tolist(), p.tolist(), gap.tolist()
        st["forwards"] += 1
        st["widths"].append(R - L)
        old, finished, drafts = list(x), {}, {}
        for g in range(L, R):
            gen = range(max(g * block, P), (g + 1) * block)
            masked = [j for j in gen if old[j] == MASK_ID]
            post[g] = post.get(g, 0) + (not masked)
            expired = not masked and post[g] > max_post_steps
            m2t = [j for j in masked if p[j] > threshold]
            near(*(p[j] - threshold for j in masked))
            if masked and not m2t:
                m2t = [max(masked, key=lambda j: (p[j], -j))]
                near(*(p[m2t[0]] - p[j] for j in masked if j != m2t[0]))
            t2t = [j for j in gen if old[j] != MASK_ID and p[j] > edit_threshold and v[j] != old[j]]
            near(*(p[j] - edit_threshold for j in gen if old[j] != MASK_ID))
            if expired:
                m2t, t2t = [], []
            finished[g] = expired or (not masked and not t2t)
            for j in m2t + t2t:
                x[j] = v[j]
                near(gap[j])
            drafts[g] = (masked, m2t)
        start = L
        while L < R and finished[L]:
            L += 1
        if L > start and eos in x[max(start * block, P): L * block]:
            break
        first = True
        while R - L < window and R < blocks:
            masked, m2t = drafts.get(R - 1, ([], []))
            cand = masked if readiness == "before" else [j for j in masked if j not in m2t]
            rho = (sum(p[j] >= threshold for j in cand) / len(cand) if cand else 1.0) if first else 0.0
            if rho < spawn:
                break
            R, first = R + 1, False
    out = x[P: P + n]
    return (out[: out.index(eos) + 1] if eos in out else out), st


# (arch, seed, window, spawn, readiness, threshold, edit_threshold, max_post_steps, block, prompt_len, new tokens)
CASES = [
    ("llada2", 51, 2, 0.6, "before", 0.7, 0.5, 16, 4, 5, 13),
    ("llada2", 52, 3, 0.0, "before", 0.5, 0.3, 2, 4, 8, 14),
    ("llada2", 53, 2, 0.3, "after", 0.6, 0.4, 3, 4, 3, 11),
    ("llada2", 54, 4, 0.9, "before", 0.4, 0.2, 1, 4, 6, 17),
    ("sdar", 55, 2, 0.6, "before", 0.7, 0.5, 4, 4, 7, 10),
    ("sdar", 56, 3, 0.3, "before", 0.5, 0.3, 2, 8, 9, 21),
    ("sdar", 57, 2, 0.0, "after", 0.6, 0.5, 16, 4, 4, 13),
    ("llada2", 58, 2, 1.0, "before", 0.7, 0.5, 2, 4, 2, 9),
]


def policy(case) -> dict:
    _, _, w, spawn, readiness, tau, tau_e, post, block, _, _ = case
    return {"name": "flowblock", "block_size": block, "window": w, "spawn": spawn, "readiness": readiness,
            "threshold": tau, "edit_threshold": tau_e, "max_post_steps": post}


def literal_kw(pol: dict) -> dict:
    return {"block": pol["block_size"], **{k: pol[k] for k in ("window", "spawn", "readiness", "threshold",
                                                               "edit_threshold", "max_post_steps")}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {(arch, seed): write_checkpoint(tmp_path_factory.mktemp(f"{arch}{seed}"), arch, seed)
            for arch, seed, *_ in CASES}


def prompt_of(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def downstream_eos(model, prompt, n, pol) -> int:
    """An EOS id first generated in a block after the prompt's block (not its last position), so the stop lands in
    a downstream block mid-way."""
    full, _ = literal_flowblock(model, prompt, n=n, eos=-1, **literal_kw(pol))
    P, bk = len(prompt), pol["block_size"]
    for k, t in enumerate(full):
        pos = P + k
        if t not in full[:k] and pos // bk > P // bk and k < n - 2:
            return t
    return -1


_SEEN = {"wide": 0, "eos": 0}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-W{c[2]}-spawn{c[3]}-{c[4]}-bk{c[8]}-P{c[9]}")
def test_engine_equals_literal_algorithm_1(ckpts, case):
    arch, seed, *_, P, n = case
    pol = policy(case)
    model = compiledllm.load_model(ckpts[arch, seed])
    prompt = prompt_of(seed, P, model.config.vocab_size)
    eos = downstream_eos(model, prompt, n, pol)
    want, st = literal_flowblock(model, prompt, n=n, eos=eos, **literal_kw(pol))
    if st["margin"] < NEAR_TIE:
        pytest.skip(f"numerical near-tie (margin {st['margin']:.1e}); not a semantic mismatch")
    model = compiledllm.load_model(ckpts[arch, seed], eos_token_id=max(eos, 0))
    got = generate(model, [prompt], pol, max_new_tokens=n, batch_size=1)[0]
    assert got.output_ids == want, f"engine {got.output_ids}\nliteral {want}"
    assert got.steps == st["forwards"]
    _SEEN["wide"] += max(st["widths"]) > 1
    _SEEN["eos"] += eos >= 0 and len(want) < n


def test_grid_opened_windows_and_stopped_downstream():
    if sum(_SEEN.values()) == 0:
        pytest.skip("run together with test_engine_equals_literal_algorithm_1")
    assert _SEEN["wide"] >= 5 and _SEEN["eos"] >= 3, _SEEN


@pytest.mark.parametrize("t2t", [(0.7, 0.5, 16, 4, 5, 13), (0.5, 0.3, 2, 4, 8, 14), (0.9, 0.6, 4, 8, 3, 19)])
def test_window_1_is_t2t(ckpts, t2t):
    tau, tau_e, post, block, P, n = t2t
    model = compiledllm.load_model(ckpts["llada2", 51], eos_token_id=7)
    ps = [prompt_of(s, P + s % 3, model.config.vocab_size) for s in range(4)]
    base = {"block_size": block, "threshold": tau, "edit_threshold": tau_e, "max_post_steps": post}
    plain = generate(model, ps, {"name": "t2t", **base}, max_new_tokens=n, batch_size=2)
    flow = generate(model, ps, {"name": "flowblock", "window": 1, **base}, max_new_tokens=n, batch_size=2)
    assert [r.output_ids for r in flow] == [r.output_ids for r in plain]
    assert [r.steps for r in flow] == [r.steps for r in plain]


def test_batch_invariance_and_the_lock_step_variant(ckpts):
    model = compiledllm.load_model(ckpts["sdar", 55], eos_token_id=11)
    ps = [prompt_of(100 + i, n, model.config.vocab_size) for i, n in enumerate([5, 1, 12, 8, 3, 15, 4, 9])]
    pol = policy(CASES[4])
    kw = dict(max_new_tokens=14, max_seq_len=40)
    alone = [generate(model, [p], pol, batch_size=1, **kw)[0] for p in ps]
    assert len({len(a.output_ids) for a in alone}) > 1, "rows should stop at different lengths"
    for bs in (3, 8):
        flow = generate(model, ps, pol, batch_size=bs, **kw)
        assert [r.output_ids for r in flow] == [a.output_ids for a in alone], bs
        assert [r.steps for r in flow] == [a.steps for a in alone], bs
        sync = generate(model, ps, {**pol, "name": "flowblock_sync"}, batch_size=bs, **kw)
        assert [r.output_ids for r in sync] == [a.output_ids for a in alone], bs  # flowblock's tokens
        assert all(s.steps >= a.steps for s, a in zip(sync, alone)) and sum(s.steps for s in sync) > sum(
            a.steps for a in alone), "lock-step must cost forwards in a mixed batch"
    one = generate(model, ps[:1], {**pol, "name": "flowblock_sync"}, batch_size=1, **kw)[0]
    assert one.output_ids == alone[0].output_ids and one.steps == alone[0].steps  # alone it is flowblock


def test_compiled_equals_eager_and_per_request_statistics(ckpts, compile_kw):
    model = compiledllm.load_model(ckpts["llada2", 52], eos_token_id=5)
    ps = [prompt_of(i, 4 + 3 * i, model.config.vocab_size) for i in range(4)]
    pol = policy(CASES[1]) | {"window": 2}  # 8-token forwards, as test_draft_decode's draft phase: shared kernels
    kw = dict(max_new_tokens=12, **compile_kw)
    eager = Engine(model, EngineConfig(pol, **kw)).generate(ps)
    compiled = Engine(model, EngineConfig(pol, compile=True, **kw)).generate(ps)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    for r in eager:
        s = r.extra
        assert set(s) == {"front_drafts", "down_drafts", "front_edits", "down_edits"}
        assert s["front_edits"] <= s["front_drafts"] and s["down_edits"] <= s["down_drafts"]  # each draft once
    assert sum(r.extra["down_drafts"] for r in eager) > 0  # the ungated window drafts downstream


def test_block_routed_windows_route_each_block_alone(tmp_path):
    """A block-routed MoE (LLaDA2.2, capacity 3 of 8): a window of W blocks is one forward whose blocks are route
    groups of their own, so the engine's tokens equal Algorithm 1 over the no-cache forward that routes blocks of
    positions (the model's reference_forward), batched and alone."""
    model = compiledllm.load_model(write_checkpoint(tmp_path, "llada2", 3, expert_capacity=3, block_size=4))
    pol = {"name": "flowblock", "block_size": 4, "window": 3, "spawn": 0.0, "readiness": "before", "threshold": 0.5,
           "edit_threshold": 0.3, "max_post_steps": 2}
    prompts, n = [[5, 9, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]], 14
    got = [list(r.output_ids) for r in generate(model, prompts, pol, max_new_tokens=n, batch_size=2)]
    for prompt, tokens in zip(prompts, got):
        want, st = literal_flowblock(model, prompt, n=n, eos=model.eos_token_id, **literal_kw(pol))
        assert max(st["widths"]) > 1  # windows of several blocks really ran
        if tokens != want and st["margin"] < NEAR_TIE:
            pytest.skip(f"numerical near-tie (margin {st['margin']:.2e})")
        assert tokens == want
    assert [list(generate(model, [p], pol, max_new_tokens=n, batch_size=1)[0].output_ids) for p in prompts] == got


def test_bidirectional_models_and_bad_settings_are_one_line_errors(tmp_path):
    llada = compiledllm.load_model(write_checkpoint(tmp_path / "l", "llada", 3))
    with pytest.raises(UserError, match="bidirectional"):
        generate(llada, [[2, 3]], {"name": "flowblock"}, max_new_tokens=4)
    with pytest.raises(UserError, match="policy.window"):
        generate(llada, [[2, 3]], {"name": "flowblock", "window": 0}, max_new_tokens=4)
    with pytest.raises(UserError, match="policy.spawn"):
        generate(llada, [[2, 3]], {"name": "flowblock", "spawn": 1.5}, max_new_tokens=4)
