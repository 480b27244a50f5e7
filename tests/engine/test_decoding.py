"""Cached / batched / compiled decoding against the literal docs/design.md §4 decoder.

* literal_decode (tests/oracle.py) self-checks on hand-made logits;
* (a) engine `threshold` and `t2t` tokens == literal_decode (no cache) over several
  random tiny models and prompt lengths: prompt ending mid-block and at a block
  boundary, EOS mid-block, max_new_tokens not a multiple of the block, thresholds
  that accept several tokens per step and one at a time, block sizes 4 and 8,
  LLaDA (bidirectional) with `threshold`; EOS inside the prompt does not stop; exact
  token-id ties (duplicated output-head rows) go to the lower id;
* (b) batch invariance: 8 prompts of mixed lengths in batches of 1, 3 and 8 give
  the tokens each gives alone (same max_seq_len);
* (c) compiled step == eager step.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from checkpoints import MASK_ID, write_checkpoint
from oracle import OracleModel, literal_decode

import compiledllm
from compiledllm.engine import Engine, generate

V = 96
NEAR_TIE = 1e-5  # a decision this close to a threshold / tie may flip between float paths

# name -> (arch, seed, overrides)
BLOCK_CAUSAL = {
    "llada2_g4_s0": ("llada2", 0, {}),
    "llada2_g4_s1": ("llada2", 1, {}),
    "llada2_g1_s2": ("llada2", 2, {"n_group": 1, "topk_group": 1}),
    "sdar_s3": ("sdar", 3, {}),
    "sdar_s4": ("sdar", 4, {"num_hidden_layers": 3}),
    "sdar_tied_s5": ("sdar", 5, {"tied": True}),
}
BIDIRECTIONAL = {
    "llada_s6": ("llada", 6, {}),
    "llada_s7": ("llada", 7, {}),
}

# (policy, block, prompt_len, max_new_tokens, eos_mode)
#   prompt_len % block != 0: prompt ends mid-block; == 0: at a boundary.
#   max_new_tokens is never a multiple of the block except one control case.
#   eos_mode: "mid" EOS generated mid-block before the last block; "none" never generated;
#   "prompt" EOS = the last prompt token, inside the first decoded block (only generated
#   tokens count for stopping).
THRESHOLD_CASES = [
    ({"name": "threshold", "threshold": 0.9}, 4, 5, 10, "none"),
    ({"name": "threshold", "threshold": 0.5}, 4, 8, 13, "mid"),
    ({"name": "threshold", "threshold": 0.3}, 8, 3, 17, "mid"),
    ({"name": "threshold", "threshold": 0.9}, 8, 16, 11, "none"),
    ({"name": "threshold", "threshold": 0.3}, 4, 1, 7, "none"),
    ({"name": "threshold", "threshold": 0.7}, 4, 4, 8, "mid"),
    ({"name": "threshold", "threshold": 0.5}, 4, 7, 6, "prompt"),
    ({"name": "threshold", "threshold": 0.5}, 8, 2, 3, "none"),
]
T2T_CASES = [
    ({"name": "t2t", "threshold": 0.7, "edit_threshold": 0.5, "max_post_steps": 16}, 4, 6, 10, "none"),
    ({"name": "t2t", "threshold": 0.5, "edit_threshold": 0.3, "max_post_steps": 2}, 4, 8, 9, "mid"),
    ({"name": "t2t", "threshold": 0.9, "edit_threshold": 0.6, "max_post_steps": 4}, 8, 5, 14, "mid"),
    ({"name": "t2t", "threshold": 0.3, "edit_threshold": 0.2, "max_post_steps": 1}, 8, 16, 7, "none"),
    ({"name": "t2t", "threshold": 0.7, "edit_threshold": 0.5, "max_post_steps": 16}, 4, 3, 9, "prompt"),
]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, (arch, seed, kw) in {**BLOCK_CAUSAL, **BIDIRECTIONAL}.items():
        out[name] = write_checkpoint(tmp_path_factory.mktemp(name), arch, seed, **kw)
    return out


_MODELS: dict = {}


def _model(d: Path, eos: int):
    key = (str(d), eos)
    if key not in _MODELS:
        _MODELS[key] = compiledllm.load_model(d, device="cpu", dtype=torch.float32, eos_token_id=eos)
        assert _MODELS[key].eos_token_id == eos
    return _MODELS[key]


def _logits_fn(model):
    def fn(ids, block_size):
        with torch.no_grad():
            return model.reference_forward(ids, block_size)

    return fn


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(500 + seed)
    ids = torch.randint(2, V, (length,), generator=g).tolist()  # never MASK (1); may contain EOS
    return ids


def _literal(fn, prompt, policy, block, n, eos, bidirectional, stats=None):
    return literal_decode(
        fn, prompt, policy=policy["name"], block_size=block, max_new_tokens=n, mask_id=MASK_ID,
        eos_id=eos, threshold=policy["threshold"], edit_threshold=policy.get("edit_threshold"),
        max_post_steps=policy.get("max_post_steps"), bidirectional=bidirectional, stats=stats,
    )


def _pick_eos(full: list[int], prompt_len: int, block: int, mode: str) -> tuple[int, int | None]:
    """EOS id for a case and the index in `full` where decoding must stop (None: never).

    "mid": the first-occurring token that sits mid-block (not the block's last slot)
    in a block before the last one, so stopping is early and truncates inside a block.
    "none": an id that never appears in the generation.
    "prompt": the last prompt token (the caller checks it), stopping where it is first generated.
    """
    last_block = (prompt_len + len(full) - 1) // block
    if mode == "mid":
        for k, t in enumerate(full):
            pos = prompt_len + k
            if t not in full[:k] and pos % block != block - 1 and pos // block < last_block:
                return t, k
    for t in range(2, V):
        if t not in full:
            return t, None
    raise AssertionError("no EOS candidate")


def _eos_for_mixed_stops(fulls: list[list[int]], n: int) -> int:
    """EOS = a token that some (not all) rows generate early, so rows stop at different steps."""
    counts = Counter(t for f in fulls for t in set(f[: n - 2]))
    half = len(fulls) / 2
    return max(counts, key=lambda t: (0 < counts[t] < len(fulls), -abs(counts[t] - half), -t))


def _assert_same(got, want, stats, what):
    if got != want and stats.get("min_margin", math.inf) < NEAR_TIE:
        pytest.skip(f"{what}: numerical near-tie (margin {stats['min_margin']:.2e}); not a semantic mismatch")
    assert got == want, f"{what}\n engine : {got}\n literal: {want}"


def _policy(policy: dict, block: int) -> dict:
    return {**policy, "block_size": block}


# ----------------------------------------------------------------------------- literal decoder self-checks


def _table_fn(table: dict[int, tuple[int, float]], vocab: int = 8, mask_logit: dict | None = None):
    """logits_fn with fixed per-position distributions: position j -> (token, logit)."""
    calls = []

    def fn(ids, block_size):
        calls.append((ids.clone(), block_size))
        L = ids.shape[1]
        logits = torch.zeros(1, L, vocab)
        for j in range(L):
            tok, a = table.get(j, (2, 0.5))
            logits[0, j, tok] = a
            if mask_logit and j in mask_logit:
                logits[0, j, MASK_ID] = mask_logit[j]
        return logits

    fn.calls = calls
    return fn


def _p(a: float, vocab: int = 8) -> float:
    return math.exp(a) / (math.exp(a) + vocab - 1)


def test_literal_threshold_by_hand():
    # P=2, N=5, Bk=4 -> working sequence 8 long, blocks 0 and 1.
    table = {2: (3, 4.0), 3: (4, 1.0), 4: (5, 5.0), 5: (6, 5.0), 6: (7, 0.2), 7: (2, 0.1)}
    assert _p(4.0) > 0.8 > _p(1.0) and _p(5.0) > 0.9
    fn = _table_fn(table)
    st = {}
    out = literal_decode(fn, [6, 7], policy="threshold", block_size=4, max_new_tokens=5,
                         mask_id=MASK_ID, eos_id=0, threshold=0.8, stats=st)
    assert out == [3, 4, 5, 6, 7]
    # block 0: accept pos 2 (>0.8); then pos 3 alone; final forward -> 3 forwards
    # block 1: accept 4, 5 together; then 6 (most confident of 6, 7); then 7; final -> 4 forwards
    assert st["forwards"] == 7
    assert [c[0].shape[1] for c in fn.calls] == [4, 4, 4, 8, 8, 8, 8]
    assert all(c[1] == 4 for c in fn.calls)


def test_literal_mask_excluded_and_ties():
    # position 2: MASK has the largest logit -> v is the best non-mask token; p counts MASK mass.
    # positions 3 and 4 tie exactly -> the lower position is accepted first.
    table = {2: (5, 2.0), 3: (4, 1.0), 4: (4, 1.0)}
    fn = _table_fn(table, mask_logit={2: 6.0})
    st = {}
    out = literal_decode(fn, [7, 7], policy="threshold", block_size=4, max_new_tokens=2,
                         mask_id=MASK_ID, eos_id=0, threshold=0.95, stats=st)
    # p_2 is tiny (MASK takes the mass) -> pos 3 (p=_p(1)) beats pos 2; then 2 vs none
    assert out == [5, 4]
    # tie between tokens: ids 3 and 6 with equal logits -> lower id 3
    fn = lambda ids, bs: torch.zeros(1, ids.shape[1], 8).index_fill_(2, torch.tensor([3, 6]), 1.0)
    out = literal_decode(fn, [2], policy="threshold", block_size=2, max_new_tokens=1,
                         mask_id=MASK_ID, eos_id=0, threshold=0.95)
    assert out == [3]


def test_literal_eos_truncation_and_stop():
    table = {j: (j % 6 + 2, 5.0) for j in range(16)}
    table[5] = (0, 5.0)  # EOS at position 5, mid block 1 (Bk 4)
    fn = _table_fn(table)
    st = {}
    out = literal_decode(fn, [3, 3, 3], policy="threshold", block_size=4, max_new_tokens=12,
                         mask_id=MASK_ID, eos_id=0, threshold=0.5, stats=st)
    assert out == [5, 6, 0]
    # stopped after block 1: block 0 (1 accept + final) + block 1 (1 accept + final)
    assert st["forwards"] == 4
    # cap at max_new_tokens without EOS
    out = literal_decode(fn, [3, 3, 3], policy="threshold", block_size=4, max_new_tokens=2,
                         mask_id=MASK_ID, eos_id=1000, threshold=0.5)
    assert out == [5, 6]


def test_literal_t2t_edits_and_post_steps():
    # A model whose prediction at a position flips once it has been written: it proposes 4
    # for a MASK and 5 for a 4, confidently -> one edit, then stable.
    def fn(ids, bs):
        L = ids.shape[1]
        logits = torch.zeros(1, L, 8)
        for j in range(L):
            t = ids[0, j].item()
            logits[0, j, 5 if t in (4, 5) else 4] = 5.0
        return logits

    st = {}
    out = literal_decode(fn, [2], policy="t2t", block_size=2, max_new_tokens=1, mask_id=MASK_ID,
                         eos_id=0, threshold=0.7, edit_threshold=0.5, max_post_steps=16, stats=st)
    # step 1: M2T writes 4 at pos 1; step 2 (no mask, post=1): T2T 4->5; step 3 (post=2): nothing -> done
    assert out == [5] and st["forwards"] == 3
    # prompt tokens are never edited: prompt [4] would be "edited" to 5 if it were generated
    out = literal_decode(fn, [4], policy="t2t", block_size=2, max_new_tokens=1, mask_id=MASK_ID,
                         eos_id=0, threshold=0.7, edit_threshold=0.5, max_post_steps=16)
    assert out == [5]

    # an oscillating model: 4 <-> 5 forever -> stops after max_post_steps post steps
    def osc(ids, bs):
        L = ids.shape[1]
        logits = torch.zeros(1, L, 8)
        for j in range(L):
            t = ids[0, j].item()
            logits[0, j, 5 if t == 4 else 4] = 5.0
        return logits

    for m in (0, 1, 3):
        st = {}
        out = literal_decode(osc, [2], policy="t2t", block_size=2, max_new_tokens=1, mask_id=MASK_ID,
                             eos_id=0, threshold=0.7, edit_threshold=0.5, max_post_steps=m, stats=st)
        assert st["forwards"] == 1 + m
        assert out == [4 if m % 2 == 0 else 5]


def test_literal_on_reference_forward_matches_oracle(ckpt_dirs):
    """Decisions made with the float32 reference_forward are those of the float64 oracle."""
    for name in ("llada2_g4_s0", "sdar_s3", "llada_s6"):
        d = ckpt_dirs[name]
        bidir = name in BIDIRECTIONAL
        model = _model(d, 0)
        oracle = OracleModel(d)
        for policy, block, P, N, _ in (THRESHOLD_CASES[1], T2T_CASES[0]):
            if bidir and policy["name"] == "t2t":
                continue
            prompt = _prompt(P, P)
            st = {}
            want = _literal(oracle, prompt, policy, block, N, -1, bidir)
            got = _literal(_logits_fn(model), prompt, policy, block, N, -1, bidir, st)
            _assert_same(got, want, st, f"{name} {policy}")


# ----------------------------------------------------------------------------- (a) cached == literal


def _cases():
    out = []
    for name in BLOCK_CAUSAL:
        for i, case in enumerate(THRESHOLD_CASES + T2T_CASES):
            out.append(pytest.param(name, *case, id=f"{name}-{case[0]['name']}{i}"))
    for name in BIDIRECTIONAL:
        for i, case in enumerate(THRESHOLD_CASES[:4] + THRESHOLD_CASES[6:]):
            out.append(pytest.param(name, *case, id=f"{name}-threshold{i}"))
    return out


# counters over the whole (a) grid, checked by test_grid_exercised_both_regimes
_SEEN: Counter = Counter()


@pytest.mark.parametrize("name,policy,block,P,N,eos_mode", _cases())
def test_cached_equals_literal(ckpt_dirs, name, policy, block, P, N, eos_mode):
    d = ckpt_dirs[name]
    bidir = name in BIDIRECTIONAL
    prompt = _prompt(P * 31 + N + block, P)
    # first a run that never stops, to choose the EOS id
    fn = _logits_fn(_model(d, 0))
    full = _literal(fn, prompt, policy, block, N, 10**9, bidir)
    assert len(full) == N and MASK_ID not in full
    if eos_mode == "prompt":
        assert P % block != 0
        eos = prompt[-1]
        stop = full.index(eos) if eos in full else None
    else:
        eos, stop = _pick_eos(full, P, block, eos_mode)
    st = {}
    want = _literal(fn, prompt, policy, block, N, eos, bidir, st)
    assert want == (full if stop is None else full[: stop + 1])
    if eos_mode == "mid":
        assert stop is not None and len(want) < N, "no mid-block EOS candidate in this case"
        _SEEN["eos_mid"] += 1
    _SEEN["multi_accept_steps"] += sum(a > 1 for a in st["accepted"])
    _SEEN["single_accept_steps"] += sum(a == 1 for a in st["accepted"])
    _SEEN["cases"] += 1

    model = _model(d, eos)
    res = generate(model, [prompt], _policy(policy, block), max_new_tokens=N, batch_size=1)
    assert len(res) == 1
    _assert_same(list(res[0].output_ids), want, st, f"{name} {policy} bk={block} P={P} N={N} eos={eos}")
    assert res[0].steps > 0


def test_grid_exercised_both_regimes():
    """The (a) grid contains steps accepting several tokens, steps accepting one, mid-block EOS stops."""
    if _SEEN["cases"] < len(_cases()):
        pytest.skip("run together with the whole (a) grid")
    assert _SEEN["multi_accept_steps"] >= 20 and _SEEN["single_accept_steps"] >= 20, dict(_SEEN)
    assert _SEEN["eos_mid"] >= 10, dict(_SEEN)


@pytest.mark.parametrize("name", ["llada2_g4_s1", "sdar_tied_s5", "llada_s7"])
def test_engine_equals_literal_on_oracle(ckpt_dirs, name):
    """Ties the engine directly to the float64 oracle (no lead code in the expected tokens)."""
    d = ckpt_dirs[name]
    bidir = name in BIDIRECTIONAL
    oracle = OracleModel(d)
    cases = [THRESHOLD_CASES[2]] + ([] if bidir else [T2T_CASES[1]])
    for policy, block, P, N, _ in cases:
        prompt = _prompt(7 * P, P)
        full = _literal(oracle, prompt, policy, block, N, 10**9, bidir)
        eos, stop = _pick_eos(full, P, block, "mid")
        st = {}
        want = _literal(oracle, prompt, policy, block, N, eos, bidir, st)
        got = generate(_model(d, eos), [prompt], _policy(policy, block), max_new_tokens=N, batch_size=1)
        _assert_same(list(got[0].output_ids), want, st, f"{name} {policy}")


@pytest.mark.parametrize("arch", ["llada2", "sdar", "llada"])
def test_token_ties_go_to_lower_id(tmp_path, arch):
    """Output-head rows 2j and 2j+1 are equal: every argmax is an exact tie -> the even id."""
    d = write_checkpoint(tmp_path, arch, seed=21, duplicate_head_rows=True)
    bidir = arch == "llada"
    policies = [({"name": "threshold", "threshold": 0.4}, 4)]
    if not bidir:
        policies.append(({"name": "t2t", "threshold": 0.4, "edit_threshold": 0.2, "max_post_steps": 3}, 4))
    for policy, block in policies:
        prompt = _prompt(40, 6)
        model = _model(d, 0)
        st = {}
        want = _literal(_logits_fn(model), prompt, policy, block, 9, 0, bidir, st)
        assert all(t == 0 or t % 2 == 0 for t in want), want
        got = generate(model, [prompt], _policy(policy, block), max_new_tokens=9, batch_size=1)
        _assert_same(list(got[0].output_ids), want, st, f"{arch} {policy} ties")


# ----------------------------------------------------------------------------- fused commit


def _fused_cases():
    return [pytest.param(name, *case, id=f"{name}-threshold{i}") for name in BLOCK_CAUSAL
            for i, case in enumerate(THRESHOLD_CASES)]


@pytest.mark.parametrize("name,policy,block,P,N,eos_mode", _fused_cases())
def test_fused_commit_equals_literal_with_one_forward_fewer_a_block(ckpt_dirs, name, policy, block, P, N, eos_mode):
    """commit: fused gives the literal decoder's tokens (as commit: separate does), and every block, the last and
    the EOS block too, costs exactly one forward fewer: the forward that only wrote its KV is gone."""
    d = ckpt_dirs[name]
    prompt = _prompt(P * 31 + N + block, P)
    fn = _logits_fn(_model(d, 0))
    full = _literal(fn, prompt, policy, block, N, 10**9, False)
    if eos_mode == "prompt":
        eos = prompt[-1]
    else:
        eos, _ = _pick_eos(full, P, block, eos_mode)
    st = {}
    want = _literal(fn, prompt, policy, block, N, eos, False, st)
    model = _model(d, eos)
    sep, fused = (generate(model, [prompt], _policy(policy, block) | {"commit": c}, max_new_tokens=N, batch_size=1)[0]
                  for c in ("separate", "fused"))
    what = f"{name} {policy} bk={block} P={P} N={N} eos={eos}"
    _assert_same(list(fused.output_ids), want, st, what + " fused")
    assert list(sep.output_ids) == list(fused.output_ids), what
    assert fused.blocks == sep.blocks > 0 and fused.steps == sep.steps - sep.blocks, (what, sep, fused)


def test_fused_commit_is_batch_invariant_and_a_no_op_on_bidirectional_models(ckpt_dirs):
    """Rows begin blocks at different steps (so "commit" forwards mix due and dead previous blocks): batched ==
    alone == commit: separate. A bidirectional model caches nothing: fused changes neither tokens nor forwards."""
    N, max_seq_len, block = 12, 48, 4
    policy = _policy({"name": "threshold", "threshold": 0.5}, block)
    prompts = [_prompt(100 + i, n) for i, n in enumerate(BATCH_LENGTHS)]
    for name in ("llada2_g4_s0", "sdar_s3", "llada_s6"):
        fn = _logits_fn(_model(ckpt_dirs[name], 0))
        eos = _eos_for_mixed_stops([_literal(fn, p, policy, block, N, 10**9, name in BIDIRECTIONAL)
                                    for p in prompts], N)
        model = _model(ckpt_dirs[name], eos)
        run = lambda commit, bs: generate(model, prompts, policy | {"commit": commit}, max_new_tokens=N,  # noqa: E731
                                          batch_size=bs, max_seq_len=max_seq_len)
        sep = run("separate", 3)
        want = [list(r.output_ids) for r in sep]
        assert len({len(w) for w in want}) > 1, "rows should stop at different steps"
        for bs in (1, 3, 8):
            fused = run("fused", bs)
            assert [list(r.output_ids) for r in fused] == want, (name, bs)
            saved = 0 if name in BIDIRECTIONAL else 1
            assert [r.steps for r in fused] == [r.steps - saved * r.blocks for r in sep], (name, bs)


@pytest.mark.parametrize("rule", ["sdar_static", "sdar_dynamic"])
def test_fused_commit_keeps_the_peer_rules_tokens(ckpt_dirs, rule):
    """SDAR's rules (threshold's `rule`, with `steps`) under a fused commit: their tokens, one forward fewer a block."""
    model = _model(ckpt_dirs["sdar_s3"], 0)
    prompts = [_prompt(400 + i, n) for i, n in enumerate([5, 8, 3])]
    policy = _policy({"name": "threshold", "threshold": 0.6, "rule": rule, "steps": 2}, 4)
    sep, fused = ([generate(model, [p], policy | {"commit": c}, max_new_tokens=10, batch_size=1)[0] for p in prompts]
                  for c in ("separate", "fused"))
    assert [r.output_ids for r in fused] == [r.output_ids for r in sep]
    assert [r.steps for r in fused] == [r.steps - r.blocks for r in sep]


def test_commit_setting_is_checked():
    from compiledllm.errors import UserError
    from compiledllm.policies import policy_config

    with pytest.raises(UserError, match=r"^policy\.commit: .*'later'"):
        policy_config({"name": "threshold", "commit": "later"})
    assert policy_config({"name": "threshold", "commit": "fused"}).commit == "fused"


def test_commit_auto_is_fused_on_cuda_only(ckpt_dirs):
    """commit: auto (the default) resolves by the engine's device: fused on CUDA, separate on the CPU, with verify,
    for a policy that fills its own KV after a block's retiring forward (kv_hook: mage) and in an exported engine.
    Unresolved, it is separate."""
    from compiledllm.policies import policy_class, policy_config

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = policy_config({"name": "threshold"})
    assert auto.commit == "auto" and not policy_class(auto).kv_hook
    assert auto.for_engine(False, cuda, exported=False).commit == "fused"
    assert auto.for_engine(False, cpu, exported=False).commit == "separate"
    assert auto.for_engine(False, cuda, exported=True).commit == "separate"
    assert auto.for_engine(True, cuda, exported=False).commit == "separate"
    assert policy_config({"name": "threshold", "verify": True}).for_engine(False, cuda, False).commit == "separate"
    mage = policy_config({"name": "mage"})
    assert mage.for_engine(policy_class(mage).kv_hook, cuda, False).commit == "separate"
    given = policy_config({"name": "threshold", "commit": "separate"})
    assert given.for_engine(False, cuda, False) is given
    engine = Engine(_model(ckpt_dirs["llada2_g4_s0"], 0), auto, max_new_tokens=8)
    assert engine.policy.config.commit == "separate" and not engine.policy.fused


def test_fused_commit_keeps_sampled_tokens(ckpt_dirs):
    """Sampling keys count a block's deciding steps, not forwards: both commits draw the same tokens."""
    model = _model(ckpt_dirs["llada2_g4_s1"], 0)
    prompts = [_prompt(300 + i, n) for i, n in enumerate([3, 8, 5])]
    policy = _policy({"name": "threshold", "threshold": 0.6, "temperature": 1.3, "seed": 4}, 4)
    runs = {c: [list(r.output_ids) for r in generate(model, prompts, policy | {"commit": c}, max_new_tokens=10,
                                                     batch_size=2)] for c in ("separate", "fused")}
    assert runs["fused"] == runs["separate"]
    greedy = [list(r.output_ids) for r in generate(model, prompts, _policy({"name": "threshold", "threshold": 0.6}, 4),
                                                   max_new_tokens=10, batch_size=2)]
    assert runs["fused"] != greedy  # the temperature did something


