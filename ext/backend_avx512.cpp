// AVX-512-BF16 path: scores by FMA, VDPBF16PS or (many rows, where the start-up self-check passes)
// AMX tiles; values accumulate with float32 FMAs; gather uses streaming stores. Built with target
// pragmas so the rest of the package needs no -mavx512 / -mamx flags.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "amx_os.h"
#include "cpu_select.h"
#include "select_plan.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLLM_HAVE_AVX512 1
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define CLLM_HAVE_AMX 1  // the AMX intrinsics exist (they run only where amx_status() allows)
#endif
#if defined(__GNUC__) && !defined(__clang__)  // GCC 12's _mm512_undefined_* trip these
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#ifdef CLLM_HAVE_AVX512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
#endif

namespace cllm {
namespace avx512 {

struct V {
  __m512 v;
};
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vset(float x) { return {_mm512_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x.v); }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V vtail(V x, int n, float fill) {
  return {_mm512_mask_blend_ps(__mmask16((1u << n) - 1), _mm512_set1_ps(fill), x.v)};
}
static inline float vhmax(V x) { return _mm512_reduce_max_ps(x.v); }
static inline float vhsum(V x) {  // fixed tree: i + i+8, then + i+4, + i+2, + i+1
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(x.v), _mm512_extractf32x8_ps(x.v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

static inline bool vany_gt(V x, float m) { return _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(m), _CMP_GT_OQ) != 0; }

static inline V vexp2_rel(V xin, float m) {
  const __m512 x = xin.v;
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 7; ++i) y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(kExpP[i]));
  const __m512 d = _mm512_sub_ps(n, _mm512_set1_ps(m));
  const __mmask16 ok = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
  return {_mm512_maskz_scalef_ps(ok, y, d)};  // y * 2^d is normal here, so exact
}

#ifdef CLLM_HAVE_AMX
#if defined(__clang__)
#pragma clang attribute push( \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")
#endif
#include "amx_score.h"
#include "amx_selfcheck.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else  // never called: amx_status() reports the path as not compiled
static void amx_enter() {}
static void amx_leave() {}
template <int DC>
static void score_rows_amx(const uint32_t*, const uint16_t*, int, float, float*) {}
static double amx_probe(int64_t, int) { return 0.0; }
static std::string amx_selfcheck(bool& passed) { return passed = false, ""; }
#endif

namespace {
int g_form_few = kFma, g_form_many = kFma;  // the DotForms of the select() call in progress (under g_mu)
}  // namespace

#include "avx512_score.h"

// NR rows x NC 16-float column blocks of o, accumulated over the n keys of the tile.
template <int NR, int NC>
static inline void pv_block(const float* vf, int D, int n, const float* p, float* o) {
  __m512 acc[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int cc = 0; cc < NC; ++cc) acc[i][cc] = _mm512_loadu_ps(o + i * D + cc * 16);
  for (int j = 0; j < n; ++j) {
    __m512 vv[NC];
    for (int cc = 0; cc < NC; ++cc) vv[cc] = _mm512_load_ps(vf + j * D + cc * 16);
    for (int i = 0; i < NR; ++i) {
      const __m512 pb = _mm512_set1_ps(p[i * kTile + j]);
      for (int cc = 0; cc < NC; ++cc) acc[i][cc] = _mm512_fmadd_ps(pb, vv[cc], acc[i][cc]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int cc = 0; cc < NC; ++cc) _mm512_storeu_ps(o + i * D + cc * 16, acc[i][cc]);
}

template <int NR>
static inline void pv_rows(const float* vf, int D, int n, const float* p, float* o) {
  int c0 = 0;
  for (; c0 + 64 <= D; c0 += 64) pv_block<NR, 4>(vf + c0, D, n, p, o + c0);
  for (; c0 < D; c0 += 32) pv_block<NR, 2>(vf + c0, D, n, p, o + c0);  // D % 32 == 0
}

static void pv_tile(const uint16_t* v, int64_t vs, int n, int D, const float* p, int R, float* o, float* vf) {
  for (int j = 0; j < n; ++j) {
    for (int c0 = 0; c0 < D; c0 += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * vs + c0));
      _mm512_store_ps(vf + j * D + c0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
  }
  int r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) pv_rows<4>(vf, D, n, p + r0 * kTile, o + r0 * D);
  for (; r0 < R; ++r0) pv_rows<1>(vf, D, n, p + r0 * kTile, o + r0 * D);
}

// Unit scans of the top-k: rows in the threshold bucket (rare: a scalar tail) and the selected
// positions, in order, by mask compress-store.
static int64_t collect_bucket(const float* imp, int64_t n, int64_t start, uint32_t bucket, Boundary* out) {
  Boundary* o = out;
  const __m512i b = _mm512_set1_epi32(int(bucket));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi32(valid, imp + j);
    unsigned m = _mm512_mask_cmpeq_epi32_mask(valid, _mm512_srli_epi32(x, kBucketShift), b);
    while (m) {
      const int i = __builtin_ctz(m);
      uint32_t bits;
      std::memcpy(&bits, imp + j + i, 4);
      *o++ = Boundary{bits, int32_t(start + j + i)};
      m &= m - 1;
    }
  }
  return o - out;
}

static int64_t emit_selected(const float* imp, int64_t n, int64_t start, uint32_t cut_bits, int32_t cut_pos,
                             int32_t* out) {
  int32_t* o = out;
  const __m512i cb = _mm512_set1_epi32(int(cut_bits)), cp = _mm512_set1_epi32(cut_pos);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi32(valid, imp + j);  // importances >= 0: int order = float order
    const __m512i pos = _mm512_add_epi32(iota, _mm512_set1_epi32(int32_t(start + j)));
    const __mmask16 gt = _mm512_mask_cmpgt_epi32_mask(valid, x, cb);
    const __mmask16 eq = _mm512_mask_cmpeq_epi32_mask(valid, x, cb) & _mm512_cmple_epi32_mask(pos, cp);
    const __mmask16 m = gt | eq;
    _mm512_mask_compressstoreu_epi32(o, m, pos);
    o += __builtin_popcount(unsigned(m));
  }
  return o - out;
}

