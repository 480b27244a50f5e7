"""Long prompts: the prefill runs in chunks of whole blocks and must equal the no-cache decoder."""
from __future__ import annotations

import torch
from checkpoints import write_checkpoint
from oracle import literal_decode

import compiledllm
from compiledllm.engine import generate


def test_chunked_prefill_matches_literal_decode(tmp_path):
    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "sdar", 4, max_position_embeddings=4096))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, model.config.vocab_size, (1, 1100), generator=g)[0].tolist()
    policy = {"name": "threshold", "block_size": 8, "threshold": 0.5}
    out = generate(model, [prompt], policy, max_new_tokens=10)[0].output_ids  # 1096 prefilled: two chunks
    ref = literal_decode(lambda ids, bs: model.reference_forward(ids, bs), prompt, policy="threshold", block_size=8,
                         max_new_tokens=10, mask_id=model.mask_token_id, eos_id=model.eos_token_id, threshold=0.5)
    assert out == ref


# -- batched, chunked prefill and its schedule --------------------------------------------------------------------

import pytest  # noqa: E402

from compiledllm.engine import Engine, EngineConfig  # noqa: E402
from compiledllm.engine.prefill import chunk_buckets, split_rows  # noqa: E402
from compiledllm.errors import UserError  # noqa: E402

POLICY = {"name": "threshold", "block_size": 8, "threshold": 0.5}


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("m"), "sdar", 5, max_position_embeddings=1024)
    return compiledllm.load_model(ckpt)


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompts, **cfg):
    return [Engine(model, EngineConfig(POLICY, max_new_tokens=12, batch_size=1, **cfg)).generate([p])[0].output_ids
            for p in prompts]


def test_chunk_buckets_and_row_pieces():
    assert chunk_buckets(2048, 32) == [128, 256, 512, 1024, 2048]
    assert chunk_buckets(100, 32) == [96]  # whole blocks, even below MIN_CHUNK
    assert split_rows([0, 1, 2, 3, 4, 6, 7], [1, 2, 4]) == [(0, 4), (4, 1), (6, 2)]
    assert split_rows([5], [1, 2]) == [(5, 1)]


def test_rows_per_prefill_forward_follow_the_chunk_their_prompts_need():
    """rows x the chunk the longest row of a piece needs stays within max_tokens: short prompts go many at once."""
    from compiledllm.engine.prefill import Prefiller, Progress

    pre = Prefiller(None, block=8, chunk=512, max_tokens=1024)  # chunks 128, 256, 512; up to 8 rows of 128
    assert pre.chunks == [128, 256, 512] and pre.row_sizes == [1, 2, 4, 8]
    left = {0: 20, 1: 20, 2: 300, 3: 20, 4: 20, 5: 20, 6: 20, 7: 20, 9: 600}
    progress = {s: Progress(0, n) for s, n in left.items()}
    assert pre.pieces(sorted(left), progress) == [(0, 2), (2, 2), (4, 4), (9, 1)]
    assert pre.pieces([0, 1, 3, 4, 5, 6, 7], progress) == [(0, 2), (3, 4), (7, 1)]
    # the most rows that fit is a row size too: 65 x 128 tokens, just over half of issue 31's 128 x 128 burst
    half = Prefiller(None, block=4, chunk=128, max_tokens=65 * 128)
    assert half.row_sizes == [1, 2, 4, 8, 16, 32, 64, 65]
    burst = {s: Progress(0, 128) for s in range(128)}
    assert half.pieces(range(128), burst)[:2] == [(0, 65), (65, 32)]


