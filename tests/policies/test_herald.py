"""`herald` (compiledllm/policies/herald.py): HERALD's algorithm — the next block's selection prepared during the
current block by a representative query over the prefix with the block's draft in place (or after the block, without
lookahead), the exact block appended at the boundary, MAGE's selection where nothing was prepared.

Its tokens are those of a literal float64 loop written from the description (literal_selection.py), for each
lookahead and query form; budget 1.0 gives dense `threshold`'s tokens and forward counts (the draft never changes a
token); batched == alone with admissions and compaction; compiled == eager; captured == eager on a GPU."""
from __future__ import annotations

import literal_selection
import pytest
import selection_cases
import torch
from checkpoints import write_checkpoint
from selection_cases import BLOCK, DENSE, ckpt, model, prompts  # noqa: F401  (fixtures)
from selection_cases import run as run_cases

from compiledllm.errors import UserError


def run(model, policy, batch, ps, new=16, **kw):
    return run_cases(model, policy, batch, ps, new, **kw)


FORMS = [{"lookahead": "draft", "query": "center"}, {"lookahead": "draft", "query": "block"},
         {"lookahead": "none", "query": "center"}, {"lookahead": "draft", "query": "center", "retrieval": "scan"}]
INT8_SCAN = {"lookahead": "draft", "query": "center", "retrieval": "scan", "scan_keys": "int8"}
HOST = {"retrieval": "scan", "pool": "host"}  # the system form: full KV in a host pool, the scan on the CPU
FIXED = {"threshold": 1.0, "steps": 2}  # two steps a block: every block has its draft step (no unprepared block)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f['lookahead']}-{f['query']}-{f.get('retrieval', 'forward')}")
def test_herald_equals_a_literal_loop(ckpt, model, form):
    ps = prompts(model.config.vocab_size)
    policy = DENSE | {"name": "herald", "budget": 0.3} | form
    got = run(model, policy, 3, ps)
    for p, r in zip(ps, got):
        want = literal_selection.literal(ckpt, p, block=BLOCK, threshold=DENSE["threshold"], new=16, budget=0.3,
                                         policy="herald", **form)
        assert r.output_ids == want, p
    mage = run(model, DENSE | {"name": "mage", "budget": 0.3}, 3, ps)
    assert [r.output_ids for r in got] != [r.output_ids for r in mage], "the prepared selections changed nothing"


@pytest.mark.parametrize("form", FORMS + [INT8_SCAN], ids=lambda f: "-".join(map(str, f.values())))
def test_whole_budget_is_dense_threshold(model, form):
    ps = prompts(model.config.vocab_size)
    dense = [(r.output_ids, r.steps) for r in run(model, DENSE, 3, ps)]
    for batch in (1, 3):
        got = run(model, DENSE | {"name": "herald", "budget": 1.0} | form, batch, ps)
        assert [(r.output_ids, r.steps) for r in got] == dense


DEVICE_KEYS = HOST | {"keys": "device"}  # variant 5c: keys on the device (scanned there), values in the host pool
FETCH = {"pool": "host", "lookahead": "none", "retrieval": "fetch"}  # MAGE-Offload (b): the prefix fetched per block
HOST_FORMS = [HOST | {"scratch": 1}, HOST | {"scratch": 4}, {"pool": "host", "scratch": 2},
              {"pool": "host", "query": "block"}, {"pool": "host", "lookahead": "none"}, DEVICE_KEYS | {"scratch": 2},
              FETCH | {"scratch": 1}, FETCH | {"scratch": 2}]


@pytest.mark.parametrize("form", HOST_FORMS, ids=["scan-1", "scan-4", "forward-2", "forward-block", "none",
                                                  "device-keys", "fetch-1", "fetch-2"])
