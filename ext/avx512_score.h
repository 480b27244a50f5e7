// AVX-512 scoring of a 16-key tile against R query rows (part of backend_avx512.cpp, included
// inside its namespace and target region). Two schemes: few rows reduce per-key lane sums; many
// rows transpose the tile so lanes are keys. Forms of the bf16 dot product, same bits: VDPBF16PS,
// FMA on bf16 widened by shift/mask (faster where VDPBF16PS is slow), and for many rows AMX
// (amx_score.h).

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

static inline void prefetch_row(const uint16_t* row, int64_t D, bool l2) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * 2; b += 64) l2 ? _mm_prefetch(p + b, _MM_HINT_T1) : _mm_prefetch(p + b, _MM_HINT_T0);
}

// VDPBF16PS semantics by FMA: bf16 -> fp32 is a shift (even element) or a mask (odd element);
// products of bf16 values are exact in fp32, so FMA(odd) then FMA(even) equals VDPBF16PS bit for
// bit, and any other order of adds can be reproduced the same way (inputs assumed normal:
// VDPBF16PS flushes denormals). Used where VDPBF16PS is slow.
static inline __m512 bf_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf_odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// Few rows: rows [r0, r1) against 16 keys, two keys at a time in registers; with NR > 0 (exactly
// NR rows) the query chunks stay in registers too (VDPBF16PS form). Prefetches for a later tile
// are spread over the key pairs. DC = D / 32. qf: queries as float, per 32-dim chunk 16 even
// then 16 odd elements.
template <int DC, int NR, bool DP>
static inline void score_rows(const uint16_t* k, int64_t ks, int n, const uint16_t* q, const float* qf, int r0,
                              int r1, float c, float* s, __m512* red, const Prefetch& pf, const Prefetch& pv) {
  __m512i qreg[(NR > 0 && DP) ? NR : 1][DC];
  if (NR > 0 && DP)
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < DC; ++cc) qreg[r][cc] = _mm512_loadu_si512(q + (r0 + r) * DC * 32 + cc * 32);
  for (int m = 0; m < 8; ++m) {
    __m512i k0[DC], k1[DC];
    const int j0 = 2 * m, j1 = 2 * m + 1;
    for (int cc = 0; cc < DC; ++cc) {
      k0[cc] = j0 < n ? _mm512_loadu_si512(k + j0 * ks + cc * 32) : _mm512_setzero_si512();
      k1[cc] = j1 < n ? _mm512_loadu_si512(k + j1 * ks + cc * 32) : _mm512_setzero_si512();
    }
    for (const Prefetch* x : {&pf, &pv})
      if (x->rows) {
        if (j0 < x->n) prefetch_row(x->rows + j0 * x->stride, DC * 32, x->l2);
        if (j1 < x->n) prefetch_row(x->rows + j1 * x->stride, DC * 32, x->l2);
      }
    const int rn = NR > 0 ? NR : r1 - r0;
    if (DP) {
      for (int i = 0; i < rn; ++i) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int cc = 0; cc < DC; ++cc) {
          const __m512bh qv = as_bh(NR > 0 ? qreg[i][cc] : _mm512_loadu_si512(q + (r0 + i) * DC * 32 + cc * 32));
          a0 = _mm512_dpbf16_ps(a0, as_bh(k0[cc]), qv);
          a1 = _mm512_dpbf16_ps(a1, as_bh(k1[cc]), qv);
        }
        red[i * 8 + m] = red1(a0, a1);
      }
    } else {
      __m512 e0[DC], o0[DC], e1[DC], o1[DC];
      for (int cc = 0; cc < DC; ++cc) {
        e0[cc] = bf_even(k0[cc]), o0[cc] = bf_odd(k0[cc]);
        e1[cc] = bf_even(k1[cc]), o1[cc] = bf_odd(k1[cc]);
      }
      for (int i = 0; i < rn; ++i) {
        const float* qr = qf + (r0 + i) * DC * 32;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int cc = 0; cc < DC; ++cc) {
          const __m512 qe = _mm512_loadu_ps(qr + cc * 32), qo = _mm512_loadu_ps(qr + cc * 32 + 16);
          a0 = _mm512_fmadd_ps(o0[cc], qo, a0);
          a0 = _mm512_fmadd_ps(e0[cc], qe, a0);
          a1 = _mm512_fmadd_ps(o1[cc], qo, a1);
          a1 = _mm512_fmadd_ps(e1[cc], qe, a1);
        }
        red[i * 8 + m] = red1(a0, a1);
      }
    }
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int r = r0; r < r1; ++r) {
    const __m512* b = red + (r - r0) * 8;
    const __m512 sum = red34(red2(b[0], b[1]), red2(b[2], b[3]), red2(b[4], b[5]), red2(b[6], b[7]));
    _mm512_storeu_ps(s + r * kTile, _mm512_mul_ps(sum, vc));
  }
}

