"""Fused CPU KV selection (HERALD IV-B4): exact attention + per-KV-head top-k, and the gather.

Contract (the C++ extension compiledllm._cpu_select and cpu_select_ref.select_ref share it):

    q        [B, Hq, n_q, D]   bf16 (float32 is rounded to bf16), CPU, last dim contiguous
    k_cache  [B, KVH, S, D]    bf16, CPU, last dim contiguous, any other strides (a view of the
    v_cache  [B, KVH, S, D]    full pool [request][kv_head][position][head_dim] for one layer)
    lengths  [B]               valid positions per request, 0 <= lengths[b] <= S
    topk     int               per-(request, kv head) budget k, or [B] ints: request b's own k_b (idx rows are
                               max k_b long, -1 past k_b)
    rank_lengths [B] optional  positions request b ranks (<= lengths[b]): the rest count in the softmax only

    G = Hq // KVH (1..8); query head hq reads kv head hq // G; D in {32, 64, 96, ..., 256}.
    score[r, s] = scale * (q_r . k_s) in float32 over bf16 values, rows r = (g, i) of one kv head.
    importance[s] = sum_r softmax_s(score)[r, s]  (one ranking per kv head, HERALD's s_hat)

    topk_idx [B, KVH, topk] int32: positions of the topk largest importances among the first
             rank_lengths[b] (default: lengths[b]) (exact ties: lower position first), ascending;
             when topk >= that: 0..rank-1, then -1.
    out      [B, Hq, n_q, D] float32: softmax(score) @ V, exact attention over the valid prefix.
    lse      [B, Hq, n_q] float32: log-sum-exp of the scores (-inf for an empty prefix).

Selection only (want_output=False) reads keys only. Results do not depend on `threads`, and
the AVX-512-BF16 and portable paths return identical topk_idx and lse on the same data: the order of
the float32 adds in each score is fixed (ext/cpu_select.h), and every dot-product form (FMA,
VDPBF16PS, and AMX tiles for G*n_q >= 16 rows where a start-up self-check finds them bit-identical)
follows it. The form is each call's argument (`dot_form`, DOT_FORMS), never a setting left behind.
gather() copies the selected rows into one contiguous [2, B, KVH, topk, D] bf16 buffer
(K then V; zero rows for -1), pinned when CUDA is available, ready for one H2D copy per layer.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["SelectResult", "select", "gather", "read_probe", "isa", "cpu_features", "extension_available",
           "amx_status", "DOT_FORMS"]

MAX_G, MAX_NQ = 8, 64
# How the AVX-512 path forms bf16 dot products (the same bits in every form): 'fma', 'vdpbf16ps' (slow on some
# CPUs), 'amx' (tiles for 16 or more query rows per KV head; needs amx_status()['active']; fewer rows take the auto
# form) or 'auto' (AMX where active, else the faster of the other two, measured once per process). 'amx_inexact' is
# the one form outside the contract: AMX tiles wherever the OS grants them, even where the self-check found this
# CPU's TDPBF16PS rounding differently (the H200 host's does), so its scores may differ in the last bit and its
# positions at near-ties. The portable path ignores the form.
DOT_FORMS = ("auto", "fma", "vdpbf16ps", "amx", "amx_inexact")


@dataclass(frozen=True)
class SelectResult:
    topk_idx: torch.Tensor | None  # [B, KVH, topk] int32
    out: torch.Tensor | None  # [B, Hq, n_q, D] float32
    lse: torch.Tensor | None  # [B, Hq, n_q] float32
    path: str = "torch"  # "avx512bf16", "portable" or "torch" (the reference)


def _ext():
    try:
        from compiledllm import _cpu_select
    except ImportError as e:  # pragma: no cover - depends on the build
        raise ImportError(
            "compiledllm._cpu_select is not built: run `pip install -e .` "
            "(or `python setup.py build_ext --inplace`) with a C++17 compiler and OpenMP"
        ) from e
    return _cpu_select


def extension_available() -> bool:
    try:
        _ext()
    except ImportError:
        return False
    return True


def isa() -> str:
    """The instruction-set path select() takes by default: 'avx512bf16' or 'portable'."""
    return _ext().isa()


def cpu_features(dot_form: str = "auto") -> dict[str, bool | str]:
    """CPU and build features, the AMX entries of amx_status() (prefixed amx_), and the dot-product
    forms select(..., dot_form=dot_form) uses: 'dot' for fewer than 16 query rows per KV head,
    'dot_many_rows' for 16 or more."""
    with _dot(dot_form):
        return dict(_ext().cpu_features())


def amx_status() -> dict[str, bool | str]:
    """Whether select() scores many-row tiles with AMX: 'cpu' (cpuid/XCR0), 'os' (tile state granted),
    'selfcheck' (the start-up bit-identity check, in words), 'active', and 'reason' when not."""
    f = cpu_features()
    return {"cpu": f["amx_bf16"], "os": f["amx_os"], "selfcheck": f.get("amx_selfcheck", "not run"),
            "active": f["amx_active"], "reason": f["amx_reason"]}


# The extension keeps the form in one process-wide slot (ext/module.cpp set_dot). Each call sets the slot to its own
# form and holds it for the call: calls with the same form run concurrently, one with another form waits for them.
_dot_cond = threading.Condition()
_dot_set: str | None = None  # the slot's form (None: not set by this module yet)
_dot_users = 0  # calls running with it


@contextmanager
def _dot(form: str) -> Iterator[None]:
    """Hold the extension's dot-product form at `form` (one of DOT_FORMS) for a call: ValueError for an unknown
    form, RuntimeError for one this CPU lacks (the extension's messages)."""
    global _dot_set, _dot_users
    with _dot_cond:
        while _dot_users and _dot_set != form:
            _dot_cond.wait()
        if _dot_set != form:
            _ext().set_dot(form)  # checks the form first: on an error the slot is unchanged
            _dot_set = form
        _dot_users += 1
    try:
        yield
    finally:
        with _dot_cond:
            _dot_users -= 1
            if not _dot_users:
                _dot_cond.notify_all()


def _score_tile(keys: torch.Tensor, q: torch.Tensor, c: float, form: str) -> torch.Tensor:
    """Test hook: [R, 16] float32 scores c * (q . k) of one tile of n <= 16 keys ([n, D] bf16, rows
    strided, last dim contiguous) against q [R, D] bf16, by form 'portable', 'fma', 'vdpbf16ps' or
    'amx'. R picks the scheme as in select(); columns >= n are unspecified."""
    if keys.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or keys.dim() != 2 or q.dim() != 2 \
            or keys.shape[1] != q.shape[1] or keys.stride(1) != 1:
        raise ValueError("keys [n, D] and q [R, D] must be bfloat16 with the same D, last dim contiguous")
    q = q.contiguous()
    out = torch.empty((q.shape[0], 16), dtype=torch.float32)
    _ext().score_tile(keys.data_ptr(), keys.stride(0), keys.shape[0], keys.shape[1], q.data_ptr(), q.shape[0],
                      float(c), out.data_ptr(), form)
    return out


def _check_cache(name: str, t: object, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [B, KVH, S, D], got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (as k_cache), got {tuple(t.shape)}")
    if t.shape[3] > 1 and t.stride(3) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}")
    if min(t.stride()) < 0:
        raise ValueError(f"{name} must not have negative strides")
    return t


def _check_head_dim(D: int) -> None:
    if D % 32 or not 32 <= D <= 256:
        raise ValueError(f"k_cache head_dim must be a multiple of 32 in [32, 256], got {D}")


def _check_threads(threads: int) -> None:
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError(f"threads must be an int >= 0 (0 = all), got {threads!r}")


def _lengths(lengths: torch.Tensor | Sequence[int], B: int, S: int) -> torch.Tensor:
    t = _per_request_ints("lengths", lengths, B)
    if B and int(t.max()) > S:
        raise ValueError(f"lengths must lie in [0, S={S}], got min {int(t.min())}, max {int(t.max())}")
    return t


def _per_request_ints(name: str, x: torch.Tensor | Sequence[int], B: int) -> torch.Tensor:
    """[B] int64 >= 0 on the CPU, contiguous (what the extension reads)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
        t = x.detach().to("cpu", torch.int64).reshape(-1).contiguous()
    else:
        try:
            t = torch.tensor([int(v) for v in x], dtype=torch.int64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be an int, a tensor or a sequence of ints: {e}") from None
    if t.numel() != B:
        raise ValueError(f"{name} must have B={B} entries, got {t.numel()}")
    if B and int(t.min()) < 0:
        raise ValueError(f"{name} must lie in [0, ...), got min {int(t.min())}")
    return t


def _check_query(q: object, B: int, KVH: int, D: int) -> torch.Tensor:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.device.type != "cpu":
        raise ValueError(f"q must be on the CPU, got {q.device}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q must be bfloat16 or float32, got {q.dtype}")
    if q.dim() != 4 or q.shape[0] != B or q.shape[3] != D:
        raise ValueError(f"q must be [B={B}, Hq, n_q, D={D}], got shape {tuple(q.shape)}")
    Hq, n_q = q.shape[1], q.shape[2]
    if Hq % KVH or not 1 <= Hq // KVH <= MAX_G:
        raise ValueError(f"q heads ({Hq}) must be G * KVH ({KVH}) with 1 <= G <= {MAX_G}")
    if not 1 <= n_q <= MAX_NQ:
        raise ValueError(f"q must have 1..{MAX_NQ} query tokens (dim 2), got {n_q}")
    q = q.to(torch.bfloat16)
    return q if q.stride(3) == 1 else q.contiguous()


def select(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    lengths: torch.Tensor | Sequence[int],
    topk: int | torch.Tensor | Sequence[int] | None,
    *,
    rank_lengths: torch.Tensor | Sequence[int] | None = None,
    scale: float | None = None,
    want_output: bool = True,
    want_lse: bool = True,
    threads: int = 0,
    portable: bool = False,
    prefetch: int = 1,
    prefetch_l2: bool = True,
    dot_form: str = "auto",
    rows: torch.Tensor | Sequence[int] | None = None,
    _score_budget: int = 0,
) -> SelectResult:
    """One layer for a batch (see the module docstring). topk=None skips the selection;
    want_output=False skips V (selection only); portable=True forces the portable path;
    prefetch is a software prefetch distance in 16-key tiles (0: hardware prefetch only), into L2
    with prefetch_l2; the default (1 tile, L2) was the fastest on the H200 host. dot_form: how the
    AVX-512 path forms dot products (DOT_FORMS). None of these changes results (but 'amx_inexact').
    rows [B] (optional): request b reads k_cache[rows[b]] (and v_cache's), without a copy: the caches are then a
    pool of any number of entries (several layers of a stacked pool, say), and q, lengths, ... have B = len(rows)."""
    k_cache = _check_cache("k_cache", k_cache)
    B, KVH, S, D = k_cache.shape
    pool_rows = _pool_rows(rows, B)
    B = B if pool_rows is None else pool_rows.numel()
    _check_head_dim(D)
    if want_output:
        if v_cache is None:
            raise ValueError("v_cache is required when want_output=True")
        v_cache = _check_cache("v_cache", v_cache, tuple(k_cache.shape))
    q = _check_query(q, B, KVH, D)
    lens = _lengths(lengths, B, S)
    row_topk = None
    if topk is not None and not isinstance(topk, int):  # one k per request
        row_topk = _per_request_ints("topk", topk, B)
        topk = int(row_topk.max()) if B else 0
    if topk is not None and (isinstance(topk, bool) or topk < 0):
        raise ValueError(f"topk must be an int >= 0, [B] ints >= 0 or None, got {topk!r}")
    ranks = None
    if rank_lengths is not None:
        ranks = _per_request_ints("rank_lengths", rank_lengths, B)
        if bool((ranks > lens).any()):
            raise ValueError(f"rank_lengths must not exceed lengths, got {ranks.tolist()} > {lens.tolist()}")
    if topk is None and not want_output and not want_lse:
        raise ValueError("nothing requested: give topk, want_output=True or want_lse=True")
    scale = float(D) ** -0.5 if scale is None else float(scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    _check_threads(threads)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    Hq, n_q = q.shape[1], q.shape[2]
    idx = torch.empty((B, KVH, topk), dtype=torch.int32) if topk is not None else None
    out = torch.empty((B, Hq, n_q, D), dtype=torch.float32) if want_output else None
    lse = torch.empty((B, Hq, n_q), dtype=torch.float32) if want_lse else None
    v = v_cache if want_output else None
    with _dot(dot_form):
        path = _ext().select(
            k_cache.data_ptr(), v.data_ptr() if v is not None else 0,
            k_cache.stride()[:3], v.stride()[:3] if v is not None else (0, 0, 0),
            B, KVH, D, lens.data_ptr(), q.data_ptr(), q.stride()[:3], Hq // KVH, n_q, scale,
            topk if topk is not None else 0,
            idx.data_ptr() if idx is not None else 0,
            out.data_ptr() if out is not None else 0,
            lse.data_ptr() if lse is not None else 0,
            threads, portable, prefetch, bool(prefetch_l2), _score_budget,
            row_topk.data_ptr() if row_topk is not None else 0, ranks.data_ptr() if ranks is not None else 0,
            pool_rows.data_ptr() if pool_rows is not None else 0,
        )
    return SelectResult(idx, out, lse, path)


def _pool_rows(rows: torch.Tensor | Sequence[int] | None, entries: int) -> torch.Tensor | None:
    """select / gather's `rows`: [B] int64 in [0, entries), contiguous on the CPU (or None)."""
    if rows is None:
        return None
    t = _per_request_ints("rows", rows, len(rows))
    if t.numel() and int(t.max()) >= entries:
        raise ValueError(f"rows must lie in [0, {entries}) (the caches' entries), got max {int(t.max())}")
    return t


def gather(
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    pin_memory: bool | None = None,
    threads: int = 0,
    portable: bool = False,
    rows: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Copy the selected rows into out [2, B, KVH, topk, D] bf16 (K then V; k_cache None: [1, ...], V alone); -1
    gives zeros. out is allocated (pinned when CUDA is available, unless pin_memory says otherwise) if None.
    rows [B] (optional): request b reads the caches' entry rows[b] (as in select)."""
    if k_cache is not None:
        k_cache = _check_cache("k_cache", k_cache)
    v_cache = _check_cache("v_cache", v_cache, None if k_cache is None else tuple(k_cache.shape))
    B, KVH, S, D = v_cache.shape
    pool_rows = _pool_rows(rows, B)
    B = B if pool_rows is None else pool_rows.numel()
    _check_head_dim(D)
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype != torch.int32:
        raise TypeError(f"topk_idx must be int32, got {topk_idx.dtype}")
    if topk_idx.device.type != "cpu" or topk_idx.dim() != 3 or tuple(topk_idx.shape[:2]) != (B, KVH):
        raise ValueError(f"topk_idx must be a CPU tensor [B={B}, KVH={KVH}, topk], got {tuple(topk_idx.shape)}")
    topk_idx = topk_idx.contiguous()
    k = topk_idx.shape[2]
    if topk_idx.numel() and int(topk_idx.max()) >= S:
        raise ValueError(f"topk_idx holds position {int(topk_idx.max())} >= S={S}")
    shape = (1 if k_cache is None else 2, B, KVH, k, D)
    if out is None:
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        out = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != shape \
            or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous CPU bfloat16 tensor of shape {shape}")
    _check_threads(threads)
    _ext().gather(
        0 if k_cache is None else k_cache.data_ptr(), v_cache.data_ptr(),
        v_cache.stride()[:3] if k_cache is None else k_cache.stride()[:3], v_cache.stride()[:3],
        B, KVH, D, topk_idx.data_ptr(), k, out.data_ptr(), threads, portable,
        pool_rows.data_ptr() if pool_rows is not None else 0,
    )
    return out


def read_probe(buf: torch.Tensor, threads: int = 0) -> int:
    """Read a contiguous CPU tensor once with all threads (sequential read bandwidth probe)."""
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError("buf must be a contiguous CPU tensor")
    _check_threads(threads)
    return int(_ext().read_probe(buf.data_ptr(), buf.numel() * buf.element_size(), threads))
