// Python bindings of compiledllm._cpu_select: raw addresses and strides in, GIL released while the
// kernels run, runtime choice of the instruction-set path. See cpu_select.h for the contract.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "amx_os.h"
#include "cpu_select.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define CLLM_X86 1
#endif

namespace py = pybind11;
using cllm::GatherArgs;
using cllm::SelectArgs;

namespace {

struct Features {
  bool avx512_bf16 = false;
};

Features detect() {
  Features f;
#ifdef CLLM_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return f;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const bool os_zmm = (lo & 0xE6u) == 0xE6u;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM state enabled
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool base = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  f.avx512_bf16 = os_zmm && base && (a & (1u << 5)) && cllm::avx512::compiled();
#endif
  return f;
}

const Features& features() {
  static const Features f = detect();
  return f;
}

bool use_avx512(bool portable) { return !portable && features().avx512_bf16; }

const char* path_name(bool fast) { return fast ? "avx512bf16" : "portable"; }

template <class T>
T* ptr(uintptr_t x) {
  return reinterpret_cast<T*>(x);
}

std::string py_select(uintptr_t k, uintptr_t v, std::array<int64_t, 3> ks, std::array<int64_t, 3> vs, int64_t B,
                      int64_t KVH, int64_t D, uintptr_t lengths, uintptr_t q, std::array<int64_t, 3> qs, int64_t G,
                      int64_t n_q, double scale, int64_t topk, uintptr_t idx, uintptr_t out, uintptr_t lse,
                      int threads, bool portable, int prefetch, bool prefetch_l2, int64_t score_budget,
                      uintptr_t row_topk, uintptr_t rank_lengths, uintptr_t rows) {
  if (D % 32 != 0 || D < 32 || D > 256) throw std::invalid_argument("select: head_dim must be a multiple of 32 in [32, 256]");
  if (G < 1 || n_q < 1 || G * n_q > 4096) throw std::invalid_argument("select: need G >= 1, n_q >= 1, G*n_q <= 4096");
  if (!k || !q || !lengths) throw std::invalid_argument("select: null k, q or lengths");
  if (out && !v) throw std::invalid_argument("select: out needs v");
  if (idx && topk < 0) throw std::invalid_argument("select: topk must be >= 0");
  if (threads < 0 || prefetch < 0) throw std::invalid_argument("select: threads and prefetch must be >= 0");
  SelectArgs a;
  a.k = ptr<const uint16_t>(k);
  a.v = ptr<const uint16_t>(v);
  a.k_sb = ks[0], a.k_sh = ks[1], a.k_ss = ks[2];
  a.v_sb = vs[0], a.v_sh = vs[1], a.v_ss = vs[2];
  a.B = B, a.KVH = KVH, a.D = D;
  a.lengths = ptr<const int64_t>(lengths);
  a.q = ptr<const uint16_t>(q);
  a.q_sb = qs[0], a.q_sh = qs[1], a.q_sn = qs[2];
  a.G = G, a.n_q = n_q;
  a.scale = float(scale);
  a.topk = topk;
  a.row_topk = ptr<const int64_t>(row_topk);
  a.rank_lengths = ptr<const int64_t>(rank_lengths);
  a.rows = ptr<const int64_t>(rows);
  a.idx = ptr<int32_t>(idx);
  a.out = ptr<float>(out);
  a.lse = ptr<float>(lse);
  a.threads = threads;
  a.prefetch = prefetch;
  a.prefetch_l2 = prefetch_l2;
  if (score_budget > 0) a.score_budget = score_budget;
  const bool fast = use_avx512(portable);
  {
    py::gil_scoped_release nogil;
    fast ? cllm::avx512::select(a) : cllm::portable::select(a);
  }
  return path_name(fast);
}

std::string py_gather(uintptr_t k, uintptr_t v, std::array<int64_t, 3> ks, std::array<int64_t, 3> vs, int64_t B,
                      int64_t KVH, int64_t D, uintptr_t idx, int64_t topk, uintptr_t dst, int threads, bool portable,
                      uintptr_t rows) {
  if (!v || !dst || (topk > 0 && !idx)) throw std::invalid_argument("gather: null pointer");  // k null: V alone
  if (D % 32 != 0 || D < 32 || D > 256) throw std::invalid_argument("gather: head_dim must be a multiple of 32 in [32, 256]");
  GatherArgs a;
  a.k = ptr<const uint16_t>(k);
  a.v = ptr<const uint16_t>(v);
  a.k_sb = ks[0], a.k_sh = ks[1], a.k_ss = ks[2];
  a.v_sb = vs[0], a.v_sh = vs[1], a.v_ss = vs[2];
  a.B = B, a.KVH = KVH, a.D = D;
  a.idx = ptr<const int32_t>(idx);
  a.rows = ptr<const int64_t>(rows);
  a.topk = topk;
  a.dst = ptr<uint16_t>(dst);
  a.threads = threads;
  const bool fast = use_avx512(portable);
  {
    py::gil_scoped_release nogil;
    fast ? cllm::avx512::gather(a) : cllm::portable::gather(a);
  }
  return path_name(fast);
}

const char* form_name(int form) {
  return form == cllm::avx512::kAmx ? "amx" : form == cllm::avx512::kVdpbf16ps ? "vdpbf16ps" : "fma";
}

// Why AMX is not used, including the case the AVX-512 path itself is not (AMX runs inside it).
std::string amx_reason() {
  if (!features().avx512_bf16) return "the AVX-512-BF16 path is not available here";
  return cllm::avx512::amx_status().reason;
}

void py_score_tile(uintptr_t k, int64_t k_stride, int n, int64_t D, uintptr_t q, int R, double c, uintptr_t out,
                   const std::string& form) {
  if (D % 32 != 0 || D < 32 || D > 256)
    throw std::invalid_argument("score_tile: head_dim must be a multiple of 32 in [32, 256]");
  if (n < 1 || n > 16 || R < 1 || R > 4096)
    throw std::invalid_argument("score_tile: need 1 <= n <= 16 and 1 <= R <= 4096");
  if (!k || !q || !out) throw std::invalid_argument("score_tile: null pointer");
  const auto* kp = ptr<const uint16_t>(k);
  const auto* qp = ptr<const uint16_t>(q);
  float* s = ptr<float>(out);
  if (form == "portable") {
    py::gil_scoped_release nogil;
    return cllm::portable::score_probe(kp, k_stride, n, int(D), qp, R, float(c), s);
  }
  int f;
  if (form == "fma") f = cllm::avx512::kFma;
  else if (form == "vdpbf16ps") f = cllm::avx512::kVdpbf16ps;
  else if (form == "amx") f = cllm::avx512::kAmx;
  else throw std::invalid_argument("score_tile: form must be 'portable', 'fma', 'vdpbf16ps' or 'amx'");
  if (!features().avx512_bf16) throw std::runtime_error("score_tile: the AVX-512-BF16 path is not available here");
  if (f == cllm::avx512::kAmx && !cllm::avx512::amx_status().passed)
    throw std::runtime_error("score_tile: AMX is not active: " + amx_reason());
  py::gil_scoped_release nogil;
  cllm::avx512::score_probe(kp, k_stride, n, int(D), qp, R, float(c), s, f);
}

uint64_t py_read_probe(uintptr_t p, int64_t bytes, int threads, bool portable) {
  py::gil_scoped_release nogil;
  return use_avx512(portable) ? cllm::avx512::read_probe(ptr<const uint8_t>(p), bytes, threads)
                              : cllm::portable::read_probe(ptr<const uint8_t>(p), bytes, threads);
}

}  // namespace

