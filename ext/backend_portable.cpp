// Portable path (any CPU, baseline flags): plain loops over 16-lane arrays that repeat the
// AVX-512 path's arithmetic step for step (two float adds per bf16 pair in the contract's order
// for few or many rows; the same exp2 and reduction trees), so both paths rank positions identically.
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

namespace cllm {
namespace portable {

struct V {
  float v[16];
};
static inline V vzero() { return V{}; }
static inline V vset(float x) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
static inline V vload(const float* p) {
  V r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
static inline void vstore(float* p, V x) { std::memcpy(p, x.v, sizeof(x.v)); }
#define CLLM_LANEWISE(name, expr)          \
  static inline V name(V a, V b) {         \
    V r;                                   \
    for (int i = 0; i < 16; ++i) r.v[i] = expr; \
    return r;                              \
  }
CLLM_LANEWISE(vadd, a.v[i] + b.v[i])
CLLM_LANEWISE(vmul, a.v[i] * b.v[i])
#undef CLLM_LANEWISE
static inline V vtail(V x, int n, float fill) {
  for (int i = n; i < 16; ++i) x.v[i] = fill;
  return x;
}
static inline float vhmax(V x) {
  float m = x.v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, x.v[i]);
  return m;
}
static inline float vhsum(V x) {  // the AVX-512 path's tree
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = x.v[i] + x.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}

static inline bool vany_gt(V x, float m) {
  bool any = false;
  for (int i = 0; i < 16; ++i) any |= x.v[i] > m;
  return any;
}

static inline float exp2_rel_one(float x, float m) {
  const float n = std::nearbyint(x);  // round to nearest even, as VRNDSCALEPS
  const float d = n - m;
  if (!(d >= -125.f)) return 0.f;
  const float f = x - n;
  float y = kExpP[0];
  for (int i = 1; i < 7; ++i) y = y * f + kExpP[i];
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  bits += uint32_t(int32_t(d)) << 23;  // y * 2^d, normal here (as VSCALEFPS)
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
static inline V vexp2_rel(V x, float m) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = exp2_rel_one(x.v[i], m);
  return r;
}

static inline float bf16(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One key's score as the AVX-512 path forms it: lane l sums pairs (32c + 2l, +1) over chunks c
// (odd element first), then lanes reduce as (a0+a2)+(a1+a3) per group of 4, then ((g0+g1)+(g2+g3)).
static inline float dot_bf16(const uint16_t* k, const uint16_t* q, int D) {
  float a[16] = {};
  for (int c = 0; c < D; c += 32)
    for (int l = 0; l < 16; ++l) {
      a[l] = a[l] + bf16(k[c + 2 * l + 1]) * bf16(q[c + 2 * l + 1]);
      a[l] = a[l] + bf16(k[c + 2 * l]) * bf16(q[c + 2 * l]);
    }
  float g[4];
  for (int L = 0; L < 4; ++L) g[L] = (a[4 * L] + a[4 * L + 2]) + (a[4 * L + 1] + a[4 * L + 3]);
  return (g[0] + g[1]) + (g[2] + g[3]);
}

// Many rows (R >= kTransposeMinRows): one chain over the pairs in order, each pair even element
// first (TDPBF16PS's order, which the AVX-512 transposed tiles reproduce).
static inline float dot_bf16_chain(const uint16_t* k, const uint16_t* q, int D) {
  float a = 0.f;
  for (int d = 0; d < D; d += 2) {
    a = a + bf16(k[d]) * bf16(q[d]);
    a = a + bf16(k[d + 1]) * bf16(q[d + 1]);
  }
  return a;
}

static void score_tile(const uint16_t* k, int64_t ks, int n, int D, const Queries& qs, int R, float c, float* s,
                       void*, const Prefetch&, const Prefetch&) {
  const bool chain = R >= kTransposeMinRows;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 16; ++j) {
      if (j >= n) {
        s[r * 16 + j] = 0.f;
        continue;
      }
      const uint16_t* q = qs.q + r * D;
      const float dot = chain ? dot_bf16_chain(k + j * ks, q, D) : dot_bf16(k + j * ks, q, D);
      s[r * 16 + j] = dot * c;
    }
}

static void pv_tile(const uint16_t* v, int64_t vs, int n, int D, const float* p, int R, float* o, float* vf) {
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < D; ++d) vf[j * D + d] = bf16(v[j * vs + d]);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < n; ++j) {
      const float pj = p[r * 16 + j];
      for (int d = 0; d < D; ++d) o[r * D + d] += pj * vf[j * D + d];
    }
}

static inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static int64_t collect_bucket(const float* imp, int64_t n, int64_t start, uint32_t bucket, Boundary* out) {
  Boundary* o = out;
  for (int64_t j = 0; j < n; ++j)
    if ((bits_of(imp[j]) >> kBucketShift) == bucket) *o++ = Boundary{bits_of(imp[j]), int32_t(start + j)};
  return o - out;
}

static int64_t emit_selected(const float* imp, int64_t n, int64_t start, uint32_t cut_bits, int32_t cut_pos,
                             int32_t* out) {
  int32_t* o = out;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t x = bits_of(imp[j]);
    const int32_t pos = int32_t(start + j);
    if (x > cut_bits || (x == cut_bits && pos <= cut_pos)) *o++ = pos;
  }
  return o - out;
}

static inline void gather_prefetch(const uint16_t*, int64_t) {}
static inline void copy_row(uint16_t* dst, const uint16_t* src, int64_t bytes) { std::memcpy(dst, src, bytes); }
static inline void zero_row(uint16_t* dst, int64_t bytes) { std::memset(dst, 0, bytes); }
static inline void store_fence() {}
static inline void thread_enter(int64_t) {}
static inline void thread_leave(int64_t) {}

#include "select_kernel.h"

namespace {
std::mutex g_mu;
Arena g_scores, g_states, g_hists;
}  // namespace

void select(const SelectArgs& a) {
  std::lock_guard<std::mutex> lock(g_mu);
  run_select(a, g_scores, g_states, g_hists);
}

void gather(const GatherArgs& a) { run_gather(a); }

void score_probe(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c, float* s) {
  probe_tile(k, ks, n, D, q, R, c, s);
}

uint64_t read_probe(const uint8_t* p, int64_t bytes, int threads) {
  const int T = threads > 0 ? threads : omp_get_max_threads();
  const int64_t words = bytes / 8;
  uint64_t total = 0;
#pragma omp parallel for schedule(static) num_threads(T) reduction(+ : total)
  for (int64_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    total += w;
  }
  return total;
}

}  // namespace portable
}  // namespace cllm