def test_short_prompts_share_one_prefill_forward(sdar):
    """8 prompts of 16-31 tokens with 1024 tokens a forward: one forward of 8 rows x 128 (a bound set by the longest
    chunk, 512, made it 4 forwards of 2 rows), the tokens each prompt gives alone."""
    prompts = prompts_of([16, 23, 31, 17, 24, 30, 18, 25], sdar.config.vocab_size, seed=3)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=12, batch_size=8, prefill_chunk=512, prefill_tokens=1024))
    got = [r.output_ids for r in eng.generate(prompts)]
    assert eng.stats.prefill_forwards == 1 and eng.stats.prefill_tokens == sum(len(p) // 8 * 8 for p in prompts)
    assert got == alone(sdar, prompts)


def test_batched_prefill_of_rows_at_different_positions_equals_each_alone(sdar):
    """Chunks of 16 positions (so rows of 3..70-token prompts need 0..4 chunks and pad their last one), up to 64
    tokens per forward (4 rows at a time): every row's tokens equal its decode alone with the default prefill."""
    prompts = prompts_of([70, 3, 41, 17, 64, 33], sdar.config.vocab_size)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=12, batch_size=6, prefill_chunk=16, prefill_tokens=64))
    got = [r.output_ids for r in eng.generate(prompts)]
    assert got == alone(sdar, prompts)
    full = sum(len(p) // 8 * 8 for p in prompts)
    assert eng.stats.prefill_tokens == full and eng.stats.prefill_forwards >= 5


def test_prefill_interleaved_with_decoding_keeps_every_rows_tokens(sdar):
    """Two slots, five requests arriving over time: later requests' prefill (one 16-position chunk per step)
    runs between the decode steps of rows already decoding; each request's tokens equal its decode alone."""
    prompts = prompts_of([60, 12, 50, 70, 9], sdar.config.vocab_size, seed=2)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=12, batch_size=2, prefill_chunk=16, prefill_tokens=16))
    res = eng.generate(prompts, arrivals=[0.0, 0.0, 0.01, 0.02, 0.02])
    assert [r.output_ids for r in res] == alone(sdar, prompts)
    assert [r.index for r in res] == list(range(5))
    for r, a in zip(res, [0.0, 0.0, 0.01, 0.02, 0.02]):
        assert r.arrival_s == a and 0 < r.first_block_s <= r.latency_s
    s = eng.stats
    assert s.decode_steps > 0 and s.prefill_s > 0 and s.generated_tokens == sum(len(r.output_ids) for r in res)
    # the later requests' chunks made decoding rows wait: one forward per step at most, counted as such
    assert 0 < s.stalled_steps <= s.prefill_forwards and 0 < s.stall_max_s <= s.stall_s <= s.prefill_s
    assert 0 < s.prefill_first_s < s.prefill_s  # the first turn: the two requests arriving at 0, not the later ones
    assert 0 < s.sync_s and s.sync_s + s.hooks_s < s.decode_s  # the steps' host syncs: a part of the decode time


def test_the_opening_steps_timeline_splits_the_first_blocks_wait(sdar):
    """RunStats.opening: the session's first 16 steps, each its start on the session clock and its parts (admission,
    prefill, host before the launch, launch, sync's wait, host after), which fit between it and the next step's; a
    first_block turn's prefill shows in the step it ran before, and the first block comes at a step's end."""
    from compiledllm.engine.scheduler import OPENING

    prompts = prompts_of([30, 25, 31, 28], sdar.config.vocab_size, seed=4)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=24, batch_size=4, prefill_chunk=32, prefill_tokens=64,
                                    prefill_priority="first_block", ignore_eos=True))
    res = eng.generate(prompts)
    steps = eng.stats.opening
    assert len(steps) == min(OPENING, eng.stats.decode_steps + sum(s["rows"] == 0 for s in steps))
    parts = ("admit_s", "prefill_s", "before_s", "launch_s", "sync_s", "after_s")
    for a, b in zip(steps, steps[1:]):
        assert a["at"] <= b["at"] and sum(a.get(k, 0.0) for k in parts) <= b["at"] - a["at"] + 1e-3
    assert steps[0]["prefill_s"] > 0 and steps[0]["rows"] == 2  # two prompts a forward, nothing decoding yet
    turns = [s for s in steps[1:] if s["prefill_s"] > 1e-3]
    assert turns and all(s["rows"] == 4 for s in turns)  # the second pair's forward, once the first had a block
    ends = [s["at"] + sum(s.get(k, 0.0) for k in parts) for s in steps]
    first = min(r.first_block_s for r in res)
    assert min(abs(first - e) for e in ends) < 5e-3 and all(s["phases"] for s in steps if s["rows"])


