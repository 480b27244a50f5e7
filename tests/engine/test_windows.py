"""Narrowed phases (policies/windows.py): a bidirectional model's step spans the narrowest captured width that holds
the working sequences of the rows it runs on, not the session's whole KV capacity. In a server-shaped session sized
for long requests each request gets the tokens it gets alone at its own tight capacity, for the plain decoders
(`threshold`, `t2t`) and for the caches that keep a bidirectional model's KV (`flash_dllm` with and without
Flash-Verify, `elastic_cache`, Fast-dLLM's prefix and dual caches), through widths a quarter or an eighth of that
capacity; a schedule that runs a width too narrow changes them."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from serve_loop import serve

import compiledllm
from compiledllm.attention.spec import AttentionSpec, Bidirectional
from compiledllm.engine import Engine, EngineConfig, RequestParams
from compiledllm.engine import session as session_module
from compiledllm.engine.hooks import PhaseRun
from compiledllm.export.runtime import ExportedModel, StaticShapes
from compiledllm.policies import register_policy
from compiledllm.policies.plan import Forward
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy
from compiledllm.policies.windows import expand, fit, named, narrow, split, widths

BLOCK, CAPACITY = 4, 128


class RecordedConfig(ThresholdConfig):
    pass  # its own config class: make_policy finds a policy by its config's class


class RecordedPolicy(ThresholdPolicy):
    """threshold, recording per step the width its forward spanned and the longest working sequence of its decoding
    rows (read from the slot state itself, before the step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[int, int]] = []
        self.longest = 0

    def before_step(self, host, step):
        self.longest = int(host.st.work_len[list(step.rows)].max())

    def plan(self, phase, st):
        fwd = super().plan(phase, st)
        self.steps.append((fwd.tokens.shape[1], self.longest))
        return fwd


class NarrowestConfig(ThresholdConfig):
    pass


class NarrowestPolicy(ThresholdPolicy):
    """A careless schedule: always the narrowest width, whatever the rows need (negative control)."""

    def schedule(self, step):
        return (named("decode", widths(step.capacity, self.block_size)[-1], step.capacity),)


register_policy("threshold_windows_recorded", RecordedConfig, RecordedPolicy)
register_policy("threshold_windows_narrowest", NarrowestConfig, NarrowestPolicy)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "llada", 6), dtype=torch.float32)


def policy(name="threshold_windows_recorded"):
    return {"name": name, "block_size": BLOCK, "threshold": 0.5}


def test_widths():
    assert widths(128, 4) == (128, 64, 32, 16)
    assert widths(40, 8) == (40, 24, 16, 8)  # whole blocks
    assert widths(16, 8) == (16, 8)  # equal widths once
    assert fit(128, 4, 17) == 32 and fit(128, 4, 16) == 16 and fit(128, 4, 65) == 128 and fit(128, 4, 128) == 128
    assert named("decode", 128, 128) == "decode" and named("refresh", 32, 128) == "refresh@32"
    assert split("refresh@32") == ("refresh", 32) and split("decode") == ("decode", None)
    assert expand(("refresh", "decode"), ("refresh",), 128, 4, 40) == ("refresh", "refresh@64", "decode")
    assert expand(("decode",), ("decode",), 128, 4, 4) == ("decode", "decode@64", "decode@32", "decode@16")
    assert expand(("decode",), ("decode",), 128, 4, 128) == ("decode",)  # run_step's: the whole capacity


def test_each_phase_narrows_to_the_rows_it_runs_on():
    """A PhaseRun's width is its own rows' need, a plain phase the step's rows'; other phases keep their names."""
    state: dict = {}
    lengths = {0: 20, 1: 72, 2: 12}
    out = narrow([PhaseRun("refresh", (2,)), "decode", "verify"], ("refresh", "decode"), 128, 4, (0, 1, 2),
                 lengths, state)
    assert out == [PhaseRun("refresh@16", (2,)), "decode", "verify"]
    out = narrow([PhaseRun("refresh", ()), "decode"], ("refresh", "decode"), 128, 4, (0, 2), lengths, state)
    assert out == [PhaseRun("refresh", ()), "decode@32"]  # an empty run does not run: nothing counted
    assert state["widths"] == {16: 1, 128: 1, 32: 1}


