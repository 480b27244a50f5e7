// AMX scoring of a 16-key tile against R >= kTransposeMinRows query rows (part of
// backend_avx512.cpp, included inside its namespace in a region that adds the amx-tile and
// amx-bf16 targets).
//
// TDPBF16PS C += A.B, per Intel's pseudocode: for each C element, the pairs k of A's row in order,
// A's even element's product added first, then the odd one's, each add rounded to nearest even:
// the many-row order of cpu_select.h. Here A = 16 query rows x 32 dims (the packed rows as they
// are), B = pairs of 16 keys (row k = pair k, lane n = key n: the transposed chunk the other
// many-row forms build too), C = 16 rows x 16 keys of s, accumulated over the D / 32 chunks in order.
// Whether the hardware follows the pseudocode bit for bit is what amx_selfcheck.h finds out.

// GCC declares tileloadd and ldtilecfg without (full) memory operands, so stores they must see are
// made visible with a compiler barrier first.
static inline void compiler_barrier() { __asm__ volatile("" ::: "memory"); }

struct alignas(64) TileConfig {  // ldtilecfg's 64-byte layout
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile state is per thread: every thread that scores loads the config first and releases it after.
// All 8 tiles are 16 rows x 64 bytes: tmm0-3 C, tmm4 B (keys), tmm5-7 A (queries).
static void amx_enter() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  compiler_barrier();
  _tile_loadconfig(&cfg);
}
static void amx_leave() { _tile_release(); }

// kt: the tile's keys as D/2 rows of 16 dwords (pair p of key n at kt[16p + n]); q: bf16 rows
// [R rounded up to 16][D], rows >= R zero; s: [R rounded up to 16][16], rows < R scaled by c.
template <int DC>
static void score_rows_amx(const uint32_t* kt, const uint16_t* q, int R, float c, float* s) {
  constexpr int D = DC * 32;
  constexpr long qs = D * 2;  // query row stride, bytes
  const int nb = (R + 15) / 16;
  compiler_barrier();
  for (int b0 = 0; b0 < nb; b0 += 4) {  // up to 4 C tiles (64 rows) per pass over the key chunks
    const int m = std::min(4, nb - b0);
    const uint16_t* a = q + b0 * 16 * D;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int cc = 0; cc < DC; ++cc) {
      _tile_loadd(4, kt + cc * 256, 64);
      _tile_loadd(5, a + cc * 32, qs);
      _tile_dpbf16ps(0, 5, 4);
      if (m > 1) {
        _tile_loadd(6, a + 16 * D + cc * 32, qs);
        _tile_dpbf16ps(1, 6, 4);
      }
      if (m > 2) {
        _tile_loadd(7, a + 32 * D + cc * 32, qs);
        _tile_dpbf16ps(2, 7, 4);
      }
      if (m > 3) {
        _tile_loadd(5, a + 48 * D + cc * 32, qs);
        _tile_dpbf16ps(3, 5, 4);
      }
    }
    float* o = s + b0 * 16 * kTile;
    _tile_stored(0, o, 64);
    if (m > 1) _tile_stored(1, o + 256, 64);
    if (m > 2) _tile_stored(2, o + 512, 64);
    if (m > 3) _tile_stored(3, o + 768, 64);
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * kTile, _mm512_mul_ps(_mm512_loadu_ps(s + r * kTile), vc));
}

// Peak TDPBF16PS rate, for the report: 12 per iteration into 4 accumulators, per thread.
static double amx_probe(int64_t iters, int threads) {
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    amx_enter();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t it = 0; it < iters; ++it)
      for (int i = 0; i < 3; ++i) {
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 6, 4);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 5, 6);
      }
    amx_leave();
  }
  return omp_get_wtime() - t0;
}
