// Start-up self-check of the AMX scoring (part of backend_avx512.cpp, in the AMX target region after
// amx_score.h): score_rows_amx against an FMA emulation of the contract's many-row order on a few
// thousand dot products, bit for bit. AMX is used only where every bit agrees; where they differ,
// the outcome says which other order the hardware's results match, if any.
// (Standard headers come from the including file: this one sits inside a namespace.)

static inline float amx_bf(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Orders the adds of a pair could take: 0 the contract's (even, then odd, each rounded: two FMAs,
// the products being exact); 1 and 2 only name what the hardware does instead if it differs.
constexpr int kAmxOrders = 3;
constexpr const char* kAmxOrderNames[kAmxOrders] = {"even-then-odd", "odd-then-even", "pair-sum-first"};
static float amx_chain(const uint16_t* k, const uint16_t* q, int D, int order) {
  float a = 0.f;
  for (int d = 0; d < D; d += 2) {
    const float ke = amx_bf(k[d]), qe = amx_bf(q[d]), ko = amx_bf(k[d + 1]), qo = amx_bf(q[d + 1]);
    if (order == 0) a = std::fma(ko, qo, std::fma(ke, qe, a));
    if (order == 1) a = std::fma(ke, qe, std::fma(ko, qo, a));
    if (order == 2) a = a + (ke * qe + ko * qo);
  }
  return a;
}

struct AmxCheck {
  int64_t compared = 0, differ = 0;
  int64_t explained[kAmxOrders] = {};  // differing results that order i reproduces
  std::string first;                   // the first difference
};

static inline uint64_t amx_next(uint64_t& x) {  // xorshift64
  x ^= x << 13, x ^= x >> 7, x ^= x << 17;
  return x;
}

// A normal bf16 value: random sign and mantissa, exponent within +-spread binades of 1.
static inline uint16_t amx_random_bf16(uint64_t& x, int spread) {
  const uint64_t r = amx_next(x);
  const uint32_t e = uint32_t(127 - spread) + uint32_t((r >> 8) % uint64_t(2 * spread + 1));
  return uint16_t(((r >> 40) & 0x8000u) | (e << 7) | (r & 0x7Fu));
}

static inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// One 16-key tile against R rows. cancel: in half the pairs the odd product is minus the even one,
// so adding them one at a time loses the running sum's low bits where a fused pair would not.
template <int DC>
static void amx_check_tile(int R, int spread, bool cancel, uint64_t seed, AmxCheck& ck) {
  constexpr int D = DC * 32, P = DC * 16;
  const int R16 = (R + 15) & ~15;
  std::vector<uint16_t> k(16 * D), q(size_t(R16) * D, 0);
  std::vector<uint32_t> kt(size_t(P) * 16);
  std::vector<float> s(size_t(R16) * kTile);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : k) v = amx_random_bf16(x, spread);
  for (int i = 0; i < R * D; ++i) q[i] = amx_random_bf16(x, spread);
  for (int p = 0; cancel && p < P; ++p) {
    if (amx_next(x) & 1) continue;
    for (int j = 0; j < 16; ++j) k[j * D + 2 * p + 1] = uint16_t(k[j * D + 2 * p] ^ 0x8000u);
    for (int r = 0; r < R; ++r) q[r * D + 2 * p + 1] = q[r * D + 2 * p];
  }
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < 16; ++j) kt[p * 16 + j] = uint32_t(k[j * D + 2 * p]) | uint32_t(k[j * D + 2 * p + 1]) << 16;
  amx_enter();
  score_rows_amx<DC>(kt.data(), q.data(), R, 1.f, s.data());
  amx_leave();
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 16; ++j) {
      const float got = s[r * kTile + j], want = amx_chain(&k[j * D], &q[r * D], D, 0);
      ++ck.compared;
      if (same_bits(got, want)) continue;
      ++ck.differ;
      for (int o = 1; o < kAmxOrders; ++o) ck.explained[o] += same_bits(got, amx_chain(&k[j * D], &q[r * D], D, o));
      if (ck.first.empty()) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "D=%d spread=%d%s row %d key %d: amx %a, contract %a", D, spread,
                      cancel ? " cancelling" : "", r, j, double(got), double(want));
        ck.first = buf;
      }
    }
}

// A few thousand dot products: D 128 (80 rows: a full 4-tile pass and a single one) and D 256
// (the longest chains), realistic magnitudes, spread over 41 binades, and cancelling pairs.
// Returns the outcome in words; passed when it compared something and found no difference.
static std::string amx_selfcheck(bool& passed) {
  AmxCheck ck;
  uint64_t seed = 1;
  for (int spread : {2, 20})
    for (bool cancel : {false, true}) {
      amx_check_tile<4>(80, spread, cancel, seed++, ck);
      amx_check_tile<8>(32, spread, cancel, seed++, ck);
    }
  passed = ck.compared > 0 && ck.differ == 0;
  std::string d = std::to_string(ck.compared - ck.differ) + " of " + std::to_string(ck.compared) +
                  " dot products bit-identical to the FMA emulation of the contract's order";
  if (passed) return "passed: " + d;
  d = "failed: " + d + "; of the " + std::to_string(ck.differ) + " others";
  for (int o = 1; o < kAmxOrders; ++o)
    d += std::string(o > 1 ? "," : "") + " " + kAmxOrderNames[o] + " matches " + std::to_string(ck.explained[o]);
  return d + "; first: " + ck.first;
}