static void gather_prefetch(const uint16_t* row, int64_t D) { prefetch_row(row, D, false); }

static inline void copy_row(uint16_t* dst, const uint16_t* src, int64_t bytes) {
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(src);
  if ((reinterpret_cast<uintptr_t>(d) & 63) == 0) {  // streaming stores: no read-for-ownership
    for (int64_t b = 0; b < bytes; b += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + b), _mm512_loadu_si512(s + b));
  } else {
    std::memcpy(d, s, bytes);
  }
}
static inline void zero_row(uint16_t* dst, int64_t bytes) { std::memset(dst, 0, bytes); }
static inline void store_fence() { _mm_sfence(); }
static void thread_enter(int64_t R) {  // tile state is per thread
  if (R >= kTransposeMinRows && g_form_many == kAmx) amx_enter();
}
static void thread_leave(int64_t R) {
  if (R >= kTransposeMinRows && g_form_many == kAmx) amx_leave();
}

#include "select_kernel.h"

namespace {
std::mutex g_mu;
Arena g_scores, g_states, g_hists;
}  // namespace

bool compiled() { return true; }

void select(const SelectArgs& a) {
  const int few = dot_form(false), many = dot_form(true);  // calibrate outside the parallel region
  std::lock_guard<std::mutex> lock(g_mu);
  g_form_few = few, g_form_many = many;
  run_select(a, g_scores, g_states, g_hists);
}

void score_probe(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c, float* s, int form) {
  const int few = form == kAmx ? dot_form(false) : form;
  std::lock_guard<std::mutex> lock(g_mu);
  g_form_few = few, g_form_many = form;
  probe_tile(k, ks, n, D, q, R, c, s);
}

void gather(const GatherArgs& a) { run_gather(a); }

