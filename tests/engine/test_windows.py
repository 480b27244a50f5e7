"""Window phases (policies/windows.py): a bidirectional model's `threshold` / `t2t` forward spans the narrowest
captured window that holds the step's longest working sequence, not the session's whole KV capacity. A server-shaped
session sized for long requests gives each request the tokens it gets alone at its own tight capacity, through
windows a quarter or an eighth of that capacity; a schedule that runs a window too narrow changes them."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from serve_loop import serve

import compiledllm
from compiledllm.attention.spec import AttentionSpec, Bidirectional
from compiledllm.engine import Engine, EngineConfig, RequestParams
from compiledllm.engine import session as session_module
from compiledllm.export.runtime import ExportedModel, StaticShapes
from compiledllm.policies import register_policy
from compiledllm.policies.plan import Forward
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy
from compiledllm.policies.windows import reachable, smallest, windows

BLOCK, CAPACITY = 4, 128


class RecordedConfig(ThresholdConfig):
    pass  # its own config class: make_policy finds a policy by its config's class


class RecordedPolicy(ThresholdPolicy):
    """threshold, recording per step (its window phase, the longest working sequence of its decoding rows, read from
    the slot state itself) and per plan its query positions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[str, int]] = []
        self.widths: list[tuple[str, int]] = []
        self.longest = 0

    def before_step(self, host, step):
        self.longest = int(host.st.work_len[list(step.rows)].max())

    def schedule(self, step):
        out = super().schedule(step)
        self.steps.append((out[-1], self.longest))
        return out

    def plan(self, phase, st):
        fwd = super().plan(phase, st)
        self.widths.append((phase, fwd.tokens.shape[1]))
        return fwd


class NarrowestConfig(ThresholdConfig):
    pass


class NarrowestPolicy(ThresholdPolicy):
    """A careless schedule: always the narrowest window, whatever the rows need (negative control)."""

    def schedule(self, step):
        return (list(windows(step.capacity, self.block_size))[-1],)


register_policy("threshold_windows_recorded", RecordedConfig, RecordedPolicy)
register_policy("threshold_windows_narrowest", NarrowestConfig, NarrowestPolicy)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "llada", 6), dtype=torch.float32)


def policy(name="threshold_windows_recorded"):
    return {"name": name, "block_size": BLOCK, "threshold": 0.5}


def test_window_sizes():
    assert windows(128, 4) == {"decode": 128, "decode1": 64, "decode2": 32, "decode3": 16}
    assert windows(40, 8) == {"decode": 40, "decode1": 24, "decode2": 16, "decode3": 8}  # whole blocks
    assert windows(16, 8) == {"decode": 16, "decode1": 8}  # equal widths keep the first name
    assert smallest(128, 4, 17) == "decode2" and smallest(128, 4, 16) == "decode3"
    assert smallest(128, 4, 128) == "decode" and smallest(128, 4, 65) == "decode"
    assert reachable(128, 4, 40) == ("decode", "decode1") and reachable(128, 4, 4) == tuple(windows(128, 4))


