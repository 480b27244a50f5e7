"""Forward.route_groups in the MoE (models/layers.py): the decoder layer hands them over, dead tokens (-1) take no
expert pair on every path (torch grouped GEMMs, expert parallelism, the Triton op), the live tokens' outputs are
bitwise those of the forward without groups, and a forward without groups runs exactly the old path."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE
from compiledllm.models.routing import count_touched
from compiledllm.policies.plan import Forward, route_groups

E, K = 8, 2


def moe_layer(seed: int = 0, dtype=torch.float32) -> MoE:
    cfg = MoEConfig(num_experts=E, expert_dim=8, top_k=K, num_shared=1, n_group=4, topk_group=2,
                    routed_scaling=2.5, norm_topk_prob=True)
    moe = MoE(16, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        moe.expert_bias.copy_(torch.randn(E, generator=g) * 0.1)
    return moe.to(dtype)


GROUPS = torch.tensor([[0, 0, 1, 1, -1, -1], [-1, 3, 3, 3, 3, -1]])


def test_dead_tokens_route_nowhere_and_live_ones_are_bitwise_unchanged():
    moe = moe_layer()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    live = GROUPS >= 0
    with torch.no_grad():
        ids, w = moe.route(x.reshape(-1, 16), "grouped_mm", GROUPS)
        base_ids, base_w = moe.route(x.reshape(-1, 16), "grouped_mm")
        flat = live.reshape(-1)
        assert torch.equal(ids[flat], base_ids[flat]) and torch.equal(w[flat], base_w[flat])
        assert (ids[~flat] == E).all() and (w[~flat] == 0).all()
        today = moe(x, "grouped_mm")
        got = moe(x, "grouped_mm", GROUPS)
        assert torch.equal(got[live], today[live])
        # a dead token's output: the shared expert alone (finite; nothing reads it)
        assert torch.equal(got[~live], moe.shared(x[~live]))
        # every token live: exactly the forward without groups
        assert torch.equal(moe(x, "grouped_mm", torch.zeros(2, 6, dtype=torch.long)), today)
        # x [T, D] with groups [T]: one row
        assert torch.equal(moe(x[0], "grouped_mm", GROUPS[0]), got[0])
    with pytest.raises(ValueError, match="route groups of shape"):
        moe(x, "grouped_mm", GROUPS[:, :5])


def test_skipped_pairs_never_reach_the_grouped_gemm_rows():
    """A skipped pair's row is never computed; it is replaced by 0 even if the GEMM left NaN there."""
    moe = moe_layer()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    ids, w = moe.route(x, "grouped_mm")
    ids[2], w[2] = E, 0.0
    real = moe._pairs

    def poisoned(x, flat, bins, k):
        out = real(x, flat, bins, k)
        return torch.where((flat < E)[:, None], out, float("nan"))

    moe._pairs = poisoned  # instance attribute: this test's module only
    with torch.no_grad():
        out = moe._routed(x, ids, w, "grouped_mm", skip=True)
    assert torch.isfinite(out).all() and (out[2] == 0).all()


def test_expert_parallel_ranks_skip_dead_pairs():
    """Two ranks holding half the experts each: their partials sum to the whole MoE's routed output."""
    moe = moe_layer()
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ids, w = moe.route(x, "grouped_mm", GROUPS.reshape(1, -1))
        whole = moe._routed(x, ids, w, "grouped_mm", skip=True)
        parts = []
        for first in (0, E // 2):
            rank = moe_layer()
            rank.w_gate_up = torch.nn.Parameter(moe.w_gate_up[first:first + E // 2].clone())
            rank.w_down = torch.nn.Parameter(moe.w_down[first:first + E // 2].clone())
            rank.parallel = SimpleNamespace(experts=E // 2, first_expert=first)
            parts.append(rank._routed(x, ids, w, "grouped_mm"))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
    assert (whole[(GROUPS.reshape(-1) < 0)] == 0).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("llada2"), "llada2", 5), device="cpu",
                                  dtype=torch.float32)


def test_decoder_layers_pass_the_forwards_route_groups(tiny):
    B, L, block = 2, 8, 4
    ids = torch.randint(2, 96, (B, L), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(L).expand(B, L)
    live = torch.tensor([[True] * 8, [True] * 4 + [False] * 4])  # row 1's second block: padding
    seen = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args: seen.append(args[2]))
             for layer in tiny.layers if isinstance(layer.mlp, MoE)]
    try:
        with torch.no_grad():
            spec = AttentionSpec(BlockCausal(block))
            today = tiny(Forward(ids, pos, spec, float_logits=True))
            got = tiny(Forward(ids, pos, spec, float_logits=True, route_groups=route_groups(pos, block, live)))
    finally:
        for h in hooks:
            h.remove()
    assert seen[0] is None and all(torch.equal(g, route_groups(pos, block, live)) for g in seen[len(seen) // 2:])
    assert torch.equal(got[live], today[live])  # the live tokens, bitwise


def test_count_touched_leaves_dead_tokens_out(tiny):
    ids = torch.randint(2, 96, (1, 8), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(8)[None]
    one = torch.tensor([[-1, -1, -1, 0, -1, -1, -1, -1]])  # one live token: its top-2 per layer
    with torch.no_grad(), count_touched(tiny) as found:
        tiny(Forward(ids, pos, AttentionSpec(BlockCausal(4)), route_groups=one))
        tiny(Forward(ids, pos, AttentionSpec(BlockCausal(4)), route_groups=route_groups(pos, 4)))
        tiny(Forward(ids, pos, AttentionSpec(BlockCausal(4))))
    assert all(c[0] == K and c[1] == c[2] >= K for c in found.per_layer), found.per_layer
    assert all(not m._forward_pre_hooks for layer in tiny.layers for m in [layer.mlp])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_op_skips_pairs_in_the_interpreter():
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("moe_skip_interp.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "grouped_mm"])
def test_live_tokens_bitwise_on_cuda(tmp_path, backend):
    """bf16 on CUDA ("auto": the Triton experts; "grouped_mm": torch._grouped_mm): dead padding leaves the live
    tokens' logits bitwise those of the forward that routes every token."""
    from compiledllm.attention.spec import Kernels

    model = compiledllm.load_model(write_checkpoint(tmp_path, "llada2", 5, moe_intermediate_size=64,
                                                    hidden_size=64, head_dim=16),
                                   device="cuda", dtype=torch.bfloat16)
    B, L, block = 4, 16, 4
    ids = torch.randint(2, 96, (B, L), generator=torch.Generator().manual_seed(7)).cuda()
    pos = torch.arange(L, device="cuda").expand(B, L)
    live = torch.arange(L, device="cuda")[None] < torch.tensor([16, 12, 4, 8], device="cuda")[:, None]
    spec = AttentionSpec(BlockCausal(block))
    kernels = Kernels(moe=backend)
    with torch.no_grad():
        today = model(Forward(ids, pos, spec, kernels=kernels))
        got = model(Forward(ids, pos, spec, kernels=kernels, route_groups=route_groups(pos, block, live)))
    assert torch.equal(got[live], today[live])