def test_host_pool_whole_budget_is_dense_threshold(model, form):
    """The scan and the retrieval forward (layer by layer, attention on the CPU) over the host pool, whatever number
    of scratch caches (1: requests wait for one to prefill), batched or alone."""
    ps = prompts(model.config.vocab_size)
    dense = [(r.output_ids, r.steps) for r in run(model, DENSE, 3, ps)]
    for batch in (1, 3):
        got = run(model, DENSE | {"name": "herald", "budget": 1.0} | form, batch, ps)
        assert [(r.output_ids, r.steps) for r in got] == dense


@pytest.mark.parametrize("scratch", [1, 2, 4])
def test_fetching_the_prefix_per_block_is_mage(model, scratch):
    """MAGE-Offload's second form: each block's prefix fetched from the host pool into a scratch cache (rows waiting
    for one) and MAGE's selection made there: MAGE's tokens, batched (with waits) and alone."""
    ps = prompts(model.config.vocab_size)
    mage = [r.output_ids for r in run(model, DENSE | {"name": "mage", "budget": 0.3}, 3, ps)]
    policy = DENSE | {"name": "herald", "budget": 0.3, "scratch": scratch} | FETCH
    assert [r.output_ids for r in run(model, policy, 3, ps)] == mage
    assert [run(model, policy, 1, [p])[0].output_ids for p in ps] == mage


@pytest.mark.parametrize("form", HOST_FORMS[2:5], ids=["forward", "forward-block", "none"])
def test_host_pool_forward_batched_equals_alone(model, form):
    """The retrieval forward's CPU attention ranks by the pool's keys (the query's own key is not in the pool, so its
    choices may differ from the device form's); batched == alone, and not MAGE's selections."""
    ps = prompts(model.config.vocab_size)
    policy = DENSE | {"name": "herald", "budget": 0.3} | form
    batched = [r.output_ids for r in run(model, policy, 3, ps)]
    assert batched == [run(model, policy, 1, [p])[0].output_ids for p in ps]
    assert batched != [r.output_ids for r in run(model, DENSE | {"name": "mage", "budget": 0.3}, 3, ps)]


@pytest.mark.parametrize("form", [HOST, DEVICE_KEYS], ids=["cpu-scan", "device-keys"])
def test_host_pool_selects_what_the_device_scan_selects(model, form):
    """With every block drafted, the CPU scan over the host pool (float32: the torch form of the fused kernel's math),
    or the device scan of the keys kept on the device with the values from the host pool, makes the device form's
    selections: the same tokens, batched == alone; and not MAGE's."""
    ps = prompts(model.config.vocab_size)
    herald = DENSE | FIXED | {"name": "herald", "budget": 0.3, "retrieval": "scan"}
    device = [r.output_ids for r in run(model, herald, 3, ps)]
    host = [r.output_ids for r in run(model, herald | form | {"scratch": 2}, 3, ps)]
    assert host == device
    assert host == [run(model, herald | form, 1, [p])[0].output_ids for p in ps]
    assert host != [r.output_ids for r in run(model, DENSE | FIXED | {"name": "mage", "budget": 0.3}, 3, ps)]


@pytest.mark.parametrize("form", [HOST, HOST | {"host_threads": 1}, {"pool": "host"}, DEVICE_KEYS],
                         ids=["scan", "scan-one-thread", "forward", "device-keys"])
def test_host_pool_through_the_fused_kernel_in_bf16(tmp_path, form):
    """bf16 pools go through ext/ (the scan with a k and a rank length per request, the forward's fused attention +
    top-k, the values' gather), on any number of host threads: the whole budget == dense threshold."""
    from compiledllm.kv import cpu_select

    if not cpu_select.extension_available():
        pytest.skip("compiledllm._cpu_select is not built")
    import compiledllm

    m = compiledllm.load_model(write_checkpoint(tmp_path / "m", "llada2", 31, head_dim=32, num_hidden_layers=4),
                               dtype=torch.bfloat16)
    ps = prompts(m.config.vocab_size)
    dense = [(r.output_ids, r.steps) for r in run(m, DENSE, 3, ps)]
    got = run(m, DENSE | {"name": "herald", "budget": 1.0, "scratch": 2} | form, 3, ps)
    assert [(r.output_ids, r.steps) for r in got] == dense