uint64_t read_probe(const uint8_t* p, int64_t bytes, int threads) {
  const int T = threads > 0 ? threads : omp_get_max_threads();
  const int64_t lines = bytes / 256;
  uint64_t total = 0;
#pragma omp parallel num_threads(T) reduction(+ : total)
  {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < lines; ++i) {
      const char* x = reinterpret_cast<const char*>(p) + i * 256;
      a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(x));
      a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(x + 64));
      a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(x + 128));
      a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(x + 192));
    }
    total += uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
  }
  return total;
}

// Peak-rate probe: 12 independent accumulator chains per thread (VDPBF16PS or FMA), for the report.
double compute_probe(int kind, int64_t iters, int threads) {
  const int T = threads > 0 ? threads : omp_get_max_threads();
  if (kind == 2) return amx_probe(iters, T);
  const double t0 = omp_get_wtime();
  float sink = 0.f;
#pragma omp parallel num_threads(T) reduction(+ : sink)
  {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
    __m512i x = _mm512_set1_epi32(0x3f803f80);
    const __m512 f = _mm512_set1_ps(0.999f);
    for (int64_t it = 0; it < iters; ++it) {
      if (kind == 0)
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], as_bh(x), as_bh(x));
      else
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], f, f);
      __asm__ volatile("" : "+v"(x));
    }
    __m512 sum = acc[0];
    for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
    sink += _mm512_reduce_add_ps(sum);
  }
  volatile float keep = sink;
  (void)keep;
  return omp_get_wtime() - t0;
}

namespace {
std::atomic<int> g_dot_mode{-1};  // -1 auto, else a DotForm
}  // namespace

static bool measured_dp() {  // per multiply-add: VDPBF16PS does 32, the FMA form 16 + conversions
  static const bool dp = [] {
    const double t_dp = compute_probe(0, 20000, 1), t_fma = compute_probe(1, 20000, 1);
    return 32.0 / t_dp > 1.25 * 16.0 / t_fma;
  }();
  return dp;
}

int dot_form(bool many_rows) {
  const int mode = g_dot_mode.load(std::memory_order_relaxed);
  if (mode == kFma || mode == kVdpbf16ps) return mode;
  if (many_rows && amx_status().passed) return kAmx;  // auto, or kAmx (set only when it passed)
  if (many_rows && mode == kAmxInexact && amx_status().compiled && amx_status().os) return kAmx;
  return measured_dp() ? kVdpbf16ps : kFma;
}

void set_dot(int mode) { g_dot_mode.store(mode < 0 || mode > kAmxInexact ? -1 : mode); }

const AmxStatus& amx_status() {
  static const AmxStatus st = [] {
    AmxStatus s;
    const AmxSupport& sup = amx_support();
#ifdef CLLM_HAVE_AMX
    s.compiled = true;
#endif
    s.cpu = sup.cpu, s.os = sup.os;
    if (!s.compiled) {
      s.reason = "built without the AMX intrinsics (GCC >= 11 or clang >= 12 needed)";
    } else if (!s.os) {
      s.reason = sup.reason;
    } else {
      s.checked = true;
      s.selfcheck = amx_selfcheck(s.passed);
      if (!s.passed) s.reason = "self-check failed: " + s.selfcheck;
    }
    if (!s.checked) s.selfcheck = "not run: " + s.reason;
    return s;
  }();
  return st;
}

}  // namespace avx512
}  // namespace cllm

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no x86-64 GCC/Clang: the portable path only

namespace cllm {
namespace avx512 {
bool compiled() { return false; }
void select(const SelectArgs&) {}
void gather(const GatherArgs&) {}
uint64_t read_probe(const uint8_t*, int64_t, int) { return 0; }
double compute_probe(int, int64_t, int) { return 0.0; }
void set_dot(int) {}
int dot_form(bool) { return kFma; }
const AmxStatus& amx_status() {
  static const AmxStatus s = [] {
    AmxStatus x;
    x.reason = "no AVX-512 path in this build";
    x.selfcheck = "not run: " + x.reason;
    return x;
  }();
  return s;
}
void score_probe(const uint16_t*, int64_t, int, int, const uint16_t*, int, float, float*, int) {}
}  // namespace avx512
}  // namespace cllm

#endif
