"""Packed block-diffusion attention: the torch reference (CPU) and the CuPy kernel (GPU)."""
import importlib.util
import itertools
import random

import pytest
import torch

from compiledllm.attention.packed import packed_attention, packed_attention_ref


def naive_attention(q, k_cache, v_cache, prefix_len, k_win, v_win, slot, scale=None):
    """Loop-by-loop masked softmax in float64: the contract spelled out, row by row."""
    B, Lq, H, D = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Lq, H, D, dtype=torch.float64)
    lse = torch.zeros(B, H, Lq, dtype=torch.float64)
    for b in range(B):
        ob = int(prefix_len[b])
        for h in range(H):
            kvh = h // G
            for i in range(Lq):
                keys = [k_cache[b, j, kvh] for j in range(ob)]
                vals = [v_cache[b, j, kvh] for j in range(ob)]
                keys += [k_win[b, j, kvh] for j in range(Lq) if j // slot <= i // slot]
                vals += [v_win[b, j, kvh] for j in range(Lq) if j // slot <= i // slot]
                K = torch.stack(keys).double()
                V = torch.stack(vals).double()
                s = (K @ q[b, i, h].double()) * scale
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ V
    return out, lse


def make_inputs(B, S, Lq, H, KVH, D, dtype=torch.float32, device="cpu", prefix=None, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = rnd(B, Lq, H, D)
    k_cache, v_cache = rnd(B, S, KVH, D), rnd(B, S, KVH, D)
    k_win, v_win = rnd(B, Lq, KVH, D), rnd(B, Lq, KVH, D)
    if prefix is None:
        prefix = torch.randint(0, S + 1, (B,), generator=g)
    prefix_len = torch.as_tensor(prefix, dtype=torch.int64).to(device)
    return q, k_cache, v_cache, prefix_len, k_win, v_win


# ---------------------------------------------------------------- CPU: reference vs naive loops

CPU_GRID = [
    # B, S, Lq, H, KVH, D, slot, prefix per row
    (1, 0, 8, 2, 2, 16, 4, [0]),
    (2, 12, 8, 4, 2, 16, 4, [0, 12]),
    (3, 20, 8, 4, 1, 8, 8, [5, 20, 0]),
    (2, 9, 16, 8, 2, 16, 4, [9, 3]),
    (2, 7, 16, 6, 3, 8, 16, [1, 7]),
    (1, 33, 12, 4, 4, 32, 3, [17]),
]


@pytest.mark.parametrize("B,S,Lq,H,KVH,D,slot,prefix", CPU_GRID)
def test_reference_matches_naive(B, S, Lq, H, KVH, D, slot, prefix):
    inputs = make_inputs(B, S, Lq, H, KVH, D, prefix=prefix)
    out, lse = packed_attention_ref(*inputs, slot, return_lse=True)
    ref_out, ref_lse = naive_attention(*inputs, slot)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_reference_scale_and_bf16():
    inputs = make_inputs(2, 10, 8, 4, 2, 16, dtype=torch.bfloat16, prefix=[4, 10])
    out = packed_attention_ref(*inputs, 4, scale=0.3)
    ref_out, _ = naive_attention(*inputs, 4, scale=0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)


def test_reference_chunks_the_batch(monkeypatch):
    import compiledllm.attention.packed as packed

    inputs = make_inputs(5, 11, 8, 4, 2, 16, prefix=[0, 11, 3, 7, 1])
    whole = packed_attention_ref(*inputs, 4, return_lse=True)
    monkeypatch.setattr(packed, "_REF_CHUNK_BYTES", 1)  # one row per chunk
    chunked = packed_attention_ref(*inputs, 4, return_lse=True)
    torch.testing.assert_close(chunked, whole)


def test_dispatch_on_cpu_uses_reference():
    inputs = make_inputs(2, 10, 8, 4, 2, 16, prefix=[4, 10])
    torch.testing.assert_close(packed_attention(*inputs, 4), packed_attention_ref(*inputs, 4))
    with pytest.raises(ValueError):
        packed_attention(*inputs, 4, backend="nope")


# ---------------------------------------------------------------- GPU: the CuPy and Triton kernels

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu
needs_kernel = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
BACKENDS = [
    pytest.param("cupy", marks=pytest.mark.skipif(not HAS_CUPY, reason="CuPy not installed (compiledllm[cupy-cuda13])")),
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")),
]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_kernel(inputs, slot, scale=None, backend="cupy", **kw):
    from compiledllm.attention.cupy_packed import packed_attention_cuda
    from compiledllm.attention.triton_packed import packed_attention_triton_launch

    q = inputs[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    launch = packed_attention_cuda if backend == "cupy" else packed_attention_triton_launch
    out, lse = launch(*inputs, slot, scale, True, **kw)
    ref_out, ref_lse = packed_attention_ref(*inputs, slot, scale=scale, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out, ref_out) < 1e-2, rel_err(out, ref_out)
    assert (lse - ref_lse).abs().max().item() < 1e-2
    return out


def random_cases(n, seed):
    rng = random.Random(seed)
    for k in range(n):
        Lq = rng.choice([32, 64, 128])
        slot = rng.choice([4, 8, 32, Lq])
        G, KVH = rng.choice([1, 4, 8]), rng.choice([1, 2])
        B, S = rng.choice([1, 2, 3, 5]), rng.choice([1, 40, 64, 333, 1000, 2500])
        prefix = [rng.choice([0, S, rng.randint(0, S)]) for _ in range(B)]
        yield dict(B=B, S=S, Lq=Lq, H=G * KVH, KVH=KVH, D=rng.choice([64, 128]), slot=slot, prefix=prefix,
                   dtype=rng.choice([torch.bfloat16, torch.float16]), seed=k)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(random_cases(40, seed=1)), ids=lambda c: "B{B}S{S}L{Lq}s{slot}H{H}K{KVH}D{D}".format(**c))
def test_kernel_random_grid(case, backend):
    c = dict(case)
    slot, dtype = c.pop("slot"), c.pop("dtype")
    inputs = make_inputs(**c, dtype=dtype, device="cuda")
    check_kernel(inputs, slot, backend=backend)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,D,Lq,G", list(itertools.product([torch.bfloat16, torch.float16], [64, 128], [32, 64, 128], [1, 4, 8])))
def test_kernel_shapes(dtype, D, Lq, G, backend):
    inputs = make_inputs(3, 700, Lq, 2 * G, 2, D, dtype=dtype, device="cuda", prefix=[0, 700, 321])
    check_kernel(inputs, 8, scale=0.1, backend=backend)


TILE_CASES = [pytest.param(b.values[0], t, marks=b.marks) for b in BACKENDS
              for t in {"cupy": ["w4", "w8", "w4m2", "w8s"], "triton": ["m128n64", "m128n64ws", "m128n128", "m64n64"]}[b.values[0]]]


@gpu
@needs_kernel
@pytest.mark.parametrize("backend,tile", TILE_CASES)
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_kernel_tiles_and_splits(backend, tile, splits):
    from compiledllm.attention.cupy_packed import TILES
    from compiledllm.attention.triton_packed import TRITON_TILES

    inputs = make_inputs(2, 1500, 64, 8, 2, 128, dtype=torch.bfloat16, device="cuda", prefix=[1500, 77])
    tiles = TILES if backend == "cupy" else TRITON_TILES
    check_kernel(inputs, 32, backend=backend, tile=tiles[tile], splits=splits)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_strided_inputs_and_int32_prefix(backend):
    B, S, Lq, H, KVH, D = 3, 900, 64, 16, 4, 128
    big = torch.randn(B, S + 100, KVH, D, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = big[:, :S], torch.randn_like(big)[:, 50 : 50 + S]
    qkv = torch.randn(B, Lq, H + 2 * KVH, D, device="cuda", dtype=torch.bfloat16)  # fused projection
    q, k_win, v_win = qkv.split([H, KVH, KVH], dim=2)
    prefix = torch.tensor([0, 900, 450], device="cuda", dtype=torch.int32)
    out = check_kernel((q, k_cache, v_cache, prefix, k_win, v_win), 32, backend=backend)
    assert out.is_contiguous()


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_batch_offsets_past_2_31_elements(backend):
    """A cache whose row offsets pass 2^31 elements (a large batch at a long context): 64-bit addressing."""
    S, Lq, H, KVH, D = 256, 32, 8, 2, 128
    row = 2**31 + S * KVH * D  # elements between the two rows' caches
    buf = torch.randn(row + S * KVH * D + D, device="cuda", dtype=torch.bfloat16)  # 4.3 GB; V starts D later
    k_cache = buf.as_strided((2, S, KVH, D), (row, KVH * D, D, 1))
    v_cache = buf.as_strided((2, S, KVH, D), (row, KVH * D, D, 1), storage_offset=D)
    q, _, _, prefix, k_win, v_win = make_inputs(2, S, Lq, H, KVH, D, dtype=torch.bfloat16, device="cuda",
                                                prefix=[S, 100])
    check_kernel((q, k_cache, v_cache, prefix, k_win, v_win), 32, backend=backend)


@gpu
@needs_kernel
def test_dispatch_picks_kernel_on_cuda():
    from compiledllm.attention import packed

    inputs = make_inputs(2, 300, 32, 8, 2, 64, dtype=torch.bfloat16, device="cuda", prefix=[10, 300])
    out = packed_attention(*inputs, 8)
    first = next(b for b in packed.CUDA_BACKENDS if {"cupy": HAS_CUPY, "triton": HAS_TRITON}[b])
    torch.testing.assert_close(out, packed_attention(*inputs, 8, backend=first), rtol=0, atol=0)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_torch_compile_fullgraph(backend):
    inputs = make_inputs(2, 500, 64, 16, 4, 128, dtype=torch.bfloat16, device="cuda", prefix=[100, 500])

    def f(q, kc, vc, pl, kw, vw):
        out, lse = packed_attention(q * 1.0, kc, vc, pl, kw, vw, 32, return_lse=True, backend=backend)
        return out.float().sum(-1), lse

    eager = f(*inputs)
    compiled = torch.compile(f, fullgraph=True)(*inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B", [1, 8])  # B=1 takes the split-K + combine path, B=8 a single launch
def test_kernel_cuda_graph_replay(B, backend):
    S, Lq, H, KVH, D, slot = 2048, 64, 16, 4, 128, 32
    static = make_inputs(B, S, Lq, H, KVH, D, dtype=torch.bfloat16, device="cuda", seed=3)
    run = lambda: packed_attention(*static, slot, return_lse=True, backend=backend)  # noqa: E731
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: compiles the kernel, sizes the workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = run()
    for seed in (4, 5):
        for dst, src in zip(static, make_inputs(B, S, Lq, H, KVH, D, dtype=torch.bfloat16, device="cuda", seed=seed)):
            dst.copy_(src)
        graph.replay()
        e_out, e_lse = run()
        torch.cuda.synchronize()
        torch.testing.assert_close(g_out, e_out, rtol=0, atol=0)
        torch.testing.assert_close(g_lse, e_lse, rtol=0, atol=0)
        ref = packed_attention_ref(*static, slot)
        assert rel_err(g_out, ref) < 1e-2
