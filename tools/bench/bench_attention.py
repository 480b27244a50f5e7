"""Benchmark the packed-attention kernels (CuPy/CUDA "ours" and Triton) against FlexAttention, FlashInfer and SDPA
(dense mask) on one GPU.

Per config (heads, batch B, mean prefix with +-25% per-row variation, q_len, slot) it times them all
in the same run, measures the two ceilings (HBM copy bandwidth, bf16 8192^3 matmul rate) and reports
the ratio to each baseline and the fraction of the roofline
    max(visible K/V (+ q/out) bytes / HBM bandwidth, visible FLOPs / matmul rate).
The K/V live once per config in FlexAttention's layout [B, KVH, S + Lq, D] (prefix at [0, o_b), the
window at the tail [S, S + Lq)); the kernel reads the same memory through transposed views.
triton.testing.do_bench flushes L2 before every timed call, so small configs are not timed from cache.

Baselines (each optional, --baselines):
  flex_static  torch.compile(flex_attention, dynamic=False): one compile and one block mask per shape, so Flex
               gets its static-shape kernels. The baseline of record (keys flex_static_*, speedup_vs_flex_static).
  flex         the same with dynamic=True (symbolic shapes, one compile for all): the figures before issue 19,
               kept under their old keys (flex_s, speedup_vs_flex) for comparison with older JSON.
  flashinfer   BatchPrefillWithPagedKVCacheWrapper (the kernels SGLang and HERALD's Dense baseline run) over a
               copy of the same K/V as a paged NHD cache, once per --flashinfer-backends entry (fa2, fa3):
               q_len = slot has no mask (the block sees its prefix and itself), slot < q_len a custom mask.
               FlashInfer's decode wrapper takes one query per request, so the 32-query block goes through
               the prefill (append) wrapper. Skipped with one line where `import flashinfer` fails; its JIT
               compiles each backend on first use (flashinfer_<backend>_first_call_s records it).
  sdpa         F.scaled_dot_product_attention with the dense mask, where it fits.
  sdpa_cudnn   the same call restricted to the cuDNN backend (the boolean mask [B, 1, Lq, N] as its bias), and
  sdpa_efficient  restricted to the memory-efficient backend: the SDPA kernels that take a block-causal mask
               (Flash takes none). For prefill chunks: --qlens 4096 --slot 32 (issue 31 item 5).

    PYTHONPATH=. python tools/bench/bench_attention.py --out bench.json [--sweep] [--quick] [--baselines ...]
"""
import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from compiledllm.attention.cupy_packed import TILES, default_tile, packed_attention_cuda
from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.spec import BlockCausal
from compiledllm.attention.triton_packed import TRITON_TILES, default_triton_tile, packed_attention_triton_launch

HEADS = [(16, 4), (32, 8)]  # LLaDA2.0-mini, SDAR-8B
BATCHES = [1, 8, 32, 64]
PREFIXES = [1024, 4096, 16384, 32768]
QLENS = [32, 64]
D = 128
SWEEP_CASES = [(32, 4096, 32), (32, 32768, 32), (64, 4096, 32), (8, 32768, 32), (64, 16384, 64)]  # B, prefix, Lq
SDPA_BYTES_LIMIT = 24 << 30  # skip SDPA-dense where its math path would need more than this
BASELINES = ("flex_static", "flex", "flashinfer", "sdpa", "sdpa_cudnn", "sdpa_efficient")
FLASHINFER_PAGE = 16  # tokens per page of the FlashInfer copy of the cache (vLLM's default block size)


def ceilings() -> dict:
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median") * 1e-3
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_mm = do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median") * 1e-3
    return {"hbm_bytes_per_s": 2 * (1 << 31) * 2 / t_copy, "bf16_flops_per_s": 2 * 8192**3 / t_mm}