# ----------------------------------------------------------------------------- (b) batch invariance


BATCH_LENGTHS = [5, 1, 12, 8, 3, 15, 4, 9]  # mixed; mid-block and boundary for Bk 4
BATCH_CASES = [
    ("llada2_g4_s0", {"name": "threshold", "threshold": 0.5}, 4),
    ("llada2_g1_s2", {"name": "t2t", "threshold": 0.7, "edit_threshold": 0.5, "max_post_steps": 3}, 4),
    ("sdar_s3", {"name": "threshold", "threshold": 0.9}, 8),
    ("sdar_s4", {"name": "t2t", "threshold": 0.5, "edit_threshold": 0.3, "max_post_steps": 2}, 4),
    ("llada_s6", {"name": "threshold", "threshold": 0.5}, 4),
]


@pytest.mark.parametrize("name,policy,block", BATCH_CASES, ids=[f"{c[0]}-{c[1]['name']}" for c in BATCH_CASES])
def test_batch_invariance(ckpt_dirs, name, policy, block):
    d = ckpt_dirs[name]
    bidir = name in BIDIRECTIONAL
    N, max_seq_len = 12, 48
    prompts = [_prompt(100 + i, n) for i, n in enumerate(BATCH_LENGTHS)]
    fn = _logits_fn(_model(d, 0))
    fulls = [_literal(fn, p, policy, block, N, 10**9, bidir) for p in prompts]
    eos = _eos_for_mixed_stops(fulls, N)
    model = _model(d, eos)
    pol = _policy(policy, block)
    alone = [list(generate(model, [p], pol, max_new_tokens=N, batch_size=1, max_seq_len=max_seq_len)[0].output_ids)
             for p in prompts]
    lengths = {len(a) for a in alone}
    assert len(lengths) > 1, "EOS choice should make rows stop at different lengths"
    for bs in (1, 3, 8):
        res = generate(model, prompts, pol, max_new_tokens=N, batch_size=bs, max_seq_len=max_seq_len)
        assert len(res) == len(prompts)
        got = [list(r.output_ids) for r in res]
        for i, (g, a) in enumerate(zip(got, alone)):
            assert g == a, f"batch_size={bs} prompt {i} (len {len(prompts[i])}):\n batched: {g}\n alone  : {a}"
    # and alone == literal
    for p, a in zip(prompts, alone):
        st = {}
        want = _literal(_logits_fn(model), p, policy, block, N, eos, bidir, st)
        _assert_same(a, want, st, f"{name} alone vs literal")


