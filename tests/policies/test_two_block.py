"""A new decoding algorithm is a new file with no edit to the engine (docs/design.md §2): the test-only policy in
two_block.py forwards two blocks per step and retires up to two. Its cached, batched and compiled runs give the
tokens of a literal no-cache decoder of the same algorithm (written here from its description)."""
from __future__ import annotations

import math

import pytest
import torch
from checkpoints import MASK_ID, write_checkpoint
from oracle import confidence
from two_block import TwoBlockConfig, TwoBlockPolicy

import compiledllm
from compiledllm.engine import Engine, EngineConfig
from compiledllm.policies import register_policy

register_policy("two_block", TwoBlockConfig, TwoBlockPolicy)
NEAR_TIE = 1e-5


def literal_two_block(model, prompt: list[int], block: int, n: int, tau: float, eos: int) -> tuple[list[int], dict]:
    """Two blocks per forward, no cache: each forward is the whole prefix up to the window's end, block-causal."""
    P = len(prompt)
    W = -(-(P + n) // block) * block
    x = list(prompt) + [MASK_ID] * (W - P)
    L, stats = P // block * block, {"forwards": 0, "advances": [], "margin": math.inf}
    while L < W:
        end = min(L + 2 * block, W)
        v, p, gap = confidence(model.reference_forward(torch.tensor([x[:end]]), block)[0], MASK_ID)
        v, p = v.tolist(), p.tolist()
        stats["forwards"] += 1
        final = []
        for b0 in range(L, end, block):
            masked = [j for j in range(max(b0, P), b0 + block) if x[j] == MASK_ID]
            final.append(not masked)
            acc = [j for j in masked if p[j] > tau]
            if masked and not acc:
                acc = [max(masked, key=lambda j: (p[j], -j))]
                stats["margin"] = min([stats["margin"]] + [p[acc[0]] - p[j] for j in masked if j != acc[0]])
            stats["margin"] = min([stats["margin"]] + [abs(p[j] - tau) for j in masked] + [gap[j] for j in acc])
            for j in acc:
                x[j] = v[j]
        advance = (1 + (len(final) > 1 and final[1])) if final[0] else 0
        stats["advances"].append(advance)
        start, L = L, L + advance * block
        if advance and eos in x[max(start, P):L]:
            break
    out = x[P : P + n]
    return (out[: out.index(eos) + 1] if eos in out else out), stats


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {arch: write_checkpoint(tmp_path_factory.mktemp(arch), arch, seed)
            for arch, seed in (("llada2", 31), ("sdar", 32))}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 8, 1, 11, 3)]


def eos_for(model, ps, block, n, tau) -> int:
    """An EOS id that some rows generate mid-way (so rows stop at different steps), found without stopping."""
    outs = [literal_two_block(model, p, block, n, tau, eos=-1)[0] for p in ps]
    counts = {t: sum(t in o[: n - 3] for o in outs) for o in outs for t in o}
    return max(counts, key=lambda t: (0 < counts[t] < len(outs), -t))


@pytest.mark.parametrize("arch,tau", [("llada2", 0.5), ("sdar", 0.9)])
def test_two_block_engine_equals_literal_alone_and_batched(ckpts, arch, tau):
    block, n = 4, 13
    model = compiledllm.load_model(ckpts[arch])
    ps = prompts(model.config.vocab_size)
    eos = eos_for(model, ps, block, n, tau)
    model = compiledllm.load_model(ckpts[arch], eos_token_id=eos)
    want, advances = [], []
    for p in ps:
        out, st = literal_two_block(model, p, block, n, tau, eos)
        if st["margin"] < NEAR_TIE:
            pytest.skip(f"numerical near-tie (margin {st['margin']:.1e})")
        want.append(out)
        advances += st["advances"]
    assert 2 in advances and 0 in advances, advances  # the grid retires two blocks at once somewhere
    pol = {"name": "two_block", "block_size": block, "threshold": tau}
    run = lambda bs, ps: Engine(model, EngineConfig(pol, max_new_tokens=n, batch_size=bs, max_seq_len=40)).generate(ps)  # noqa: E731
    alone = [run(1, [p])[0] for p in ps]
    batched = run(3, ps)
    assert [r.output_ids for r in alone] == want
    assert [r.output_ids for r in batched] == want
    assert len({len(w) for w in want}) > 1, "rows should stop at different lengths"


def test_two_block_host_hook_sees_every_block_a_row_begins(ckpts):
    model, block = compiledllm.load_model(ckpts["llada2"], eos_token_id=0), 4
    pol = {"name": "two_block", "block_size": block, "threshold": 0.5}
    engine = Engine(model, EngineConfig(pol, max_new_tokens=17, batch_size=1))
    p = prompts(model.config.vocab_size)[1]
    res = engine.generate([p])[0]
    starts = [s for slot, s in engine.policy.begun]
    assert starts[0] == len(p) // block * block and all(s % block == 0 for s in starts)
    jumps = {b - a for a, b in zip(starts, starts[1:])}
    assert jumps <= {block, 2 * block}
    # the last step retired the last window's one or two blocks, with no block begun after it
    assert (starts[-1] - starts[0]) // block + 1 <= res.blocks <= (starts[-1] - starts[0]) // block + 2


def test_two_block_compiled_equals_eager(ckpts, compile_kw):
    model = compiledllm.load_model(ckpts["sdar"], eos_token_id=0)
    ps = prompts(model.config.vocab_size)[:4]
    # blocks of 2: 4-token forwards, as the 4-token compiled sdar t2t of test_decoding.py (most kernels shared)
    pol = {"name": "two_block", "block_size": 2, "threshold": 0.5}
    kw = dict(max_new_tokens=9, **compile_kw)
    eager = Engine(model, EngineConfig(pol, **kw)).generate(ps)
    compiled = Engine(model, EngineConfig(pol, compile=True, **kw)).generate(ps)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