def prompts_of(lengths, vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


ARRIVALS = [(0, 5, 7), (0, 2, 9), (3, 9, 20), (6, 3, 5), (6, 30, 40)]  # (step, prompt length, max_new_tokens)


def served_and_alone(llada, pol: dict, seed: int = 3, capacity: int = CAPACITY):
    """(session, [results served], [tokens alone]): ARRIVALS through a 2-slot session of `capacity` positions, and
    each request alone in a session of its own working length."""
    prompts = prompts_of([p for _, p, _ in ARRIVALS], llada.config.vocab_size, seed=seed)
    arrivals: dict[int, list] = {}
    for i, ((step, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
        arrivals.setdefault(step, []).append((i, p, RequestParams(n)))
    session = Engine(llada, EngineConfig(pol, max_new_tokens=8, batch_size=2)).session(2, capacity)
    served = serve(session, arrivals)
    alone = []
    for i, ((_, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
        ref = Engine(llada, EngineConfig(pol | {"name": pol["name"].removesuffix("_windows_recorded")},
                                         max_new_tokens=n, batch_size=1))
        alone.append(ref.generate([p], request_ids=[i])[0].output_ids)
    return session, [served.results[i] for i in range(len(prompts))], alone


def test_a_session_sized_for_long_requests_runs_narrow_widths_with_the_tokens_of_alone(llada):
    session, served, alone = served_and_alone(llada, policy())
    assert [r.output_ids for r in served] == alone
    pol = session.policy
    for w, longest in pol.steps:  # the narrowest that holds the step's longest working sequence
        assert w == fit(CAPACITY, BLOCK, longest), (w, longest)
    used = [w for w, _ in pol.steps]  # 16 and 32 while only short requests decode, the capacity
    assert set(used) == {16, 32, 128}, used  # while the 72-position one does
    assert session.stats().policy == {"widths": {w: used.count(w) for w in sorted(set(used), reverse=True)}}


def test_t2t_on_a_bidirectional_model_keeps_its_tokens_through_the_widths(llada):
    t2t = {"name": "t2t", "block_size": BLOCK, "threshold": 0.5, "edit_threshold": 0.3, "max_post_steps": 2}
    session, served, alone = served_and_alone(llada, t2t, seed=4)
    assert [r.output_ids for r in served] == alone
    assert set(session.stats().policy["widths"]) == {16, 32, 128}


CACHES = {
    "flash_dllm": {"name": "flash_dllm", "block_size": BLOCK, "threshold": 0.5, "track": 6, "ahead": 8},
    "flash_verify": {"name": "flash_dllm", "block_size": BLOCK, "threshold": 0.7, "track": 6, "ahead": 8,
                     "verify": True, "search": 2, "gamma": 0.3},
    "elastic_cache": {"name": "elastic_cache", "block_size": BLOCK, "threshold": 0.5, "window": 2, "gamma": 0.95},
    "prefix_cache": {"name": "fast_dllm_cache", "block_size": BLOCK, "threshold": 0.5},
    "dual_cache": {"name": "fast_dllm_cache", "block_size": BLOCK, "threshold": 0.5, "dual": True},
}


@pytest.mark.parametrize("case", list(CACHES))
def test_the_caches_of_a_bidirectional_model_keep_their_tokens_through_the_widths(llada, case):
    """The caches read and write their rows' working sequences only: narrowed, every phase they run (refresh,
    decode, verify, recompute) gives each request its tokens alone, and their narrowed phases ran at 16 and 32."""
    session, served, alone = served_and_alone(llada, CACHES[case])
    assert [r.output_ids for r in served] == alone
    stats = session.stats().policy
    assert {16, 32} <= set(stats["widths"]), stats
    if case == "flash_verify":
        assert sum(r.extra["verified"] for r in served) > 0  # drafts were accepted
    if case == "elastic_cache":
        assert stats["recomputes"] > 0  # the drift test failed and rows recomputed


def test_a_width_too_narrow_changes_the_tokens(llada):
    """Negative control: the narrowest width (16) for every step cuts both requests' sequences (20 and 44)."""
    prompts = prompts_of([5, 30], llada.config.vocab_size)
    eng = Engine(llada, EngineConfig(policy("threshold_windows_narrowest"), max_new_tokens=12, batch_size=2,
                                     max_seq_len=CAPACITY))
    ref = Engine(llada, EngineConfig(policy("threshold"), max_new_tokens=12, batch_size=2, max_seq_len=CAPACITY))
    assert [r.output_ids for r in eng.generate(prompts)] != [r.output_ids for r in ref.generate(prompts)]


def test_the_start_up_prepares_only_the_widths_its_requests_can_use(llada, monkeypatch):
    seen = []
    real = session_module.Stepper

    def recording(*args, **kwargs):
        seen.append(kwargs["phases"])
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "Stepper", recording)
    eng = Engine(llada, EngineConfig(policy("threshold"), max_new_tokens=30, batch_size=2, max_seq_len=CAPACITY))
    eng.generate(prompts_of([40, 3], llada.config.vocab_size))  # working sequences 72 and 36: widths 128 and 64
    eng.session(2, CAPACITY)  # a server's session: any request may come
    assert seen == [("decode", "decode@64"), ("decode", "decode@64", "decode@32", "decode@16")]


def test_the_exported_runtime_pads_a_window_to_the_capacity(llada):
    """An exported bidirectional package takes [B, capacity]: a narrower window is padded, exactly (hidden)."""
    exported = object.__new__(ExportedModel)
    exported.static_shapes = StaticShapes(BLOCK, 48, (2,))
    calls = []

    def package(tokens, positions, length, logits_at):
        calls.append(tokens.shape)
        return llada(Forward(tokens, positions, AttentionSpec(Bidirectional(length)), logits_at=logits_at,
                             float_logits=True))

    exported.runners = {2: package}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, llada.config.vocab_size, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    length, at = torch.tensor([16, 12]), torch.tensor([[8, 9, 10, 11], [4, 5, 6, 7]])
    fwd = Forward(tokens, pos, AttentionSpec(Bidirectional(length)), logits_at=at, float_logits=True)
    with torch.no_grad():
        assert torch.allclose(exported(fwd), llada(fwd), atol=1e-5)
    assert calls == [torch.Size([2, 48])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("case", ["threshold", "flash_dllm"])
def test_captured_widths_equal_eager(tmp_path, case):
    """Every narrowed phase captured per bucket; a session sized for long requests replays the narrow ones and
    gives the eager session's tokens (bf16, the LLaDA shape at small size)."""
    model = compiledllm.load_model(write_checkpoint(tmp_path, "llada", 6), device="cuda", dtype=torch.bfloat16)
    prompts = prompts_of([p for _, p, _ in ARRIVALS], model.config.vocab_size)
    pol = policy() if case == "threshold" else CACHES[case]

    def run(cuda_graphs):
        eng = Engine(model, EngineConfig(pol, max_new_tokens=8, batch_size=2, cuda_graphs=cuda_graphs, compile=False))
        arrivals: dict[int, list] = {}
        for i, ((step, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
            arrivals.setdefault(step, []).append((i, p, RequestParams(n)))
        session = eng.session(2, CAPACITY)
        served = serve(session, arrivals)
        return [served.results[i].output_ids for i in range(len(prompts))], session

    graphs, session = run(True)
    eager, _ = run(False)
    assert graphs == eager
    policy_ = session.policy
    phases = expand(policy_.phases, policy_.narrow_phases, CAPACITY, BLOCK, BLOCK)
    assert set(session.stepper.graphs) == {(ph, b) for ph in phases for b in (1, 2)}
    assert {16, 32, 128} <= set(session.stats().policy["widths"])


@pytest.mark.slow
def test_compiled_widths_equal_eager(llada):
    """compile: true compiles each reachable width (a shape of its own) and gives the eager tokens."""
    prompts = prompts_of([5, 2, 9], llada.config.vocab_size, seed=6)
    params = [RequestParams(n) for n in (7, 3, 12)]  # working sequences 12, 8 and 24 in a session of 32, one at a time

    def run(compile):
        eng = Engine(llada, EngineConfig(policy(), max_new_tokens=8, batch_size=1, max_seq_len=32, compile=compile))
        out = [r.output_ids for r in eng.generate(prompts, params=params)]
        return out, eng.stats.policy

    compiled, stats = run(True)
    eager, _ = run(False)
    assert compiled == eager
    assert set(stats["widths"]) == {8, 16, 32}