def test_prefill_of_requests_arriving_together_stalls_no_decode_step(sdar):
    """Equal prompts all at once: every row is prefilled (a chunk each per loop) before any decodes."""
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=8, batch_size=3, prefill_chunk=16, prefill_tokens=16))
    eng.generate(prompts_of([40, 40, 40], sdar.config.vocab_size))
    assert eng.stats.prefill_forwards >= 6 and eng.stats.stalled_steps == 0 and eng.stats.stall_s == 0


def test_first_block_priority_prefills_a_piece_once_the_decoding_rows_have_a_block(sdar, monkeypatch):
    """prefill.priority: first_block (issue 31 item 2: the first piece's requests get their first block before the
    rest are prefilled): no prefill forward while a decoding row is still in its first block, one piece at a time;
    the same tokens as the default, which prefills every waiting piece before anything decodes."""
    from compiledllm.engine.session import EngineSession

    prompts = prompts_of([30, 25, 31, 28, 27, 29], sdar.config.vocab_size, seed=4)
    calls = []  # per prefill call: (decoding rows still in their first block, whether every piece runs)
    real = EngineSession._prefill

    def spy(self, prefilling, everyone, events, step):
        waiting = [s for s, o in enumerate(self._owner) if o is not None and o.prefill.left == 0
                   and o.first_block is None and self.st.active[s]]
        calls.append((len(waiting), everyone))
        return real(self, prefilling, everyone, events, step)

    monkeypatch.setattr(EngineSession, "_prefill", spy)
    outs = {}
    for priority in ("throughput", "first_block"):
        calls.clear()
        eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=12, batch_size=6, prefill_chunk=32, prefill_tokens=64,
                                        ignore_eos=True, prefill_priority=priority))
        outs[priority] = [r.output_ids for r in eng.generate(prompts)]
        if priority == "throughput":
            assert calls[0] == (0, True)  # everyone: all three pieces before any decode step
        else:
            assert all(n == 0 and not everyone for n, everyone in calls) and len(calls) == 3  # a piece at a time
    assert outs["first_block"] == outs["throughput"] == alone(sdar, prompts, ignore_eos=True)
    with pytest.raises(UserError, match="prefill.priority: one of throughput, first_block, got 'soon'"):
        EngineConfig(POLICY, max_new_tokens=4, prefill_priority="soon")


def test_ignore_eos_decodes_every_request_to_its_length(sdar):
    prompts = prompts_of([20, 30], sdar.config.vocab_size)
    base = EngineConfig(POLICY, max_new_tokens=12, batch_size=2)
    normal = Engine(sdar, base).generate(prompts)
    forced = Engine(sdar, EngineConfig(POLICY, max_new_tokens=12, batch_size=2, ignore_eos=True)).generate(prompts)
    assert all(len(r.output_ids) == 12 for r in forced)
    for a, b in zip(normal, forced):  # the same tokens up to the EOS that ended the normal decode
        assert b.output_ids[: len(a.output_ids)] == a.output_ids


@pytest.mark.parametrize("arrivals, words", [([0.0], "1 times for 2 prompts"), ([0.0, -1.0], "-1.0"),
                                             ([0.0, float("nan")], "nan"), ([0.0, "soon"], "soon")])
def test_bad_arrivals_are_one_line_errors(sdar, arrivals, words):
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=4))
    with pytest.raises(UserError, match=words):
        eng.generate(prompts_of([5, 6], sdar.config.vocab_size), arrivals=arrivals)


