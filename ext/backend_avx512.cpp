// AVX-512-BF16 path: scores with VDPBF16PS over a transposed 16-key tile (lanes = keys), so one
// tile yields a 16-score vector per query row; values accumulate with float32 FMAs; gather uses
// streaming stores. Built with a target pragma so the rest of the package needs no -mavx512 flags.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <vector>

#include "cpu_select.h"
#include "select_plan.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLLM_HAVE_AVX512 1
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
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
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

static inline V vexp2(V xin) {
  const __m512 x = xin.v;
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(xc, magic), magic);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 y = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 7; ++i) y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(kExpP[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  const __m512 r = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(y), e));
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ), r)};
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Lane reductions of per-key partial sums (lane l of key j: dims 32c + 2l, +1 over chunks c).
// red1: two keys -> [a0+a2, b0+b2, a1+a3, b1+b3] per 128-bit lane; red2: two red1 results -> the
// 4 keys' per-128-bit-lane sums; red34: four red2 results -> 16 full sums in key order.
static inline __m512 red1(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 red2(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline __m512 red34(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c2, c3, 0x88), _mm512_shuffle_f32x4(c2, c3, 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

// Few rows: rows [r0, r1) against 16 keys: keys are loaded once per row block and kept in registers two at
// a time; the query chunk is the second VDPBF16PS operand (from L1). DC = D / 32.
template <int DC>
static inline void score_rows(const uint16_t* k, int64_t ks, int n, const uint16_t* q, int r0, int r1, float c,
                              float* s, __m512* red) {
  for (int m = 0; m < 8; ++m) {
    __m512i k0[DC], k1[DC];
    const int j0 = 2 * m, j1 = 2 * m + 1;
    for (int cc = 0; cc < DC; ++cc) {
      k0[cc] = j0 < n ? _mm512_loadu_si512(k + j0 * ks + cc * 32) : _mm512_setzero_si512();
      k1[cc] = j1 < n ? _mm512_loadu_si512(k + j1 * ks + cc * 32) : _mm512_setzero_si512();
    }
    for (int r = r0; r < r1; ++r) {
      const uint16_t* qr = q + r * DC * 32;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      for (int cc = 0; cc < DC; ++cc) {
        const __m512bh qv = as_bh(_mm512_loadu_si512(qr + cc * 32));
        a0 = _mm512_dpbf16_ps(a0, as_bh(k0[cc]), qv);
        a1 = _mm512_dpbf16_ps(a1, as_bh(k1[cc]), qv);
      }
      red[(r - r0) * 8 + m] = red1(a0, a1);
    }
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int r = r0; r < r1; ++r) {
    const __m512* b = red + (r - r0) * 8;
    const __m512 sum = red34(red2(b[0], b[1]), red2(b[2], b[3]), red2(b[4], b[5]), red2(b[6], b[7]));
    _mm512_storeu_ps(s + r * kTile, _mm512_mul_ps(sum, vc));
  }
}

template <int DC>
static inline void score_tile_dc(const uint16_t* k, int64_t ks, int n, const uint16_t* q, int R, float c, float* s,
                                 __m512* red) {
  for (int r0 = 0; r0 < R; r0 += kScoreRowBlock)
    score_rows<DC>(k, ks, n, q, r0, std::min(R, r0 + kScoreRowBlock), c, s, red);
}

// In-register transpose of 16 rows x 16 dwords (r[i][c] -> r[c][i]).
static inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int a = 0; a < 8; ++a) {
    t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
  }
  for (int b = 0; b < 4; ++b) {
    u[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // u[4b+c] lane L = column 4L+c of rows 4b..4b+3
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88),
                  w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// Many rows: transpose the tile once (lanes = keys, one dword = one dim pair), then every row is
// P broadcast-VDPBF16PS in two chains (even / odd pairs) with no horizontal reduction.
template <int NR>
static inline void score_rows_t(const __m512i* kt, int P, const uint32_t* qp, float c, float* s) {
  __m512 a0[NR], a1[NR];
  for (int i = 0; i < NR; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
  for (int p = 0; p < P; p += 2) {
    const __m512bh k0 = as_bh(kt[p]), k1 = as_bh(kt[p + 1]);
    for (int i = 0; i < NR; ++i) {
      a0[i] = _mm512_dpbf16_ps(a0[i], k0, as_bh(_mm512_set1_epi32(int(qp[i * P + p]))));
      a1[i] = _mm512_dpbf16_ps(a1[i], k1, as_bh(_mm512_set1_epi32(int(qp[i * P + p + 1]))));
    }
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(s + i * kTile, _mm512_mul_ps(_mm512_add_ps(a0[i], a1[i]), vc));
}

static void score_tile_transposed(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c,
                                  float* s, __m512i* kt) {
  const int P = D / 2;
  for (int blk = 0; blk < P / 16; ++blk) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < n ? _mm512_loadu_si512(k + j * ks + blk * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int x = 0; x < 16; ++x) _mm512_store_si512(kt + blk * 16 + x, r[x]);
  }
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(q);
  int r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) score_rows_t<4>(kt, P, qp + r0 * P, c, s + r0 * kTile);
  for (; r0 < R; ++r0) score_rows_t<1>(kt, P, qp + r0 * P, c, s + r0 * kTile);
}

static void score_tile(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c, float* s,
                       void* tmp) {
  if (R >= kTransposeMinRows) return score_tile_transposed(k, ks, n, D, q, R, c, s, static_cast<__m512i*>(tmp));
  __m512* red = static_cast<__m512*>(tmp);
  switch (D / 32) {
    case 1: score_tile_dc<1>(k, ks, n, q, R, c, s, red); break;
    case 2: score_tile_dc<2>(k, ks, n, q, R, c, s, red); break;
    case 3: score_tile_dc<3>(k, ks, n, q, R, c, s, red); break;
    case 4: score_tile_dc<4>(k, ks, n, q, R, c, s, red); break;
    case 5: score_tile_dc<5>(k, ks, n, q, R, c, s, red); break;
    case 6: score_tile_dc<6>(k, ks, n, q, R, c, s, red); break;
    case 7: score_tile_dc<7>(k, ks, n, q, R, c, s, red); break;
    default: score_tile_dc<8>(k, ks, n, q, R, c, s, red); break;
  }
}

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
  for (int j = 0; j < n; ++j)
    for (int c0 = 0; c0 < D; c0 += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * vs + c0));
      _mm512_store_ps(vf + j * D + c0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
  int r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) pv_rows<4>(vf, D, n, p + r0 * kTile, o + r0 * D);
  for (; r0 < R; ++r0) pv_rows<1>(vf, D, n, p + r0 * kTile, o + r0 * D);
}

static inline void prefetch_rows(const uint16_t* rows, int64_t stride, int n, int64_t D) {
  for (int j = 0; j < n; ++j)
    for (int64_t b = 0; b < D * 2; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + j * stride) + b, _MM_HINT_T0);
}

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

#include "select_kernel.h"

namespace {
std::mutex g_mu;
Arena g_scores, g_states, g_hists;
}  // namespace

bool compiled() { return true; }

void select(const SelectArgs& a) {
  std::lock_guard<std::mutex> lock(g_mu);
  run_select(a, g_scores, g_states, g_hists);
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
}  // namespace avx512
}  // namespace cllm

#endif