template <int DC, bool DP>
static inline void score_tile_dc(const uint16_t* k, int64_t ks, int n, const uint16_t* q, const float* qf, int R,
                                 float c, float* s, __m512* red, const Prefetch& pf, const Prefetch& pv) {
  if (DC <= 4) {  // query rows fit in registers (<= 16 zmm)
    switch (R) {
      case 1: return score_rows<DC, 1, DP>(k, ks, n, q, qf, 0, 1, c, s, red, pf, pv);
      case 2: return score_rows<DC, 2, DP>(k, ks, n, q, qf, 0, 2, c, s, red, pf, pv);
      case 3: return score_rows<DC, 3, DP>(k, ks, n, q, qf, 0, 3, c, s, red, pf, pv);
      case 4: return score_rows<DC, 4, DP>(k, ks, n, q, qf, 0, 4, c, s, red, pf, pv);
      default: break;
    }
  }
  for (int r0 = 0; r0 < R; r0 += kScoreRowBlock)
    score_rows<DC, 0, DP>(k, ks, n, q, qf, r0, std::min(R, r0 + kScoreRowBlock), c, s, red,
                          r0 == 0 ? pf : Prefetch{}, r0 == 0 ? pv : Prefetch{});
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
// one chain over the pairs in order, even element first (TDPBF16PS's order; see cpu_select.h), NR
// rows in flight to hide the latency. VDPBF16PS adds a pair's odd element first, so its keys
// (kt) and query dwords (qr) come with the halves swapped: its first add is the even element.
template <int NR, int P>
static inline void score_rows_t(const __m512i* kt, const uint32_t* qr, float c, float* s) {
  __m512 a[NR];
  for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const __m512bh k = as_bh(kt[p]);
    for (int i = 0; i < NR; ++i) a[i] = _mm512_dpbf16_ps(a[i], k, as_bh(_mm512_set1_epi32(int(qr[i * P + p]))));
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(s + i * kTile, _mm512_mul_ps(a[i], vc));
}

// FMA form: kf[2p] / kf[2p+1] = even / odd elements of pair p of the 16 keys as float; the query
// element of pair p is qf[(p / 16) * 32 + p % 16] (even) and 16 further (odd).
template <int NR, int P>
static inline void score_rows_tf(const __m512* kf, const float* qf, float c, float* s) {
  __m512 a[NR];
  for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512 e = kf[2 * p], o = kf[2 * p + 1];
    const float* x = qf + (p / 16) * 32 + p % 16;  // row i at x + i * 2P: constant offsets
    for (int i = 0; i < NR; ++i) {
      a[i] = _mm512_fmadd_ps(e, _mm512_set1_ps(x[i * 2 * P]), a[i]);
      a[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[i * 2 * P + 16]), a[i]);
    }
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(s + i * kTile, _mm512_mul_ps(a[i], vc));
}