@pytest.mark.parametrize("form", [{}, INT8_SCAN], ids=["forward", "int8-scan"])
def test_batched_equals_alone(model, form):
    ps = prompts(model.config.vocab_size)
    policy = DENSE | {"name": "herald", "budget": 0.3} | form
    batched = [r.output_ids for r in run(model, policy, 2, ps)]
    assert batched == [run(model, policy, 1, [p])[0].output_ids for p in ps]


def test_int8_copy_rounds_each_channel_to_its_own_step():
    from compiledllm.policies.herald import int8_copy

    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 6, 2, 4, generator=g) * torch.tensor([1.0, 10.0, 0.01, 3.0])
    valid = (torch.arange(6) < torch.tensor([[4], [6]]))[..., None, None]
    got = int8_copy(k, valid).double()
    kd = k.double()
    for b, n in enumerate((4, 6)):
        step = kd[b, :n].abs().amax(0) / 127  # [KVH, D]
        want = torch.round(kd[b] / step).clamp(-127, 127) * step
        torch.testing.assert_close(got[b], want, atol=1e-6, rtol=1e-6)
        assert (got[b, :n] - kd[b, :n]).abs().le(step / 2 + 1e-6).all()  # within half a step where the scale holds


@pytest.mark.parametrize("params,message", [
    ({"scan_keys": "int8"}, "scan_keys: int8 keys are for retrieval: scan"),
    ({"query": "middle"}, "query"),
    ({"lookahead": "later"}, "lookahead"),
    ({"budget": 0.0}, r"budget: must be within \(0, 1\]"),
    ({"retrieval": "scan", "lookahead": "none"}, "retrieval: scan takes the centre query from the draft step"),
    ({"pool": "host", "retrieval": "scan", "scan_keys": "int8"}, "pool: host scans the host pool.s keys as they are"),
    ({"pool": "host", "retrieval": "scan", "scratch": 0}, "scratch: must be >= 1"),
    ({"pool": "host", "keys": "device"}, "keys: device keeps the keys of a host pool on the device"),
    ({"draft_wait": -1}, "draft_wait: must be >= 0"),
    ({"pool": "host", "host_threads": -1}, "host_threads: must be >= 0"),
    ({"pool": "host", "retrieval": "fetch"}, "retrieval: fetch copies each block's prefix"),
    ({"lookahead": "none", "draft_wait": 2}, "draft_wait: delays the draft step"),
])
def test_bad_settings_are_one_line_errors(params, message):
    from compiledllm.policies import policy_config

    with pytest.raises(UserError, match=message):
        policy_config({"name": "herald"} | params)