@pytest.mark.parametrize("policy", [
    POLICY,
    {"name": "mage", "block_size": 8, "threshold": 0.5, "budget": 0.3},
    {"name": "herald", "block_size": 8, "threshold": 0.5, "budget": 0.3, "pool": "host", "retrieval": "scan",
     "scratch": 2},
], ids=["device-kv", "sparse-kv", "host-pool"])
def test_prefill_warm_up_at_start_up_changes_no_token(tmp_path, monkeypatch, policy):
    """On CUDA a session runs prefill's chunk shapes once at start-up, writing nothing (so a cold Triton cache costs
    the start-up, not the first request); forced on the CPU here, every store's tokens stay those of a run without
    it, and the warm-up's forwards ran (start-up time counted)."""
    import compiledllm.engine.prefill as prefill
    import compiledllm.engine.session as session

    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "llada2", 6, num_hidden_layers=4))
    ps = prompts_of([5, 140, 33, 290], model.config.vocab_size)
    cfg = EngineConfig(policy, max_new_tokens=16, batch_size=2, max_seq_len=320, prefill_chunk=256,
                       prefill_tokens=512, ignore_eos=True)
    plain = Engine(model, cfg)
    want = [r.output_ids for r in plain.generate(ps)]
    calls = []
    real = session.Prefiller.warm_up
    monkeypatch.setattr(prefill, "warms_prefill", lambda device: True)
    monkeypatch.setattr(session.Prefiller, "warm_up",
                        lambda self, st, kv, progress=None: calls.append(1) or real(self, st, kv, progress))
    warmed = Engine(model, cfg)
    assert [r.output_ids for r in warmed.generate(ps)] == want
    assert calls and warmed.startup_s > 0 == plain.startup_s


@pytest.mark.parametrize("policy", [
    {"name": "fast_dllm_cache", "block_size": 8, "threshold": 0.5, "dual": True},
    {"name": "flash_dllm", "block_size": 8, "threshold": 0.5},
], ids=["dual-cache", "flash-dllm"])
def test_no_prefill_warm_up_for_a_policy_that_never_prefills(tmp_path, monkeypatch, policy):
    """A policy whose first forward writes every position (prefills False: its KV is a pooled layout the prefill
    forward cannot address) runs no warm-up forward, so its session starts (on CUDA the forced warm-up raised a shape
    error at start-up), and its tokens are those of a session without the warm-up."""
    import compiledllm.engine.prefill as prefill
    import compiledllm.engine.session as session

    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "llada", 6))
    ps = prompts_of([5, 40, 33], model.config.vocab_size)
    cfg = EngineConfig(policy, max_new_tokens=16, batch_size=2, max_seq_len=128, ignore_eos=True)
    want = [r.output_ids for r in Engine(model, cfg).generate(ps)]
    calls = []
    monkeypatch.setattr(prefill, "warms_prefill", lambda device: True)
    monkeypatch.setattr(session.Prefiller, "warm_up", lambda self, st, kv, progress=None: calls.append(1))
    assert [r.output_ids for r in Engine(model, cfg).generate(ps)] == want
    assert calls == []


def test_prefill_warm_up_writes_only_the_spare_rows(sdar, monkeypatch):
    """Prefiller.warm_up's forwards write every K/V to the slots' spare row (capacity) and change no slot state
    (its kernel forwards forced on the CPU)."""
    import compiledllm.engine.prefill as prefill

    monkeypatch.setattr(prefill, "warms_prefill", lambda device: True)
    session = Engine(sdar, EngineConfig(POLICY, max_new_tokens=8, batch_size=4, max_seq_len=600, prefill_chunk=512,
                                        prefill_tokens=1024)).session()
    kv, st = session.kv, session.st
    kv.k_full.normal_()
    kv.v_full.normal_()
    before = [t.clone() for t in (kv.k_full, kv.v_full, st.seq, st.block_start)]
    session.prefiller.warm_up(st, kv)
    for was, now in zip(before, (kv.k_full, kv.v_full, st.seq, st.block_start)):
        if now.dim() == 5:  # [slots, layers, capacity + 1, KVH, D]: all but the spare row kept
            assert torch.equal(was[:, :, :-1], now[:, :, :-1]) and not torch.equal(was[:, :, -1], now[:, :, -1])
        else:
            assert torch.equal(was, now)


