"""Packed attention: the torch reference and the dispatch (CPU), the CuPy and Triton kernels (GPU)."""
import dataclasses
import importlib.util
import itertools
import random

import pytest
import torch

from compiledllm.attention import packed
from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.packed import packed_attention, packed_attention_ref
from compiledllm.attention.reference import reference
from compiledllm.attention.spec import Bidirectional, BlockCausal, ExplicitMask, QueryGroups


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
    import compiledllm.attention.reference as ref_mod

    inputs = make_inputs(5, 11, 8, 4, 2, 16, prefix=[0, 11, 3, 7, 1])
    whole = packed_attention_ref(*inputs, 4, return_lse=True)
    monkeypatch.setattr(ref_mod, "_REF_CHUNK_BYTES", 1)  # one row per chunk
    chunked = packed_attention_ref(*inputs, 4, return_lse=True)
    torch.testing.assert_close(chunked, whole)


def test_dispatch_on_cpu_uses_reference():
    inputs = make_inputs(2, 10, 8, 4, 2, 16, prefix=[4, 10])
    torch.testing.assert_close(packed_attention(*inputs, 4), packed_attention_ref(*inputs, 4))
    with pytest.raises(ValueError):
        packed_attention(*inputs, 4, backend="nope")


RULES = ["block_causal", "herald", "verify", "per_row", "bidirectional", "blind", "explicit"]
SOURCES = ["dense", "paged"]