template <int DC, int FORM>
static void score_tile_transposed(const uint16_t* k, int64_t ks, int n, const Queries& q, int R, float c, float* s,
                                  void* tmp, const Prefetch& pf, const Prefetch& pv) {
  constexpr int P = DC * 16, D = DC * 32;
  for (const Prefetch* x : {&pf, &pv})
    for (int j = 0; x->rows && j < x->n; ++j) prefetch_row(x->rows + j * x->stride, D, x->l2);
  __m512i* kt = static_cast<__m512i*>(tmp);
  __m512* kf = static_cast<__m512*>(tmp);
  for (int blk = 0; blk < DC; ++blk) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < n ? _mm512_loadu_si512(k + j * ks + blk * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int x = 0; x < 16; ++x) {
      const int pp = blk * 16 + x;
      if (FORM == kAmx) {
        _mm512_store_si512(kt + pp, r[x]);  // TDPBF16PS's B operand as it is
      } else if (FORM == kVdpbf16ps) {
        _mm512_store_si512(kt + pp, _mm512_rol_epi32(r[x], 16));
      } else {
        _mm512_store_ps(kf + 2 * pp, bf_even(r[x]));
        _mm512_store_ps(kf + 2 * pp + 1, bf_odd(r[x]));
      }
    }
  }
  int r0 = 0;
  if (FORM == kAmx) {
    score_rows_amx<DC>(reinterpret_cast<const uint32_t*>(kt), q.q, R, c, s);
  } else if (FORM == kVdpbf16ps) {
    for (; r0 + 8 <= R; r0 += 8) score_rows_t<8, P>(kt, q.qr + r0 * P, c, s + r0 * kTile);
    for (; r0 + 4 <= R; r0 += 4) score_rows_t<4, P>(kt, q.qr + r0 * P, c, s + r0 * kTile);
    for (; r0 < R; ++r0) score_rows_t<1, P>(kt, q.qr + r0 * P, c, s + r0 * kTile);
  } else {
    for (; r0 + 16 <= R; r0 += 16) score_rows_tf<16, P>(kf, q.qf + r0 * D, c, s + r0 * kTile);
    for (; r0 + 8 <= R; r0 += 8) score_rows_tf<8, P>(kf, q.qf + r0 * D, c, s + r0 * kTile);
    for (; r0 + 4 <= R; r0 += 4) score_rows_tf<4, P>(kf, q.qf + r0 * D, c, s + r0 * kTile);
    for (; r0 < R; ++r0) score_rows_tf<1, P>(kf, q.qf + r0 * D, c, s + r0 * kTile);
  }
}

template <int DC, int FORM>
static inline void score_tile_dc_any(const uint16_t* k, int64_t ks, int n, const Queries& q, int R, float c, float* s,
                                     void* tmp, const Prefetch& pf, const Prefetch& pv) {
  if (R >= kTransposeMinRows)
    score_tile_transposed<DC, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv);
  else  // few rows never use AMX (dot_form(false) is FMA or VDPBF16PS)
    score_tile_dc<DC, FORM == kVdpbf16ps>(k, ks, n, q.q, q.qf, R, c, s, static_cast<__m512*>(tmp), pf, pv);
}

template <int FORM>
static void score_tile_form(const uint16_t* k, int64_t ks, int n, int D, const Queries& q, int R, float c, float* s,
                            void* tmp, const Prefetch& pf, const Prefetch& pv) {
  switch (D / 32) {
    case 1: score_tile_dc_any<1, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    case 2: score_tile_dc_any<2, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    case 3: score_tile_dc_any<3, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    case 4: score_tile_dc_any<4, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    case 5: score_tile_dc_any<5, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    case 6: score_tile_dc_any<6, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    case 7: score_tile_dc_any<7, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
    default: score_tile_dc_any<8, FORM>(k, ks, n, q, R, c, s, tmp, pf, pv); break;
  }
}

// The forms of the call in progress (g_form_few / g_form_many, set under the backend's lock).
static void score_tile(const uint16_t* k, int64_t ks, int n, int D, const Queries& q, int R, float c, float* s,
                       void* tmp, const Prefetch& pf, const Prefetch& pv) {
  switch (R >= kTransposeMinRows ? g_form_many : g_form_few) {
    case kAmx: return score_tile_form<kAmx>(k, ks, n, D, q, R, c, s, tmp, pf, pv);
    case kVdpbf16ps: return score_tile_form<kVdpbf16ps>(k, ks, n, D, q, R, c, s, tmp, pf, pv);
    default: return score_tile_form<kFma>(k, ks, n, D, q, R, c, s, tmp, pf, pv);
  }
}