# ----------------------------------------------------------------------------- (c) compiled == eager


COMPILE_CASES = [
    ("llada2_g4_s0", {"name": "threshold", "threshold": 0.5}, 4),
    ("llada2_g4_s0", {"name": "threshold", "threshold": 0.5, "commit": "fused"}, 4),  # its 2-block "commit" phase
    ("sdar_s3", {"name": "t2t", "threshold": 0.7, "edit_threshold": 0.5, "max_post_steps": 4}, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,policy,block", COMPILE_CASES,
                         ids=[f"{c[0]}-{c[1]['name']}-{c[1].get('commit', 'separate')}" for c in COMPILE_CASES])
def test_compiled_equals_eager(ckpt_dirs, compile_kw, name, policy, block):
    d = ckpt_dirs[name]
    prompts = [_prompt(200 + i, n) for i, n in enumerate([5, 8, 2, 11])]
    fn = _logits_fn(_model(d, 0))
    eos = _eos_for_mixed_stops([_literal(fn, p, policy, block, 10, 10**9, False) for p in prompts], 10)
    model = _model(d, eos)
    pol = _policy(policy, block)
    kw = dict(max_new_tokens=10, **compile_kw)
    eager = [list(r.output_ids) for r in generate(model, prompts, pol, compile=False, **kw)]
    compiled = [list(r.output_ids) for r in generate(model, prompts, pol, compile=True, **kw)]
    assert compiled == eager
    assert len({len(e) for e in eager}) > 1, "rows should stop at different steps"


# The two tests below run the built-in tiny LLaDA2 (bfloat16: compiled torch._grouped_mm on the CPU) with the same
# prompts, block, capacity and first threshold, so the second reuses the first's compiled bucket-2 graphs.
TINY_PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
TINY_RUN = dict(max_new_tokens=8, batch_size=2)


@pytest.fixture(scope="module")
def tiny():
    return compiledllm.load_model("compiledllm/assets/tiny-llada2")


def test_regional_compile_shares_one_graph_per_layer_kind(tiny):
    """compile: true compiles each layer kind once per bucket (plus the acceptance), not each of the layers:
    start-up time must not grow with depth. The built-in tiny LLaDA2 has a dense first layer and MoE layers."""
    from torch._dynamo.utils import counters

    kinds = len({type(layer.mlp) for layer in tiny.layers})
    assert len(tiny.layers) > kinds
    torch._dynamo.reset()
    counters.clear()
    pol = {"name": "threshold", "block_size": 4, "threshold": 0.5}
    compiled = generate(tiny, TINY_PROMPTS, pol, compile=True, **TINY_RUN)
    buckets = 1  # without CUDA graphs the CPU engine runs one bucket: the batch size
    assert counters["stats"]["unique_graphs"] == (kinds + 1) * buckets
    eager = generate(tiny, TINY_PROMPTS, pol, compile=False, **TINY_RUN)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]


@pytest.mark.slow
def test_compiled_engines_of_several_policies_in_one_process(tiny):
    """`eval` with compile: true builds one engine per policy in one process. The policy's settings are guarded
    values, so each engine adds its buckets' variants of the acceptance step: the recompile limit must make room
    for them (from a limit of 1 here, as a long process would reach any fixed limit). Three engines: a room that is
    set rather than added to (4 variants here) is then too small at the third."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        for tau in (0.5, 0.6, 0.7):
            pol = {"name": "threshold", "block_size": 4, "threshold": tau}
            runs = [Engine(tiny, pol, compile=c, cuda_graphs=False, buckets=[1, 2], **TINY_RUN).generate(TINY_PROMPTS)
                    for c in (True, False)]
            assert [r.output_ids for r in runs[0]] == [r.output_ids for r in runs[1]]