class Pool:
    """One big random K and V buffer; each config views its prefix (no per-config allocation)."""

    def __init__(self, numel: int) -> None:
        self.k = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
        self.v = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()

    def view(self, B: int, KVH: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = B * KVH * N * D
        return self.k[:n].view(B, KVH, N, D), self.v[:n].view(B, KVH, N, D)


def make_case(pool: Pool, H: int, KVH: int, B: int, prefix: int, Lq: int, slot: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ob = (prefix * (0.75 + 0.5 * torch.rand(B, generator=g))).round().long()
    S = int(-(-int(ob.max()) // 128) * 128)
    N = S + Lq
    k_all, v_all = pool.view(B, KVH, N)
    q = torch.randn(B, H, Lq, D, dtype=torch.bfloat16, device="cuda")
    kt, vt = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, N, KVH, D] views
    ob_dev = ob.to("cuda")
    vis_win = sum(min(Lq, (i // slot + 1) * slot) for i in range(Lq))
    vis_keys = int(ob.sum()) * Lq + B * vis_win
    return dict(
        H=H, KVH=KVH, B=B, prefix=prefix, Lq=Lq, slot=slot, S=S, N=N, ob=ob_dev, q=q, k_all=k_all, v_all=v_all,
        ours_args=PackedArgs(q.transpose(1, 2), kt[:, :S], vt[:, :S], ob_dev, kt[:, S:], vt[:, S:], BlockCausal(slot),
                             scale=D**-0.5),
        bytes=(int(ob.sum()) + B * Lq) * KVH * D * 2 * 2 + 2 * B * Lq * H * D * 2,
        flops=4 * D * H * vis_keys,
    )


def block_mask_for(c: dict):
    from torch.nn.attention.flex_attention import create_block_mask

    ob, S, slot = c["ob"], c["S"], c["slot"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < ob[b]) | ((kv_idx >= S) & ((kv_idx - S) // slot <= q_idx // slot))

    return create_block_mask(mask_mod, c["B"], None, c["Lq"], c["N"], device="cuda")


def dense_mask(c: dict) -> torch.Tensor:
    kv = torch.arange(c["N"], device="cuda")
    qi = torch.arange(c["Lq"], device="cuda")
    S, slot = c["S"], c["slot"]
    win = (kv[None, :] >= S) & ((kv[None, :] - S) // slot <= (qi[:, None] // slot))
    return (kv[None, None, :] < c["ob"][:, None, None]) | win[None]  # [B, Lq, N]


class Flex:
    """torch.compile'd flex_attention; kernel options that compile for small q_len with GQA on torch 2.11.
    dynamic=False recompiles per shape (static-shape kernels); dynamic=True compiles once with symbolic shapes."""

    OPTIONS = [{"BLOCK_M": 64, "BLOCK_N": 64}, None]

    def __init__(self, dynamic: bool) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 512  # the static one compiles once per config
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = 512
        self.dynamic = dynamic
        self.fn = torch.compile(flex_attention, dynamic=dynamic)
        self.working: dict = {}  # (H, KVH, Lq[, shape]) -> index into OPTIONS that compiled

    def __call__(self, c: dict, bm):
        key = (c["H"], c["KVH"], c["Lq"]) + (() if self.dynamic else (c["B"], c["N"]))
        run = lambda opts: self.fn(c["q"], c["k_all"], c["v_all"], block_mask=bm, enable_gqa=True,  # noqa: E731
                                   kernel_options=opts)
        if key not in self.working:
            for i, opts in enumerate(self.OPTIONS):
                try:
                    run(opts)
                    torch.cuda.synchronize()
                    self.working[key] = i
                    break
                except Exception as e:  # noqa: BLE001 - record and try the next option set
                    label = "dynamic" if self.dynamic else "static"
                    print(f"flex ({label}) {key} options {opts} failed: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
            else:
                self.working[key] = None
        i = self.working[key]
        return None if i is None else (lambda: run(self.OPTIONS[i]))


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3


def bench_graph(fn, label: str) -> float | None:
    """Median time of a CUDA-graph replay of fn (no host launch overhead), or None if capture fails."""
    try:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - fall back to eager timing
        print(f"{label}: graph capture failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        torch.cuda.synchronize()
        return None
    t = bench(graph.replay)
    del graph
    return t


class FlashInfer:
    """FlashInfer's paged prefill (append) wrapper over a paged NHD copy of a config's visible K/V: row b's prefix
    [0, o_b) then its window, FLASHINFER_PAGE tokens a page, pages contiguous. `import flashinfer` failing
    leaves it disabled (one line printed); a backend that fails once (JIT, unsupported mask) is not retried."""

    def __init__(self, backends: list[str]) -> None:
        try:
            import flashinfer
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken install (missing dependency, CUDA)
            print(f"flashinfer not installed: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
            self.fi, self.version = None, None
            return
        self.fi, self.version, self.backends = flashinfer, flashinfer.__version__, backends
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.broken: dict[str, str] = {}  # backend[+mask] -> why it was dropped
        self.compiled: set[str] = set()  # backend[+mask] that ran once

    def cache(self, c: dict) -> dict:
        """The paged copy, page table and (for slot < q_len) the block-causal mask of config c."""
        B, KVH, Lq, S, slot, P = c["B"], c["KVH"], c["Lq"], c["S"], c["slot"], FLASHINFER_PAGE
        ob, dev = c["ob"].tolist(), c["q"].device
        lens = [o + Lq for o in ob]
        pages = [-(-n // P) for n in lens]
        kc = torch.zeros(sum(pages), P, KVH, D, dtype=c["k_all"].dtype, device=dev)
        vc = torch.zeros_like(kc)
        start, masks = 0, []
        for b in range(B):
            for src, dst in ((c["k_all"], kc), (c["v_all"], vc)):
                rows = torch.cat([src[b, :, :ob[b]], src[b, :, S:S + Lq]], dim=1).transpose(0, 1)  # [L_b, KVH, D]
                dst[start:start + pages[b]].view(-1, KVH, D)[:lens[b]] = rows
            start += pages[b]
            if slot < Lq:  # the prefix for every query, the window block-causally: flattened [Lq, L_b] per row
                qi, kj = torch.arange(Lq, device=dev)[:, None], torch.arange(Lq, device=dev)[None, :]
                win = kj // slot <= qi // slot
                masks.append(torch.cat([torch.ones(Lq, ob[b], dtype=torch.bool, device=dev), win], 1).flatten())
        i32 = dict(dtype=torch.int32, device=dev)
        return dict(
            kv=(kc, vc), q=c["q"].transpose(1, 2).reshape(B * Lq, c["H"], D).contiguous(),
            qo_indptr=torch.arange(B + 1, **i32) * Lq,
            kv_indptr=torch.tensor([0] + pages, **i32).cumsum(0, dtype=torch.int32),
            kv_indices=torch.arange(sum(pages), **i32),
            last_page_len=torch.tensor([n - (p - 1) * P for n, p in zip(lens, pages)], **i32),
            mask=torch.cat(masks) if masks else None,
        )

    def runner(self, c: dict, fc: dict, backend: str):
        """A zero-argument call of the planned wrapper, or None where this backend cannot run this config."""
        kind = backend + ("+mask" if fc["mask"] is not None else "")  # e.g. fa3 may lack custom masks only
        if kind in self.broken:
            return None
        t0 = time.time()  # plan() builds or loads the JIT module
        try:
            w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend)
            # positional up to page_size: the head-dim argument was renamed (head_dim -> head_dim_qk) across versions
            w.plan(fc["qo_indptr"], fc["kv_indptr"], fc["kv_indices"], fc["last_page_len"], c["H"], c["KVH"], D,
                   FLASHINFER_PAGE, custom_mask=fc["mask"], causal=False, sm_scale=D**-0.5,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            fn = lambda: w.run(fc["q"], fc["kv"])  # noqa: E731
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - e.g. fa3 without custom masks, or a JIT failure
            why = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"flashinfer {backend}: {why}", flush=True)
            if kind not in self.compiled:  # never ran (with or without a mask): do not pay for it again
                self.broken[kind] = why
            return None
        if kind not in self.compiled:
            first = backend not in {k.split("+")[0] for k in self.compiled}
            self.compiled.add(kind)
            if not first:
                return fn, None
            print(f"flashinfer {backend}: first plan + call (JIT build or load) {time.time() - t0:.1f} s", flush=True)
            return fn, time.time() - t0
        return fn, None


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def run_config(c: dict, ceil: dict, flexes: dict, tile=None, baselines=(), triton_tile=None,
               flashinfer: FlashInfer | None = None) -> dict:
    """Times are CUDA-graph replays (what the engine runs); *_eager_s adds the host launch path. `flexes` maps
    "flex_static" / "flex" (dynamic) to a Flex; `baselines` names the ones to time (BASELINES)."""
    roof = max(c["bytes"] / ceil["hbm_bytes_per_s"], c["flops"] / ceil["bf16_flops_per_s"])
    scale = D**-0.5
    ours = lambda: packed_attention_cuda(c["ours_args"], False, tile=tile)  # noqa: E731
    out = ours()[0]
    r = {k: c[k] for k in ("H", "KVH", "B", "prefix", "Lq", "slot", "S", "bytes", "flops")}
    r.update(tile=[k for k, v in TILES.items() if v == (tile or default_tile(D, c["H"] // c["KVH"] * c["Lq"]))][0],
             roofline_s=roof, hbm_floor_s=c["bytes"] / ceil["hbm_bytes_per_s"],
             bound="memory" if c["bytes"] / ceil["hbm_bytes_per_s"] >= roof else "compute")
    r["ours_eager_s"] = bench(ours)
    r["ours_s"] = bench_graph(ours, "ours") or r["ours_eager_s"]
    r["frac_roofline"] = roof / r["ours_s"]
    r["frac_roofline_eager"] = roof / r["ours_eager_s"]
    rows = c["H"] // c["KVH"] * c["Lq"]
    tt = triton_tile or default_triton_tile(rows)
    tri = lambda: packed_attention_triton_launch(c["ours_args"], False, tile=tt)  # noqa: E731
    r["triton_tile"] = [k for k, v in TRITON_TILES.items() if v == tt][0]
    r["err_triton_vs_ours"] = rel_err(tri()[0], out)
    r["triton_s"] = bench_graph(tri, "triton") or bench(tri)
    r["triton_frac_roofline"] = roof / r["triton_s"]
    r["triton_speedup_vs_ours"] = r["ours_s"] / r["triton_s"]
    if not baselines:
        return r
    bm = block_mask_for(c) if {"flex", "flex_static"} & set(baselines) else None
    # old keys (flex_s, speedup_vs_flex, ...) stay the dynamic=True Flex; the static one is flex_static_*
    for name, pre, sp in (("flex_static", "flex_static_", "_vs_flex_static"), ("flex", "flex_", "_vs_flex")):
        f = flexes[name](c, bm) if name in baselines else None
        if f is None:
            continue
        r["err" + sp] = rel_err(out, f().transpose(1, 2))
        r[pre + "eager_s"] = bench(f)
        r[pre + "s"] = bench_graph(f, name) or r[pre + "eager_s"]
        r["frac_roofline_" + name] = roof / r[pre + "s"]
        r["speedup" + sp] = r[pre + "s"] / r["ours_s"]
        r["speedup" + sp + "_eager"] = r[pre + "eager_s"] / r["ours_eager_s"]
        r["triton_speedup" + sp] = r[pre + "s"] / r["triton_s"]
    del bm
    if "flashinfer" in baselines and flashinfer is not None and flashinfer.fi is not None:
        fc = flashinfer.cache(c)
        for backend in flashinfer.backends:
            got = flashinfer.runner(c, fc, backend)
            if got is None:
                kind = backend + ("+mask" if fc["mask"] is not None else "")
                r[f"flashinfer_{backend}_skipped"] = flashinfer.broken.get(kind, "failed on this config")
                continue
            fn, first = got
            pre = f"flashinfer_{backend}_"
            if first is not None:
                r[pre + "first_call_s"] = first
            r[pre + "err_vs_ours"] = rel_err(fn().view(c["B"], c["Lq"], c["H"], D), out)
            r[pre + "eager_s"] = bench(fn)
            r[pre + "s"] = bench_graph(fn, f"flashinfer {backend}") or r[pre + "eager_s"]
            r[pre + "frac_roofline"] = roof / r[pre + "s"]
            r["speedup_vs_" + pre[:-1]] = r[pre + "s"] / r["ours_s"]
            r["triton_speedup_vs_" + pre[:-1]] = r[pre + "s"] / r["triton_s"]
        best = min((r[f"flashinfer_{b}_s"], b) for b in flashinfer.backends if f"flashinfer_{b}_s" in r) \
            if any(f"flashinfer_{b}_s" in r for b in flashinfer.backends) else None
        if best is not None:
            r["flashinfer_s"], r["flashinfer_backend"] = best
            r["speedup_vs_flashinfer"] = best[0] / r["ours_s"]
            r["triton_speedup_vs_flashinfer"] = best[0] / r["triton_s"]
            r["flashinfer_frac_roofline"] = roof / best[0]
        del fc
    for name, backend in (("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_efficient", "EFFICIENT_ATTENTION")):
        if name in baselines:
            r.update(sdpa_backend(c, name, backend, out))
    if "sdpa" not in baselines:
        return r
    G = c["H"] // c["KVH"]
    sdpa_bytes = c["B"] * c["H"] * c["Lq"] * c["N"] * 4 * 3 + 2 * G * c["B"] * c["KVH"] * c["N"] * D * 2
    if sdpa_bytes <= SDPA_BYTES_LIMIT:
        mask = dense_mask(c)[:, None]
        s = lambda: F.scaled_dot_product_attention(c["q"], c["k_all"], c["v_all"], attn_mask=mask,  # noqa: E731
                                                   scale=scale, enable_gqa=True)
        r["sdpa_s"] = bench_graph(s, "sdpa") or bench(s)
        del mask
    else:
        r["sdpa_skipped"] = f"dense path would need ~{sdpa_bytes / 2**30:.0f} GiB"
    return r


def sdpa_backend(c: dict, name: str, backend: str, out: torch.Tensor) -> dict:
    """SDPA restricted to one backend under the config's boolean mask: {name_s, err_name, frac...} or
    {name_skipped: why}. GQA as enable_gqa, else (a backend that refuses it) K/V expanded to H heads beforehand
    (the copy not timed; name_expanded says so)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = dense_mask(c)[:, None]
    G = c["H"] // c["KVH"]
    r = {}
    for gqa in (True, False):
        k, v = (c["k_all"], c["v_all"]) if gqa else (t.repeat_interleave(G, 1) for t in (c["k_all"], c["v_all"]))

        def run(k=k, v=v, gqa=gqa):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return F.scaled_dot_product_attention(c["q"], k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=gqa)
        try:
            got = run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the backend refuses this form: try the next, else say why
            r[name + "_skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        r.pop(name + "_skipped", None)
        r["err_" + name] = rel_err(got.transpose(1, 2), out)
        r[name + "_s"] = bench_graph(run, name) or bench(run)
        r[name + "_expanded"] = not gqa
        r["triton_speedup_vs_" + name] = r[name + "_s"] / max(r.get("triton_s", 0), 1e-12)
        break
    return r


def grid(quick: bool, batches=BATCHES, prefixes=PREFIXES, qlens=QLENS, w2=True, heads=HEADS, slot=None):
    for H, KVH in heads:
        for B in batches[:2] if quick else batches:
            for prefix in prefixes[:2] if quick else prefixes:
                for Lq in qlens:
                    yield H, KVH, B, prefix, Lq, slot or Lq  # W = 1: slot = q_len (a prefill chunk: --slot)
    if w2:
        for B, prefix in [(8, 4096), (32, 16384)]:  # a few W = 2 points (FlowBlock's default)
            yield 16, 4, B, prefix, 64, 32


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def summarize(rows: list[dict]) -> dict:
    """Old keys (speedup_vs_flex: dynamic=True Flex) kept; *_flex_static is the baseline of record."""
    sp = [r["speedup_vs_flex"] for r in rows if "speedup_vs_flex" in r]
    sp_e = [r["speedup_vs_flex_eager"] for r in rows if "speedup_vs_flex_eager" in r]
    big = [r for r in rows if r["B"] >= 8 and r["prefix"] >= 4096]
    fr = [r["frac_roofline"] for r in big]
    col = lambda key, sel=rows: [r[key] for r in sel if key in r]  # noqa: E731
    return {
        "baseline_of_record": "flex_static (torch.compile(flex_attention, dynamic=False), one compile per shape)",
        "median_speedup_vs_flex": statistics.median(sp) if sp else None,
        "min_speedup_vs_flex": min(sp) if sp else None,
        "median_speedup_vs_flex_eager": statistics.median(sp_e) if sp_e else None,
        "median_speedup_vs_flex_static": _median(col("speedup_vs_flex_static")),
        "min_speedup_vs_flex_static": min(col("speedup_vs_flex_static"), default=None),
        "triton_median_speedup_vs_flex_static": _median(col("triton_speedup_vs_flex_static")),
        "flex_static_over_dynamic_median": _median([r["flex_s"] / r["flex_static_s"] for r in rows
                                                    if "flex_s" in r and "flex_static_s" in r]),
        "median_speedup_vs_flashinfer": _median(col("speedup_vs_flashinfer")),
        "triton_median_speedup_vs_flashinfer": _median(col("triton_speedup_vs_flashinfer")),
        "flashinfer_big_median_frac_roofline": _median(col("flashinfer_frac_roofline", big)),
        "flex_static_big_median_frac_roofline": _median(col("frac_roofline_flex_static", big)),
        "median_frac_roofline": statistics.median(r["frac_roofline"] for r in rows),
        "big_min_frac_roofline": min(fr) if fr else None,
        "big_median_frac_roofline": statistics.median(fr) if fr else None,
        "big_configs_at_40pct": f"{sum(f >= 0.4 for f in fr)}/{len(fr)}",
        "big_memory_bound_at_40pct": f"{sum(r['frac_roofline'] >= 0.4 for r in big if r['bound'] == 'memory')}/"
                                     f"{sum(r['bound'] == 'memory' for r in big)}",
        "max_err_vs_flex": max(col("err_vs_flex"), default=None),
        "max_err_vs_flex_static": max(col("err_vs_flex_static"), default=None),
        "max_err_flashinfer_vs_ours": max((v for r in rows for k, v in r.items()
                                           if k.startswith("flashinfer_") and k.endswith("_err_vs_ours")), default=None),
        "triton_median_frac_roofline": statistics.median(r["triton_frac_roofline"] for r in rows),
        "triton_big_median_frac_roofline": statistics.median(r["triton_frac_roofline"] for r in big) if big else None,
        "triton_median_speedup_vs_ours": statistics.median(r["triton_speedup_vs_ours"] for r in rows),
        "triton_max_err_vs_ours": max(r["err_triton_vs_ours"] for r in rows),
    }


def print_table(rows: list[dict]) -> None:
    """Times in us (graph replays); roof% = roofline / time; x columns = baseline time / ours (CUDA) time."""
    print(f"\n{'H/KVH':6s} {'B':>3s} {'pref':>6s} {'Lq':>4s} {'bl':>3s} {'roof us':>8s} {'ours':>8s} {'triton':>8s} "
          f"{'flexS':>8s} {'flexDyn':>8s} {'flashinf':>8s} {'sdpa':>8s} {'cudnn':>8s} {'effic':>8s} {'xFlexS':>6s} {'xFlexD':>6s} {'xFI':>6s} "
          f"{'roof%':>6s} {'tri%':>6s} {'flxS%':>6s} {'FI%':>6s} {'bound':>5s}")
    for r in rows:
        us = lambda k: f"{r[k] * 1e6:8.1f}" if k in r else f"{'-':>8s}"  # noqa: E731
        x = lambda k: f"{r[k]:6.2f}" if k in r else f"{'-':>6s}"  # noqa: E731
        pct = lambda k: f"{100 * r[k]:6.1f}" if k in r else f"{'-':>6s}"  # noqa: E731
        print(f"{r['H']:>2d}/{r['KVH']:<3d} {r['B']:3d} {r['prefix']:6d} {r['Lq']:4d} {r['slot']:3d} "
              f"{us('roofline_s')} {us('ours_s')} {us('triton_s')} {us('flex_static_s')} {us('flex_s')} "
              f"{us('flashinfer_s')} {us('sdpa_s')} {us('sdpa_cudnn_s')} {us('sdpa_efficient_s')} {x('speedup_vs_flex_static')} {x('speedup_vs_flex')} "
              f"{x('speedup_vs_flashinfer')} {pct('frac_roofline')} {pct('triton_frac_roofline')} "
              f"{pct('frac_roofline_flex_static')} {pct('flashinfer_frac_roofline')} {r['bound'][:3]:>5s}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a quarter of the grid")
    ap.add_argument("--sweep", action="store_true", help="also time every Triton tile on a sub-grid (CUDA default tile beside)")
    ap.add_argument("--tile", choices=list(TILES), help="force one tile instead of the default choice")
    ap.add_argument("--triton-tile", choices=list(TRITON_TILES), help="force one Triton tile")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap.add_argument("--batches", type=ints, help="override the grid's batch sizes, e.g. 8,32,64")
    ap.add_argument("--prefixes", type=ints, help="override the grid's mean prefixes, e.g. 4096,32768")
    ap.add_argument("--qlens", type=ints, help="override the grid's q_len values (W = 2 points dropped)")
    ap.add_argument("--slot", type=int, help="the window's block (default q_len); a prefill chunk: --qlens 4096 --slot 32")
    ap.add_argument("--heads", type=lambda t: [tuple(map(int, h.split("/"))) for h in t.split(",")],
                    help="override the grid's H/KVH pairs, e.g. 16/4 or 16/4,32/8")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help=f"comma-separated subset of {','.join(BASELINES)} ('' for kernels only)")
    ap.add_argument("--no-baselines", action="store_true", help="skip every baseline (same as --baselines '')")
    ap.add_argument("--flashinfer-backends", default="fa2,fa3", help="FlashInfer prefill backends to time")
    ap.add_argument("--budget-s", type=float, default=230.0, help="start no new config after this many seconds")
    args = ap.parse_args()
    baselines = () if args.no_baselines else tuple(b for b in args.baselines.split(",") if b)
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        ap.error(f"unknown baselines {sorted(unknown)}; choose from {','.join(BASELINES)}")
    t0 = time.time()
    dev = torch.cuda.get_device_properties(0)
    ceil = ceilings()
    print(f"{dev.name}: HBM copy {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    heads = args.heads or HEADS
    max_n = int(max(args.prefixes or PREFIXES) * 1.25) + 256 + max(args.qlens or QLENS)
    pool = Pool(max(args.batches or BATCHES) * max(kvh for _, kvh in heads + [(16, 4)]) * (max_n + 64) * D)
    flexes = {"flex_static": Flex(dynamic=False), "flex": Flex(dynamic=True)}
    fi = FlashInfer([b for b in args.flashinfer_backends.split(",") if b]) if "flashinfer" in baselines else None
    tile = TILES[args.tile] if args.tile else None
    result = {
        "device": dev.name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv), "ceilings": ceil, "baselines": list(baselines),
        "flashinfer": (fi.version or "not installed: skipped") if fi else "not requested",
        "summary": {}, "configs": [], "tile_sweep": [], "skipped_for_time": [],
    }
    if fi is not None and fi.fi is not None:
        result["flashinfer_backends"] = fi.backends
    rows, sweep = result["configs"], result["tile_sweep"]

    def save() -> None:
        result["summary"] = summarize(rows) if rows else {}
        result["seconds"] = time.time() - t0
        if fi is not None and fi.fi is not None:
            result["flashinfer_broken"] = fi.broken
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.sweep:
        for H, KVH in heads:
            for B, prefix, Lq in SWEEP_CASES:
                c = make_case(pool, H, KVH, B, prefix, Lq, Lq, seed=B * prefix + Lq)
                for name, t in TRITON_TILES.items():  # each Triton tile, with the default CUDA tile beside it
                    try:
                        sweep.append(run_config(c, ceil, flexes, triton_tile=t))  # kernels only, graph replays
                    except Exception as e:  # noqa: BLE001 - a tile this Triton cannot compile is reported, not fatal
                        print(f"tile {name} H{H} B{B} prefix {prefix}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        result["skipped_for_time"].append(f"tile {name} failed: {type(e).__name__}")
        print("Triton tile sweep (fraction of roofline; CUDA default tile in the same configs):", flush=True)
        for name in TRITON_TILES:
            sel = [r for r in sweep if r["triton_tile"] == name]
            if not sel:
                continue
            fr = [r["triton_frac_roofline"] for r in sel]
            print(f"  {name:9s} median {statistics.median(fr):.3f}  min {min(fr):.3f}  max {max(fr):.3f}  "
                  f"(cuda {statistics.median(r['frac_roofline'] for r in sel):.3f})", flush=True)
        save()
    custom = args.batches or args.prefixes or args.qlens or args.heads
    for H, KVH, B, prefix, Lq, slot in grid(args.quick, args.batches or BATCHES, args.prefixes or PREFIXES,
                                           args.qlens or QLENS, w2=not custom, heads=heads, slot=args.slot):
        if time.time() - t0 > args.budget_s:
            result["skipped_for_time"].append([H, KVH, B, prefix, Lq, slot])
            continue
        c = make_case(pool, H, KVH, B, prefix, Lq, slot, seed=B * prefix + Lq + slot)
        t1 = time.time()
        try:
            rows.append(run_config(c, ceil, flexes, tile=tile, baselines=baselines, flashinfer=fi,
                                   triton_tile=TRITON_TILES[args.triton_tile] if args.triton_tile else None))
            r = rows[-1]
            vs = lambda k: f"x{r[k]:.2f}" if k in r else "-"  # noqa: E731
            print(f"H{H} B{B} P{prefix} L{Lq} bl{slot}: ours {r['ours_s'] * 1e6:.1f} us "
                  f"{100 * r['frac_roofline']:.1f}% roof, {vs('speedup_vs_flex_static')} vs static flex, "
                  f"{vs('speedup_vs_flex')} vs dynamic flex, {vs('speedup_vs_flashinfer')} vs flashinfer; "
                  f"triton {r['triton_s'] * 1e6:.1f} us {100 * r['triton_frac_roofline']:.1f}% roof "
                  f"({time.time() - t1:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - keep the rest of the grid
            print(f"config H{H} B{B} P{prefix} L{Lq} failed: {type(e).__name__}: {e}", flush=True)
        del c
        save()
    save()
    print_table(rows)
    ceil_s = f"HBM {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    print(f"\nceilings: {ceil_s}; skipped for time: {len(result['skipped_for_time'])}; flashinfer: {result['flashinfer']}")
    print("summary:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result["summary"].items()}))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
