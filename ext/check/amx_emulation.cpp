// The AMX scoring code (amx_score.h, amx_selfcheck.h) on a CPU without AMX: the tile instructions
// are replaced by a software model of Intel's pseudocode, so the tile layouts, row blocks, padding
// and the self-check's verdict are tested wherever AVX-512-BF16 runs. Not part of the extension;
// tests/test_cpu_select.py builds and runs it.
//   amx_emulation            the pseudocode's order: the self-check must pass, scores must match
//   amx_emulation pair-sum   each pair's two products summed before the add: the self-check must fail
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "select_plan.h"

namespace emu {

struct Tile {
  int rows = 0, colsb = 0;
  uint8_t b[16][64] = {};
};
Tile tmm[8];
bool configured = false, pair_sum = false;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "tile misuse: %s\n", what);
  std::exit(2);
}

void config(const void* p) {
  const uint8_t* c = static_cast<const uint8_t*>(p);
  if (c[0] != 1) fail("palette must be 1");
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * i, 2);
    tmm[i].colsb = colsb, tmm[i].rows = c[48 + i];
    if (colsb > 64 || tmm[i].rows > 16) fail("tile larger than 16 x 64 bytes");
  }
  configured = true;
}
void release() { configured = false; }
Tile& use(int i) {
  if (!configured) fail("tile used without a loaded config");
  return tmm[i];
}
void load(int i, const void* base, long stride) {
  Tile& t = use(i);
  for (int r = 0; r < t.rows; ++r) std::memcpy(t.b[r], static_cast<const char*>(base) + r * stride, t.colsb);
}
void store(int i, void* base, long stride) {
  Tile& t = use(i);
  for (int r = 0; r < t.rows; ++r) std::memcpy(static_cast<char*>(base) + r * stride, t.b[r], t.colsb);
}
void zero(int i) { std::memset(use(i).b, 0, sizeof(Tile::b)); }

float bf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// TDPBF16PS per Intel's pseudocode (products exact; each add rounded), or the pair-sum variant.
void dpbf16ps(int ci, int ai, int bi) {
  Tile &c = use(ci), &a = use(ai), &b = use(bi);
  if (a.colsb / 4 != b.rows || a.rows != c.rows || b.colsb != c.colsb) fail("tile shapes do not chain");
  for (int m = 0; m < c.rows; ++m)
    for (int n = 0; n < c.colsb / 4; ++n) {
      float acc;
      std::memcpy(&acc, c.b[m] + 4 * n, 4);
      for (int k = 0; k < a.colsb / 4; ++k) {
        const float e = bf(a.b[m] + 4 * k) * bf(b.b[k] + 4 * n), o = bf(a.b[m] + 4 * k + 2) * bf(b.b[k] + 4 * n + 2);
        if (pair_sum) {
          acc = acc + (e + o);
        } else {
          acc = acc + e;
          acc = acc + o;
        }
      }
      std::memcpy(c.b[m] + 4 * n, &acc, 4);
    }
}

}  // namespace emu

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) emu::config(cfg)
#define _tile_release() emu::release()
#define _tile_loadd(t, base, stride) emu::load(t, base, stride)
#define _tile_stored(t, base, stride) emu::store(t, base, stride)
#define _tile_zero(t) emu::zero(t)
#define _tile_dpbf16ps(c, a, b) emu::dpbf16ps(c, a, b)

namespace cllm {
namespace avx512 {
#include "amx_score.h"
#include "amx_selfcheck.h"

// Scores of random tiles (n valid keys, the rest zero as the transposed tiles have them) against
// the contract's chain times c; returns the number of differing bits patterns among rows < R.
template <int DC>
int64_t layout_case(int R, int n, uint64_t seed, int64_t& compared) {
  constexpr int D = DC * 32, P = DC * 16;
  const int R16 = (R + 15) & ~15;
  std::vector<uint16_t> k(16 * D, 0), q(size_t(R16) * D, 0);
  std::vector<uint32_t> kt(size_t(P) * 16);
  std::vector<float> s(size_t(R16) * kTile, -1.f);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 7;
  for (int i = 0; i < n * D; ++i) k[i] = amx_random_bf16(x, 3);
  for (int i = 0; i < R * D; ++i) q[i] = amx_random_bf16(x, 3);
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < 16; ++j) kt[p * 16 + j] = uint32_t(k[j * D + 2 * p]) | uint32_t(k[j * D + 2 * p + 1]) << 16;
  const float c = 0.1275f;
  amx_enter();
  score_rows_amx<DC>(kt.data(), q.data(), R, c, s.data());
  amx_leave();
  int64_t bad = 0;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < n; ++j, ++compared)
      bad += !same_bits(s[r * kTile + j], amx_chain(&k[j * D], &q[r * D], D, 0) * c);
  return bad;
}
}  // namespace avx512
}  // namespace cllm

int main(int argc, char** argv) {
  using namespace cllm::avx512;
  emu::pair_sum = argc > 1 && std::string(argv[1]) == "pair-sum";
  bool passed = false;
  std::printf("selfcheck: %s\n", amx_selfcheck(passed).c_str());
  int64_t bad = 0, compared = 0;
  uint64_t seed = 1;
  for (int R : {16, 17, 31, 48, 64, 80, 128, 129})
    for (int n : {16, 1, 9}) {
      bad += layout_case<1>(R, n, seed++, compared);
      bad += layout_case<2>(R, n, seed++, compared);
      bad += layout_case<3>(R, n, seed++, compared);
      bad += layout_case<4>(R, n, seed++, compared);
      bad += layout_case<8>(R, n, seed++, compared);
    }
  std::printf("layout: %lld of %lld scores differ\n", (long long)bad, (long long)compared);
  return 0;
}