PYBIND11_MODULE(_cpu_select, m) {
  m.doc() = "Fused CPU attention + per-KV-head top-k selection and gather (see compiledllm.kv.cpu_select).";
  m.def("select", &py_select, py::arg("k"), py::arg("v"), py::arg("k_strides"), py::arg("v_strides"), py::arg("B"),
        py::arg("KVH"), py::arg("D"), py::arg("lengths"), py::arg("q"), py::arg("q_strides"), py::arg("G"),
        py::arg("n_q"), py::arg("scale"), py::arg("topk"), py::arg("idx"), py::arg("out"), py::arg("lse"),
        py::arg("threads") = 0, py::arg("portable") = false, py::arg("prefetch") = 0,
        py::arg("prefetch_l2") = false, py::arg("score_budget") = 0, py::arg("row_topk") = 0,
        py::arg("rank_lengths") = 0, py::arg("rows") = 0, "One layer for a batch; addresses as ints, strides in elements. Returns the path used.");
  m.def("gather", &py_gather, py::arg("k"), py::arg("v"), py::arg("k_strides"), py::arg("v_strides"), py::arg("B"),
        py::arg("KVH"), py::arg("D"), py::arg("idx"), py::arg("topk"), py::arg("dst"), py::arg("threads") = 0,
        py::arg("portable") = false, py::arg("rows") = 0,
        "Copy selected K and V rows into dst [2][B][KVH][topk][D] (k = 0: V alone, [1][B]...). Returns the path used.");
  m.def("read_probe", &py_read_probe, py::arg("ptr"), py::arg("nbytes"), py::arg("threads") = 0,
        py::arg("portable") = false, "Read nbytes once with all threads (a bandwidth probe); returns a checksum.");
  m.def("compute_probe", [](int kind, int64_t iters, int threads) {
    if (!features().avx512_bf16) throw std::runtime_error("compute_probe needs AVX-512-BF16");
    if (kind == 2 && !cllm::avx512::amx_status().passed) throw std::runtime_error("compute_probe: AMX is not active");
    if (kind < 0 || kind > 2) throw std::invalid_argument("compute_probe: kind must be 0, 1 or 2");
    py::gil_scoped_release nogil;
    return cllm::avx512::compute_probe(kind, iters, threads);
  }, py::arg("kind"), py::arg("iters"), py::arg("threads") = 1,
        "Seconds for iters x 12 VDPBF16PS (kind 0), FMA (1) or TDPBF16PS (2, AMX) per thread on `threads` threads.");
  m.def("set_dot", [](const std::string& mode) {
    int m;
    if (mode == "auto") m = -1;
    else if (mode == "fma") m = cllm::avx512::kFma;
    else if (mode == "vdpbf16ps") m = cllm::avx512::kVdpbf16ps;
    else if (mode == "amx") m = cllm::avx512::kAmx;
    else if (mode == "amx_inexact") m = cllm::avx512::kAmxInexact;
    else throw std::invalid_argument("set_dot: mode must be 'auto', 'fma', 'vdpbf16ps', 'amx' or 'amx_inexact'");
    if (m == cllm::avx512::kAmx && (!features().avx512_bf16 || !cllm::avx512::amx_status().passed))
      throw std::runtime_error("set_dot: AMX is not active: " + amx_reason());
    const cllm::avx512::AmxStatus& st = cllm::avx512::amx_status();
    if (m == cllm::avx512::kAmxInexact && (!features().avx512_bf16 || !st.compiled || !st.os))
      throw std::runtime_error("set_dot: AMX tiles are not available here: " + amx_reason());
    cllm::avx512::set_dot(m);
  }, py::arg("mode"), "Dot-product form of the AVX-512 path (results are identical; speed differs by CPU). "
        "'amx' applies to many-row tiles (fewer rows then take the auto form); 'amx_inexact' uses the tiles even where "
        "the self-check found other bits (positions may then differ from the portable path at near-ties).");
  m.def("score_tile", &py_score_tile, py::arg("k"), py::arg("k_stride"), py::arg("n"), py::arg("D"), py::arg("q"),
        py::arg("R"), py::arg("c"), py::arg("out"), py::arg("form"),
        "Test hook: scores out[R][16] = c * (q . k) of one 16-key tile (n valid keys) by the given form.");
  m.def("isa", []() { return std::string(path_name(use_avx512(false))); }, "The path used unless portable=True.");
  m.def("cpu_features", []() {
    py::dict d;
    const cllm::AmxSupport& amx = cllm::amx_support();
    d["avx512_bf16"] = features().avx512_bf16;
    d["avx512_compiled"] = cllm::avx512::compiled();
    d["amx_bf16"] = amx.cpu;  // cpuid and XCR0
    d["amx_os"] = amx.os;     // the OS granted the tile state
    if (features().avx512_bf16) {
      const cllm::avx512::AmxStatus& st = cllm::avx512::amx_status();
      d["amx_compiled"] = st.compiled;
      d["amx_selfcheck"] = st.selfcheck;
      d["amx_active"] = st.passed;
      d["dot"] = form_name(cllm::avx512::dot_form(false));
      d["dot_many_rows"] = form_name(cllm::avx512::dot_form(true));
    } else {
      d["amx_active"] = false;
    }
    d["amx_reason"] = amx_reason();
    return d;
  }, "CPU and build features, the AMX status (self-check outcome, why not active) and the dot forms in use.");
}