@pytest.mark.slow
@pytest.mark.parametrize("form", [{}, HOST | {"scratch": 2}], ids=["device", "host-scan"])
def test_compiled_equals_eager(model, compile_kw, form):
    """torch.compile'd steps == eager, the device pool and the host pool (its folded draft steps, the compacted
    select in the select step's hook)."""
    selection_cases.compiled_equals_eager(model, DENSE | {"name": "herald", "budget": 0.3} | form, compile_kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("budget", [1.0, 0.3])
@pytest.mark.parametrize("form", [{}, HOST, {"pool": "host"}, DEVICE_KEYS, FETCH | {"scratch": 2}],
                         ids=["device", "host-scan", "host-forward", "device-keys", "fetch"])
def test_captured_equals_eager_on_the_gpu(tmp_path, budget, form):
    """The main steps replayed as CUDA graphs (the draft phase, the stats in the Triton kernel) with the host hooks'
    retrieval and swaps between them == eager (bf16); with the whole budget (float32) == dense threshold. The host
    pool: pinned, its prefix copies on the side stream, the scan on the CPU."""
    selection_cases.captured_equals_eager(tmp_path, DENSE | {"name": "herald", "budget": budget} | form)


def test_selection_recall_tool_counts_every_method(tmp_path, monkeypatch, capsys):
    """tools/bench/selection_recall.py: at budget 1.0 every selection holds the whole prefix (recall 1 exactly); at
    a partial budget the recalls are shares in (0, 1], counted for every method."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
    import selection_recall

    ckpt = write_checkpoint(tmp_path / "m", "llada2", 33, num_hidden_layers=4)
    task = tmp_path / "t.jsonl"
    ps = prompts(96, [70, 90])
    task.write_text("".join(json.dumps({"prompt_ids": p, "reference_ids": [5]}) + "\n" for p in ps))
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["x", "--model", str(ckpt), "--task", str(task), "--new", "96", "--batch", "2",
                                      "--budgets", "0.1,1.0", "--out", str(out)])
    selection_recall.main()
    report = json.loads(out.read_text())
    assert set(report["recall"]) == set(selection_recall.METHODS)
    for method, recall in report["recall"].items():
        assert report["samples"][method] > 0, method
        assert recall["1.0"] == 1.0, method
        assert 0.0 < recall["0.1"] <= 1.0, method
    assert "recall vs the per-step oracle" in capsys.readouterr().out


def test_host_pool_without_lookahead_gives_its_scratch_back_at_the_first_boundary(model):
    """Without lookahead a row's selection is made at its first boundary, and its scratch cache goes back then: one
    scratch cache serves three requests at once, not one after another (decode steps well under three alone runs)."""
    from compiledllm.engine import Engine, EngineConfig

    ps = prompts(model.config.vocab_size)[:3]
    policy = DENSE | {"name": "herald", "budget": 0.3, "pool": "host", "lookahead": "none", "scratch": 1}

    def steps(batch, requests):
        engine = Engine(model, EngineConfig(policy, max_new_tokens=24, batch_size=batch, max_seq_len=48,
                                            prefill_chunk=8, ignore_eos=True))
        engine.generate(requests)
        return engine.stats.decode_steps

    alone = [steps(1, [p]) for p in ps]
    assert steps(3, ps) < 2 * max(alone), alone


@pytest.mark.parametrize("form", [{}, HOST | {"scratch": 2}, DEVICE_KEYS | {"scratch": 2}],
                         ids=["device", "host-scan", "device-keys"])
def test_a_later_draft_step_prepares_the_same_selections(model, form):
    """The draft step may wait (draft_wait) so that rows out of step draft in one forward: the draft group sees neither
    the block group nor the step, so every selection, and so every token, is the one the step-1 draft prepares
    (prompts of whole blocks and a token a step: no block ends before its draft step), in fewer draft forwards when
    requests are admitted at different steps."""
    from compiledllm.engine import Engine, EngineConfig

    ps = prompts(model.config.vocab_size, [4, 8, 12, 16, 8])
    herald = DENSE | {"name": "herald", "budget": 0.3, "threshold": 1.0, "steps": BLOCK} | form

    def go(policy):
        engine = Engine(model, EngineConfig(policy, max_new_tokens=16, batch_size=3, max_seq_len=32, prefill_chunk=8,
                                            ignore_eos=True))
        return [r.output_ids for r in engine.generate(ps)], engine.stats.policy["draft_forwards"]

    first, drafts = go(herald)
    for wait in (1, 2):
        out, fewer = go(herald | {"draft_wait": wait})
        assert out == first and fewer < drafts


@pytest.mark.parametrize("form", [{}, HOST | {"scratch": 2}, DEVICE_KEYS | {"scratch": 2}],
                         ids=["device", "host-scan", "device-keys"])
def test_folded_draft_steps_give_the_same_tokens_in_fewer_forwards(model, form, monkeypatch):
    """draft_fold: a step whose drafting rows are not all its rows runs one draft forward for every row (the others'
    draft group dead) instead of a draft forward and a decode forward: the same tokens and selections as the two
    forwards (requests admitted at different steps, so rows draft out of step), with budget 1.0 dense threshold's,
    in fewer forwards."""
    from compiledllm.engine import Engine, EngineConfig
    from compiledllm.engine.stepper import Stepper

    ps = prompts(model.config.vocab_size, [4, 8, 12, 16, 8])
    calls = []
    real = Stepper._call
    monkeypatch.setattr(Stepper, "_call", lambda self, ph, b: calls.append(ph) or real(self, ph, b))

    def go(policy):
        calls.clear()
        engine = Engine(model, EngineConfig(policy, max_new_tokens=16, batch_size=3, max_seq_len=32, prefill_chunk=8,
                                            ignore_eos=True))
        return [r.output_ids for r in engine.generate(ps)], len(calls), engine.stats.policy["draft_forwards"]

    for budget in (0.3, 1.0):
        herald = DENSE | {"name": "herald", "budget": budget} | form
        two, forwards, drafts = go(herald | {"draft_fold": False})
        one, fewer, same = go(herald)
        assert one == two and same == drafts > 0
        assert fewer < forwards, (fewer, forwards)
    assert one == [r.output_ids for r in run(model, DENSE, 3, ps)]


@pytest.mark.parametrize("form", [HOST, {"pool": "host"}, DEVICE_KEYS], ids=["scan", "forward", "device-keys"])
def test_a_row_moved_down_keeps_its_host_pool_row(model, form):
    """Rows 0 and 1 finish first; row 2 moves down to slot 0 (a swap of host-pool rows, not a copy) and goes on
    retrieving for several blocks from the row it wrote: its tokens are those of the request alone."""
    from compiledllm.engine import Engine, EngineConfig
    from compiledllm.engine.request import RequestParams
    from compiledllm.kv import offload

    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(2, model.config.vocab_size - 2, (n,), generator=g).tolist() for n in (6, 9, 5)]
    params = [RequestParams(max_new_tokens=n) for n in (4, 4, 40)]
    policy = DENSE | FIXED | {"name": "herald", "budget": 0.3, "scratch": 2} | form

    def go(batch, ps, params):
        cfg = EngineConfig(policy, max_new_tokens=40, batch_size=batch, max_seq_len=64, prefill_chunk=8,
                           ignore_eos=True)
        return [r.output_ids for r in Engine(model, cfg).generate(ps, params=params)]

    moves, real = [], offload.OffloadKV.move
    offload.OffloadKV.move = lambda self, *a: moves.append(a) or real(self, *a)
    try:
        batched = go(3, ps, params)
    finally:
        offload.OffloadKV.move = real
    assert (2, 0) in [m[:2] for m in moves]
    assert batched[2] == go(1, ps[2:], params[2:])[0]


def test_host_pool_reports_where_the_engine_threads_host_time_goes(model):
    """bench's policy_stats for the host pool: draft forwards, scans, their CPU seconds and the stall, the boundary and
    draft hooks' seconds, and the seconds in each of the store's host-side methods."""
    from compiledllm.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(DENSE | {"name": "herald", "budget": 0.3} | HOST, max_new_tokens=16,
                                        batch_size=3, max_seq_len=32, prefill_chunk=8, ignore_eos=True))
    engine.generate(prompts(model.config.vocab_size))
    stats = engine.stats.policy
    assert stats["draft_forwards"] > 0 and stats["scans"] > 0 and stats["boundary_hooks_s"] > 0
    assert {"offload_prefix", "offload_block", "place", "swap", "release"} <= set(stats["store_s"])
    assert all(t > 0 for t in stats["store_s"].values())
    assert set(stats["scan_split_s"]) == {"device", "ready", "select", "gather"}
    assert stats["scan_split_s"]["select"] > 0 and sum(stats["scan_split_s"].values()) <= stats["scan_s"]