def prompts_of(lengths, vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


ARRIVALS = [(0, 5, 7), (0, 2, 9), (3, 9, 20), (6, 3, 5), (6, 30, 40)]  # (step, prompt length, max_new_tokens)


def test_a_session_sized_for_long_requests_runs_narrow_windows_with_the_tokens_of_alone(llada):
    prompts = prompts_of([p for _, p, _ in ARRIVALS], llada.config.vocab_size)
    eng = Engine(llada, EngineConfig(policy(), max_new_tokens=8, batch_size=2))
    arrivals: dict[int, list] = {}
    for i, ((step, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
        arrivals.setdefault(step, []).append((i, p, RequestParams(n)))
    session = eng.session(2, CAPACITY)
    served = serve(session, arrivals)
    pol = eng.policy
    for i, ((_, _, n), p) in enumerate(zip(ARRIVALS, prompts)):  # alone: a session of its own length
        ref = Engine(llada, EngineConfig(policy("threshold"), max_new_tokens=n, batch_size=1))
        assert served.results[i].output_ids == ref.generate([p], request_ids=[i])[0].output_ids, i
    size = windows(CAPACITY, BLOCK)
    assert all(w == size[phase] for phase, w in pol.widths)
    narrower = dict(zip(size, [*list(size)[1:], None]))
    for phase, longest in pol.steps:  # the narrowest that holds the step's longest working sequence
        assert size[phase] >= longest and (narrower[phase] is None or size[narrower[phase]] < longest)
    used = {size[phase] for phase, _ in pol.steps}  # 16 and 32 while only short requests decode, the capacity
    assert used == {16, 32, 128}, used                # while the 72-position one does
    widths = [size[phase] for phase, _ in pol.steps]  # bench's policy_stats: steps per window width
    assert session.stats().policy == {"decode_windows": {w: widths.count(w) for w in sorted(used, reverse=True)}}


def test_t2t_on_a_bidirectional_model_keeps_its_tokens_through_the_windows(llada):
    """t2t shares BlockPolicy's windows: in the server-shaped session each request gets its tokens alone."""
    t2t = {"name": "t2t", "block_size": BLOCK, "threshold": 0.5, "edit_threshold": 0.3, "max_post_steps": 2}
    prompts = prompts_of([p for _, p, _ in ARRIVALS], llada.config.vocab_size, seed=4)
    arrivals: dict[int, list] = {}
    for i, ((step, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
        arrivals.setdefault(step, []).append((i, p, RequestParams(n)))
    session = Engine(llada, EngineConfig(t2t, max_new_tokens=8, batch_size=2)).session(2, CAPACITY)
    served = serve(session, arrivals)
    for i, ((_, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
        ref = Engine(llada, EngineConfig(t2t, max_new_tokens=n, batch_size=1))
        assert served.results[i].output_ids == ref.generate([p], request_ids=[i])[0].output_ids, i
    assert set(session.stats().policy["decode_windows"]) == {16, 32, 128}


def test_a_window_too_narrow_changes_the_tokens(llada):
    """Negative control: the narrowest window (16) for every step cuts both requests' sequences (20 and 44)."""
    prompts = prompts_of([5, 30], llada.config.vocab_size)
    eng = Engine(llada, EngineConfig(policy("threshold_windows_narrowest"), max_new_tokens=12, batch_size=2,
                                     max_seq_len=CAPACITY))
    ref = Engine(llada, EngineConfig(policy("threshold"), max_new_tokens=12, batch_size=2, max_seq_len=CAPACITY))
    assert [r.output_ids for r in eng.generate(prompts)] != [r.output_ids for r in ref.generate(prompts)]


def test_the_start_up_prepares_only_the_windows_its_requests_can_use(llada, monkeypatch):
    seen = []
    real = session_module.Stepper

    def recording(*args, **kwargs):
        seen.append(kwargs["phases"])
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "Stepper", recording)
    eng = Engine(llada, EngineConfig(policy("threshold"), max_new_tokens=30, batch_size=2, max_seq_len=CAPACITY))
    eng.generate(prompts_of([40, 3], llada.config.vocab_size))  # working sequences 72 and 36: windows 128 and 64
    eng.session(2, CAPACITY)  # a server's session: any request may come
    assert seen == [reachable(CAPACITY, BLOCK, 36), tuple(windows(CAPACITY, BLOCK))]
    assert seen[0] == ("decode", "decode1")


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
def test_captured_windows_equal_eager(tmp_path):
    """Every window phase captured per bucket; a session sized for long requests replays the narrow ones and gives
    the eager session's tokens (bf16, the LLaDA shape at small size)."""
    model = compiledllm.load_model(write_checkpoint(tmp_path, "llada", 6), device="cuda", dtype=torch.bfloat16)
    prompts = prompts_of([p for _, p, _ in ARRIVALS], model.config.vocab_size)

    def run(cuda_graphs):
        eng = Engine(model, EngineConfig(policy(), max_new_tokens=8, batch_size=2, cuda_graphs=cuda_graphs,
                                         compile=False))
        arrivals: dict[int, list] = {}
        for i, ((step, _, n), p) in enumerate(zip(ARRIVALS, prompts)):
            arrivals.setdefault(step, []).append((i, p, RequestParams(n)))
        session = eng.session(2, CAPACITY)
        served = serve(session, arrivals)
        return [served.results[i].output_ids for i in range(len(prompts))], session, eng.policy

    graphs, session, pol = run(True)
    eager, _, _ = run(False)
    assert graphs == eager
    assert set(session.stepper.graphs) == {(ph, b) for ph in windows(CAPACITY, BLOCK) for b in (1, 2)}
    assert {16, 32, 128} <= {windows(CAPACITY, BLOCK)[ph] for ph, _ in pol.steps}


@pytest.mark.slow
def test_compiled_windows_equal_eager(llada):
    """compile: true compiles each reachable window (a shape of its own) and gives the eager tokens."""
    prompts = prompts_of([5, 2, 9], llada.config.vocab_size, seed=6)
    params = [RequestParams(n) for n in (7, 3, 12)]  # working sequences 12, 8 and 24 in a session of 32, one at a time

    def run(compile):
        eng = Engine(llada, EngineConfig(policy(), max_new_tokens=8, batch_size=1, max_seq_len=32, compile=compile))
        out = [r.output_ids for r in eng.generate(prompts, params=params)]
        return out, eng.policy

    compiled, pol = run(True)
    eager, _ = run(False)
    assert compiled == eager
    assert {windows(32, BLOCK)[ph] for ph, _ in pol.steps} == {8, 16, 32}