def rule_case(rule, source, B=3, S=20, Lq=8, H=4, KVH=2, D=16, dtype=torch.float32, device="cpu", seed=0):
    """PackedArgs for a named rule and KV source, and the query rows whose result the rule's kernel form and the
    reference define alike ([B, Q] bool; None: all). Prefixes [S, 0, S // 3]: full, none (row 1 of "blind" then
    sees no key), partial. Rules: HERALD's [block | draft] (see [1, 2]), Flash-Verify's {tracked, draft, mask}
    (see [1, 3, 5]) interleaved, a per-row layout, Bidirectional with padding, groups that hide themselves
    (see [2, 2]: a group-0 query sees only group 1), an explicit mask (reference only). A paged source is a
    shuffled pool of 3 S rows, kv_index a permutation (int32)."""
    g = torch.Generator().manual_seed(seed)
    q, k_cache, v_cache, prefix, k_win, v_win = make_inputs(B, S, Lq, H, KVH, D, dtype, device,
                                                            [S, 0, S // 3][:B], seed)
    on = dict(device=device)
    rows = None
    if rule == "block_causal":
        r = BlockCausal(4)
    elif rule == "herald":
        r = QueryGroups(torch.tensor([[0] * (Lq // 2) + [1] * (Lq - Lq // 2)], **on), torch.tensor([1, 2], **on))
    elif rule in ("verify", "per_row"):
        group = torch.randint(0, 3, (1 if rule == "verify" else B, Lq), generator=g, dtype=torch.int32)
        r = QueryGroups(group.to(device), torch.tensor([1, 3, 5], **on))
    elif rule == "bidirectional":
        length = torch.tensor([Lq, Lq // 2 + 1, 0][:B], **on)
        r = Bidirectional(length)
    elif rule == "blind":
        group = torch.zeros(B, Lq, dtype=torch.int32)
        group[0, Lq // 3:] = 1
        group[2, ::2] = 1
        r = QueryGroups(group.to(device), torch.tensor([2, 2], **on))
    else:
        r = ExplicitMask(torch.rand(B, Lq, S + Lq, generator=g).to(device) < 0.6)
    kv_index = None
    if source == "paged":
        N = 3 * S
        kv_index = torch.stack([torch.randperm(N, generator=g)[:S] for _ in range(B)]).to(device, torch.int32)
        pool_k = torch.randn(N, KVH, D, generator=g).to(device, dtype)
        pool_v = torch.randn(N, KVH, D, generator=g).to(device, dtype)
        k_cache, v_cache = pool_k, pool_v
    return PackedArgs(q, k_cache, v_cache, prefix, k_win, v_win, r, kv_index), rows


def naive_rule_attention(a: PackedArgs, queries, per_head=False):
    """Loop-by-loop float64 masked softmax from the rule's own window mask: out, lse, mass [B, S + Q] (per_head:
    [B, KVH, S + Q], each KV head's query heads)."""
    B, Lq, H, D = a.q.shape
    kc, vc = a.k_cache, a.v_cache
    if a.kv_index is not None:
        kc, vc = kc[a.kv_index.long()], vc[a.kv_index.long()]
    S, KVH = kc.shape[1], kc.shape[2]
    win = a.rule.window_mask(Lq).expand(B, Lq, Lq)
    pre = a.rule.mask[..., :S] if isinstance(a.rule, ExplicitMask) else torch.ones(B, Lq, S, dtype=torch.bool)
    out = torch.zeros(B, Lq, H, D, dtype=torch.float64)
    lse = torch.full((B, H, Lq), float("-inf"), dtype=torch.float64)
    mass = torch.zeros(B, KVH, S + Lq, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kvh = h // (H // KVH)
            for i in range(Lq):
                keys = [j for j in range(int(a.prefix_len[b])) if pre[b, i, j]]
                wins = [j for j in range(Lq) if win[b, i, j]]
                if not keys and not wins:  # sees nothing: out 0, lse -inf
                    continue
                K = torch.stack([kc[b, j, kvh] for j in keys] + [a.k_win[b, j, kvh] for j in wins]).double()
                V = torch.stack([vc[b, j, kvh] for j in keys] + [a.v_win[b, j, kvh] for j in wins]).double()
                s = (K @ a.q[b, i, h].double()) * a.softmax_scale
                lse[b, h, i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[b, i, h] = p @ V
                if queries[b, i]:
                    mass[b, kvh, keys + [S + j for j in wins]] += p
    return out, lse, (mass if per_head else mass.sum(1))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("rule", RULES)
def test_run_on_cpu_is_the_reference(rule, source):
    """packed.run on CPU tensors is the reference (whatever backend auto picks), and the reference follows each
    rule's mask and each source loop by loop (output, lse, per-key mass)."""
    if rule == "explicit" and source == "paged":
        pytest.skip("ExplicitMask takes no kv_index")
    a, _ = rule_case(rule, source)
    queries = torch.rand(a.q.shape[:2], generator=torch.Generator().manual_seed(1)) < 0.6
    out, lse, mass = packed.run(a, return_lse=True, mass_queries=queries)
    ref_out, ref_lse, ref_mass = reference(a, True, queries)
    for got, want in ((out, ref_out), (lse, ref_lse), (mass, ref_mass)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    n_out, n_lse, n_mass = naive_rule_attention(a, queries)
    torch.testing.assert_close(out.double(), n_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), n_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.double(), n_mass, rtol=1e-5, atol=1e-5)
    if rule == "blind":  # row 1 sees no key: out 0, lse -inf, no mass
        assert (out[1] == 0).all() and (lse[1] == float("-inf")).all() and (mass[1] == 0).all()


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rule,source", [("block_causal", "dense"), ("block_causal", "paged"), ("verify", "dense"),
                                         ("verify", "paged"), ("explicit", "dense")])  # ExplicitMask: no kv_index
def test_the_cpu_reference_reads_up_to_the_longest_prefix(monkeypatch, rule, source, per_head):
    """On the CPU the reference reads the KV source up to the longest visible prefix (a server's cache is sized for
    its longest request): the same output, lse and mass as reading all of it, the mass zero past the prefixes and
    of the source's full width."""
    import compiledllm.attention.reference as ref_mod

    a, _ = rule_case(rule, source)
    a = dataclasses.replace(a, prefix_len=torch.tensor([7, 0, 3]))  # the source holds 20 keys a row
    queries = torch.rand(a.q.shape[:2], generator=torch.Generator().manual_seed(3)) < 0.6
    read = []
    real = ref_mod.visible_keys
    monkeypatch.setattr(ref_mod, "visible_keys", lambda *args: read.append(real(*args)) or read[-1])
    cut = reference(a, True, queries, per_head)
    monkeypatch.setattr(ref_mod, "visible_keys", lambda prefix_len, source, q: source)
    whole = reference(a, True, queries, per_head)
    assert read == [7]
    for got, want in zip(cut, whole):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert cut[2].shape[-1] == 20 + a.q.shape[1] and (cut[2][..., 7:20] == 0).all()
    n_out, n_lse, n_mass = naive_rule_attention(a, queries, per_head)
    torch.testing.assert_close(cut[0].double(), n_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cut[2].double(), n_mass, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("rule", RULES)
def test_per_head_mass_on_cpu(rule, source):
    """mass_per_head: [B, KVH, S + Q], each KV head's query heads, loop by loop; its sum over KV heads is the
    summed mass."""
    if rule == "explicit" and source == "paged":
        pytest.skip("ExplicitMask takes no kv_index")
    a, _ = rule_case(rule, source)
    queries = torch.rand(a.q.shape[:2], generator=torch.Generator().manual_seed(2)) < 0.6
    _, _, mass = packed.run(a, mass_queries=queries, mass_per_head=True)
    _, _, flat = packed.run(a, mass_queries=queries)
    assert mass.shape == (3, 2, a.keys + a.q.shape[1]) and mass.dtype == torch.float32
    torch.testing.assert_close(mass.double(), naive_rule_attention(a, queries, per_head=True)[2], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(mass.sum(1), flat, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- GPU: the CuPy and Triton kernels

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu
needs_kernel = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")
BACKENDS = [
    pytest.param("cupy", marks=pytest.mark.skipif(not HAS_CUPY, reason="CuPy not installed (compiledllm[cupy-cuda13])")),
    pytest.param("triton", marks=needs_triton),
]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def launcher(backend):
    from compiledllm.attention.cupy_packed import packed_attention_cuda
    from compiledllm.attention.triton_packed import packed_attention_triton_launch

    return packed_attention_cuda if backend == "cupy" else packed_attention_triton_launch


def check_kernel(inputs, slot, scale=None, backend="cupy", **kw):
    q = inputs[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = launcher(backend)(PackedArgs(*inputs, BlockCausal(slot), scale=scale), True, **kw)
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
@pytest.mark.bigmem
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


# ---------------------------------------------------------------- GPU: mask rules, paged sources, attention mass

GPU_RULES = ["herald", "verify", "per_row", "bidirectional", "blind"]


def check_rule_kernel(a, rows, backend, **kw):
    """The kernel against the reference on `rows` (None: all); a query that sees no key: out 0, lse -inf."""
    out, lse = launcher(backend)(a, True, **kw)
    ref_out, ref_lse, _ = reference(a, True)
    if rows is not None:
        out, ref_out, lse, ref_lse = out[rows], ref_out[rows], lse.transpose(1, 2)[rows], ref_lse.transpose(1, 2)[rows]
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_out) < 1e-2, rel_err(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-2)  # -inf where the reference has it
    return out, lse


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("rule", GPU_RULES)
@pytest.mark.parametrize("Lq,G,dtype", [(32, 4, torch.bfloat16), (64, 1, torch.float16)])
def test_kernel_rules_and_sources(rule, source, splits, Lq, G, dtype, backend):
    a, rows = rule_case(rule, source, B=3, S=333, Lq=Lq, H=2 * G, KVH=2, D=128, dtype=dtype, device="cuda")
    out, lse = check_rule_kernel(a, rows, backend, splits=splits)
    if rule == "blind":
        assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()


@gpu
@needs_kernel
@pytest.mark.parametrize("backend,tile", TILE_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_groups_paged_tiles_and_splits(backend, tile, splits):
    from compiledllm.attention.cupy_packed import TILES
    from compiledllm.attention.triton_packed import TRITON_TILES

    a, _ = rule_case("per_row", "paged", B=2, S=1500, Lq=64, H=8, KVH=2, D=128, dtype=torch.bfloat16, device="cuda")
    check_rule_kernel(a, None, backend, tile=(TILES if backend == "cupy" else TRITON_TILES)[tile], splits=splits)


def statistic_cases(test):
    """The statistics' GPU tests: every rule the kernel runs, over every KV source."""
    for mark in (pytest.mark.parametrize("rule", ["block_causal", *GPU_RULES]),
                 pytest.mark.parametrize("source", SOURCES), needs_triton, needs_kernel, gpu):
        test = mark(test)
    return test


def statistic_case(rule: str, source: str):
    """(args, counted queries [B, Q]: about half, none in row 0) of the statistics' GPU tests."""
    a, rows = rule_case(rule, source, B=3, S=700, Lq=64, H=16, KVH=4, D=128, dtype=torch.bfloat16, device="cuda")
    queries = torch.rand(a.q.shape[:2], device="cuda") < 0.5
    queries[0] = False
    return a, queries if rows is None else queries & rows


@statistic_cases
def test_triton_attention_mass(rule, source):
    """The Triton mass op through packed.run against the reference's mass; deterministic."""
    a, queries = statistic_case(rule, source)
    _, _, mass = packed.run(a, return_lse=True, backend="triton", mass_queries=queries)
    _, _, ref_mass = reference(a, True, queries)
    torch.testing.assert_close(mass, ref_mass, rtol=1e-3, atol=1e-4)
    assert (mass[0] == 0).all() and (mass[2, a.prefix_len[2]:a.keys] == 0).all()
    _, _, again = packed.run(a, return_lse=True, backend="triton", mass_queries=queries)
    assert torch.equal(again, mass)
    # per KV head: the kernel's own per-head partials, against the reference's, summing to the figure above
    _, _, heads = packed.run(a, return_lse=True, backend="triton", mass_queries=queries, mass_per_head=True)
    _, _, ref_heads = reference(a, True, queries, mass_per_head=True)
    assert heads.shape == (3, 4, a.keys + 64)
    torch.testing.assert_close(heads, ref_heads, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(heads.sum(1), mass, rtol=1e-5, atol=1e-5)


@statistic_cases
def test_triton_logit_score_in_the_attention_pass(rule, source):
    """The tracker score made by the attention kernel's own pass (packed_attention_scored) against the reference's;
    its out is the plain launch's; deterministic."""
    a, queries = statistic_case(rule, source)
    out, _, score = packed.run(a, backend="triton", mass_queries=queries, mass_logits=True)
    plain, _, _ = packed.run(a, backend="triton")
    _, _, ref = reference(a, mass_queries=queries, mass_logits=True)
    torch.testing.assert_close(score, ref, rtol=1e-3, atol=2e-2)
    assert torch.equal(out, plain) and (score[0] == 0).all() and (score[2, a.prefix_len[2]:a.keys] == 0).all()
    assert torch.equal(packed.run(a, backend="triton", mass_queries=queries, mass_logits=True)[2], score)


def groups_paged_inputs(seed, device="cuda"):
    """Static tensors of a QueryGroups (per-row) + paged call: q, pool K/V, prefix, window K/V, group, see, index."""
    a, _ = rule_case("per_row", "paged", B=2, S=1500, Lq=64, H=16, KVH=4, D=128, dtype=torch.bfloat16,
                     device=device, seed=seed)
    return [a.q, a.k_cache, a.v_cache, a.prefix_len, a.k_win, a.v_win, a.rule.group, a.rule.see, a.kv_index]


def groups_paged_run(backend, q, kc, vc, pl, kw, vw, group, see, idx, queries=None, per_head=False):
    a = PackedArgs(q, kc, vc, pl, kw, vw, QueryGroups(group, see), kv_index=idx)
    return packed.run(a, return_lse=True, backend=backend, mass_queries=queries, mass_per_head=per_head)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_groups_paged_torch_compile_fullgraph(backend):
    inputs = groups_paged_inputs(0)
    queries = torch.rand(inputs[0].shape[:2], device="cuda") < 0.5 if backend == "triton" else None

    def f(*xs):
        out, lse, mass = groups_paged_run(backend, xs[0] * 1.0, *xs[1:], queries)
        return (out.float().sum(-1), lse) + (() if mass is None else (mass,))

    eager = f(*inputs)
    compiled = torch.compile(f, fullgraph=True)(*inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)


@gpu
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_groups_paged_opcheck(backend):
    """The ops' schemas and fake (shape-only) outputs agree with the kernels."""
    q, kc, vc, pl, kw, vw, group, see, idx = groups_paged_inputs(0)
    scale = q.shape[-1] ** -0.5
    op = torch.ops.compiledllm.packed_attention if backend == "cupy" else torch.ops.compiledllm.packed_attention_triton
    torch.library.opcheck(op, (q, kc, vc, pl, kw, vw, group, see, idx, 0, scale, True),
                          test_utils=("test_schema", "test_faketensor"))
    if backend == "triton":
        _, lse = op(q, kc, vc, pl, kw, vw, group, see, idx, 0, scale, True)
        queries = torch.rand(q.shape[:2], device="cuda") < 0.5
        for per_head in (False, True):
            torch.library.opcheck(torch.ops.compiledllm.attention_mass,
                                  (q, kc, pl, kw, group, see, idx, 0, scale, lse, queries, per_head),
                                  test_utils=("test_schema", "test_faketensor"))


@gpu
@needs_kernel
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_groups_paged_cuda_graph_replay(backend, per_head):
    if per_head and backend != "triton":
        pytest.skip("only the Triton kernel has statistics")
    static = groups_paged_inputs(3)
    queries = torch.zeros(static[0].shape[:2], dtype=torch.bool, device="cuda")
    queries[:, ::3] = True
    mass_q = queries if backend == "triton" else None
    run = lambda: groups_paged_run(backend, *static, mass_q, per_head)  # noqa: E731
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: compiles the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = run()
    for seed in (4, 5):
        for dst, src in zip(static, groups_paged_inputs(seed)):
            dst.copy_(src)
        graph.replay()
        e_out = run()
        torch.cuda.synchronize()
        for g, e in zip(g_out, e_out):
            if e is not None:
                torch.testing.assert_close(g, e, rtol=0, atol=0)
        a = PackedArgs(*static[:6], QueryGroups(static[6], static[7]), kv_index=static[8])
        ref_out, _, ref_mass = reference(a, True, queries, per_head)
        assert rel_err(g_out[0], ref_out) < 1e-2
        if mass_q is not None:
            torch.testing.assert_close(g_out[2], ref_mass, rtol=1e-3, atol=1e-4)


@gpu
@pytest.mark.bigmem
@needs_kernel
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_paged_pool_past_2_31_elements(backend):
    """A pool whose rows pass 2^31 elements, read through kv_index from both ends: 64-bit pool addressing."""
    S, Lq, H, KVH, D = 256, 32, 8, 2, 128
    row = KVH * D
    N = 2**31 // row + 1024  # the last 1024 pool rows start past 2^31 elements
    buf = torch.randn(N * row + D, device="cuda", dtype=torch.bfloat16)  # 4.3 GB; V starts D later
    k_pool = buf.as_strided((N, KVH, D), (row, D, 1))
    v_pool = buf.as_strided((N, KVH, D), (row, D, 1), storage_offset=D)
    g = torch.Generator().manual_seed(0)
    high = N - 1024 + torch.randperm(1024, generator=g)[:S]
    low = torch.randperm(4096, generator=g)[:S]
    kv_index = torch.stack([high, torch.where(torch.arange(S) % 2 == 0, high.flip(0), low)]).to("cuda")
    q, _, _, prefix, k_win, v_win = make_inputs(2, S, Lq, H, KVH, D, dtype=torch.bfloat16, device="cuda",
                                                prefix=[S, 100])
    group = torch.tensor([[0] * 16 + [1] * 16], device="cuda")
    for rule in (BlockCausal(32), QueryGroups(group, torch.tensor([1, 3], device="cuda"))):
        check_rule_kernel(PackedArgs(q, k_pool, v_pool, prefix, k_win, v_win, rule, kv_index), None, backend)