def test_compiled_prefill_equals_eager_and_compiles_only_at_start_up(tmp_path, monkeypatch):
    """prefill.compile: the full forward of each chunk size (Prefiller.compiled_shapes) runs through compiled regions
    (static shapes) and writes the eager forwards' KV, with the same tokens; the start-up's warm-up compiles each
    of those shapes once per layer kind, and no request's prefill compiles again (other shapes run eagerly; the
    same shape at other slots reuses its graph). Forced here for forwards of every size (on CUDA: >=
    COMPILE_MIN_TOKENS tokens)."""
    from torch._dynamo.utils import counters

    import compiledllm.engine.prefill as prefill

    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "llada2", 6, num_hidden_layers=3))
    kinds = len({type(layer.mlp) for layer in model.layers})
    ps = prompts_of([140, 290, 33, 270], model.config.vocab_size)
    lens = [len(p) // 8 * 8 for p in ps]  # the prompts' full blocks: what prefill writes
    cfg = dict(max_new_tokens=16, batch_size=4, max_seq_len=320, prefill_chunk=256, prefill_tokens=512,
               ignore_eos=True, compile=False)
    runs, real = {}, prefill.Prefiller._forward
    monkeypatch.setattr(prefill, "COMPILE_MIN_TOKENS", 0)
    for compiled in (False, True):
        used = []
        monkeypatch.setattr(prefill.Prefiller, "_forward", lambda self, st, kv, first, rows, *a, write=True, **k:
                            (write and used.append((first, rows, a[-1]))) or real(self, st, kv, first, rows, *a,
                                                                                    write=write, **k))
        torch._dynamo.reset()
        counters.clear()
        session = Engine(model, EngineConfig(POLICY, prefill_compile=compiled, **cfg)).session(4, 320)
        shapes = session.prefiller.compiled_shapes
        at_start = counters["stats"]["unique_graphs"]
        for i, p in enumerate(ps):
            session.add(i, p)
        for _ in range(20):
            session.step()
            if session.stats().prefill_tokens == sum(lens):
                break
        kv = [t[:, :, :288].clone() for t in (session.kv.k_full, session.kv.v_full)]
        runs[compiled] = kv, Engine(model, EngineConfig(POLICY, prefill_compile=compiled, **cfg)).generate(ps)
        if compiled:
            assert shapes == {(4, 128), (2, 256)} and at_start == kinds * len(shapes)
            ran = {(r, c) for _, r, c in used}
            assert ran & shapes and ran - shapes  # some forwards compiled, others eager
            assert len({f for f, r, c in used if (r, c) in shapes}) > 1  # a compiled shape at more than one slot
            assert counters["stats"]["unique_graphs"] == at_start  # nothing compiled after the start-up
        else:
            assert not shapes and counters["stats"]["unique_graphs"] == 0
    (kv_e, out_e), (kv_c, out_c) = runs[False], runs[True]
    for t_e, t_c in zip(kv_e, kv_c):
        for slot, n in enumerate(lens):  # slots were filled in order: the prompt's full blocks are its prefill
            torch.testing.assert_close(t_c[slot, :, :n], t_e[slot, :, :n], rtol=1e-4, atol=1e-5)
    assert [r.output_ids for r in out_c] == [r.output_ids for r in out_e]


def test_prefill_compile_follows_compile_unless_set(sdar):
    """prefill.compile: auto compiles prefill where the decode step compiles, on CUDA only (the CPU's prefill stays
    as it was: not measured better), true / false override; anything else is a one-line error naming the key."""
    def resolved(**kw):
        return Engine(sdar, EngineConfig(POLICY, max_new_tokens=4, **kw)).prefill_compile

    assert resolved() is False and resolved(compile=True) is False  # the CPU: auto compiles no prefill
    assert resolved(compile=True, prefill_compile=False) is False and resolved(prefill_compile=True) is True
    with pytest.raises(UserError, match="prefill.compile"):
        EngineConfig(POLICY, max_new_tokens=4, prefill_compile="yes")


def test_compile_small_adds_the_small_forwards_shapes(sdar):
    """prefill.compile_small: besides each chunk's full forward (from COMPILE_MIN_TOKENS tokens), every row count of
    the smallest chunk and one row of every chunk compile: the forwards of short prompts, of a first_block burst's
    later pieces and of a request arriving alone, each eagerly ~7K ops of host work whatever its rows. Off by
    default, nothing without prefill.compile; anything but true / false is a one-line error naming the key."""
    from compiledllm.engine.prefill import Prefiller

    def shapes(**kw):
        return Prefiller(sdar, 4, 4096, 16384, slots=128, **kw).compiled_shapes

    full = {(128, 128), (64, 256), (32, 512), (16, 1024), (8, 2048), (4, 4096)}
    assert shapes(compiled=True) == full
    assert shapes(compiled=True, compile_small=True) - full == ({(r, 128) for r in (1, 2, 4, 8, 16, 32, 64)}
                                                                 | {(1, c) for c in (256, 512, 1024, 2048, 4096)})
    assert not shapes(compile_small=True)
    assert EngineConfig(POLICY, max_new_tokens=4).prefill_compile_small is False
    with pytest.raises(UserError, match="prefill_compile_small"):
        EngineConfig(POLICY, max_new_tokens=4, prefill_compile_small="yes")


@pytest.mark.parametrize("policy", [{"name": "mage", "budget": 0.3},
                                    {"name": "herald", "budget": 0.3, "retrieval": "scan", "pool": "host",
                                     "scratch": 4}],
                         ids=["sparse-store", "host-pool-store"])
def test_compiled_prefill_through_the_selection_stores(tmp_path, monkeypatch, policy):
    """prefill.compile: true compiles prefill through the selection policies' stores too (MAGE's sparse store; HERALD's
    host pool, whose rows prefill into lent scratch caches): the same tokens as their eager prefill, compiled forwards
    run, and every graph is built at start-up. auto (as resolved on CUDA) leaves these stores' prefill eager: only the
    plain cache's compiled prefill is measured."""
    from torch._dynamo.utils import counters

    import compiledllm.engine.prefill as prefill

    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "llada2", 32, num_hidden_layers=3))
    ps = prompts_of([30, 50, 45, 20], model.config.vocab_size)
    monkeypatch.setattr(prefill, "COMPILE_MIN_TOKENS", 0)  # forced for forwards of every size (on CUDA: >= 4,096)
    ran = []
    real = prefill.Prefiller._forward
    monkeypatch.setattr(prefill.Prefiller, "_forward", lambda self, st, kv, first, rows, *a, write=True, **k:
                        (write and ran.append((rows, a[-1]) in self.compiled_shapes))
                        or real(self, st, kv, first, rows, *a, write=write, **k))
    outs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        ran.clear()
        cfg = EngineConfig({"name": "threshold", "block_size": 4, "threshold": 0.5} | policy, max_new_tokens=12,
                           batch_size=4, max_seq_len=80, prefill_chunk=16, prefill_tokens=64, ignore_eos=True,
                           prefill_compile=compiled)
        engine = Engine(model, cfg)
        shapes = engine.session(4, 80).prefiller.compiled_shapes
        at_start = counters["stats"]["unique_graphs"]
        outs[compiled] = [r.output_ids for r in engine.generate(ps)]
        if compiled:
            assert shapes and at_start > 0 and any(ran)  # compiled forwards ran
            assert counters["stats"]["unique_graphs"] == at_start  # nothing compiled after the start-up
        else:
            assert not shapes and not any(ran)
    assert outs[True] == outs[False]
    auto = Engine(model, EngineConfig(policy | {"block_size": 4}, max_new_tokens=4, prefill_compile="auto"))
    auto.prefill_compile = True  # as `auto` resolves on CUDA
    assert not auto.session(4, 80).prefiller.compiled_shapes
