// Work split and the exact top-k by histogram threshold: radix bucket of the k-th importance,
// then an nth_element over that bucket only, then every unit writes its positions in order.
#include "select_plan.h"

#include <algorithm>
#include <cstring>

namespace cllm {
namespace {

// Unit length: its score rows stay in L2 (<= 1 MiB) and a long prefix splits into ~16 units.
int64_t chunk_for(int64_t R, int64_t len) {
  int64_t cmax = kMaxChunk;
  while (cmax > 256 && cmax * R * 4 > (int64_t(1) << 20)) cmax /= 2;
  int64_t c = 256;
  while (c < cmax && c * 16 < len) c *= 2;
  return c;
}

inline bool better(const Boundary& x, const Boundary& y) {  // larger importance, then lower position
  return x.bits > y.bits || (x.bits == y.bits && x.pos < y.pos);
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

Plan make_plan(const SelectArgs& a, int threads) {
  Plan p;
  p.R = a.G * a.n_q;
  p.P = a.D / 2;
  p.want_topk = a.idx != nullptr;
  p.want_out = a.out != nullptr;
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t h = 0; h < a.KVH; ++h) {
      Item it;
      it.b = b;
      it.h = h;
      it.len = a.lengths[b];
      it.k = a.row_topk ? a.row_topk[b] : a.topk;
      it.rank = a.rank_lengths ? a.rank_lengths[b] : it.len;
      it.C = chunk_for(p.R, it.len);
      it.first_unit = int64_t(p.units.size());
      it.n_units = (it.len + it.C - 1) / it.C;
      it.select = p.want_topk && it.k > 0 && it.k < it.rank;
      for (int64_t s = 0; s < it.len; s += it.C)
        p.units.push_back(Unit{int32_t(p.items.size()), s, std::min(s + it.C, it.len), 0});
      p.items.push_back(std::move(it));
    }
  }
  // Waves bound the score scratch; items are never split across waves. Waves do not change results.
  const int64_t budget = a.score_budget > 0 ? a.score_budget : threads * kWaveFloatsPerThread;
  Wave w{0, 0, 0, 0, 0};
  for (int64_t i = 0; i < int64_t(p.items.size()); ++i) {
    Item& it = p.items[i];
    const int64_t unit_floats = p.R * (it.C + it.C / kTile);
    int64_t need = p.want_topk ? it.n_units * unit_floats : 0;
    if (w.item1 > w.item0 && w.score_floats + need > budget) {
      p.waves.push_back(w);
      w = Wave{i, i, it.first_unit, it.first_unit, 0};
    }
    for (int64_t u = it.first_unit; u < it.first_unit + it.n_units; ++u) {
      p.units[u].slot = w.score_floats;
      if (p.want_topk) w.score_floats += unit_floats;
    }
    w.item1 = i + 1;
    w.unit1 = it.first_unit + it.n_units;
  }
  if (w.item1 > w.item0) p.waves.push_back(w);
  for (const Wave& x : p.waves) {
    p.max_score_floats = std::max(p.max_score_floats, x.score_floats);
    p.max_wave_units = std::max(p.max_wave_units, x.unit1 - x.unit0);
  }
  return p;
}

void unit_histogram(const float* imp, int64_t n, uint16_t* hist) {
  std::memset(hist, 0, sizeof(uint16_t) * kBuckets);
  for (int64_t j = 0; j < n; ++j) ++hist[bits_of(imp[j]) >> kBucketShift];
}

void item_bucket(Plan& p, Item& it, const uint16_t* hists, int64_t k) {
  std::vector<uint32_t> tot(kBuckets, 0);
  for (int64_t u = 0; u < it.n_units; ++u) {
    const uint16_t* hu = hists + u * kBuckets;
    for (int b = 0; b < kBuckets; ++b) tot[b] += hu[b];
  }
  int64_t cum = 0;
  int b = kBuckets - 1;
  for (; b > 0; --b) {
    if (cum + tot[b] >= k) break;
    cum += tot[b];
  }
  it.bucket = b;
  it.need = k - cum;
  int64_t off = 0;
  for (int64_t u = 0; u < it.n_units; ++u) {
    const uint16_t* hu = hists + u * kBuckets;
    Unit& un = p.units[it.first_unit + u];
    int64_t above = 0;
    for (int x = b + 1; x < kBuckets; ++x) above += hu[x];
    un.above = above;
    un.bnd_count = hu[b];
    un.bnd_off = off;
    off += hu[b];
  }
  it.bnd.resize(off);
}

void item_cutoff(const SelectArgs& a, Plan& p, Item& it) {
  int32_t* pad = a.idx + (it.b * a.KVH + it.h) * a.topk;
  for (int64_t j = it.k; j < a.topk; ++j) pad[j] = -1;  // the units write [0, k)
  std::vector<Boundary> tmp(it.bnd);
  std::nth_element(tmp.begin(), tmp.begin() + (it.need - 1), tmp.end(), better);
  it.cut = tmp[it.need - 1];
  int64_t off = 0;
  for (int64_t u = 0; u < it.n_units; ++u) {
    Unit& un = p.units[it.first_unit + u];
    int64_t in = 0;
    for (int64_t j = 0; j < un.bnd_count; ++j) in += !better(it.cut, it.bnd[un.bnd_off + j]);
    un.out_off = off;
    off += un.above + in;
  }
}

void write_all_positions(const SelectArgs& a, const Item& it) {
  int32_t* out = a.idx + (it.b * a.KVH + it.h) * a.topk;
  const int64_t n = std::min(it.k, it.rank);
  for (int64_t j = 0; j < n; ++j) out[j] = int32_t(j);
  for (int64_t j = n; j < a.topk; ++j) out[j] = -1;
}

}  // namespace cllm
