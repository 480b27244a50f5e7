// Work plan of one select() call and the scalar top-k steps; compiled once (no SIMD), shared by
// both instruction-set paths so their splits and selections are identical by construction.
#pragma once
#include <cstdint>
#include <vector>

#include "cpu_select.h"

namespace cllm {

constexpr int kTile = 16;             // keys per SIMD tile
constexpr int kMaxChunk = 4096;       // positions per unit, at most
// Default score wave: about one L2 (2 MiB) per thread, so the importance pass re-reads probabilities
// from L2/L3 rather than DRAM (one item, R x length floats, is the least a wave holds).
constexpr int64_t kWaveFloatsPerThread = int64_t(1) << 19;
constexpr int kScoreRowBlock = 32;    // query rows per pass over a key tile (partial sums stay in L1)
constexpr int kTransposeMinRows = 16; // from this many query rows, transpose key tiles (see backends)
constexpr int kBucketShift = 20;      // histogram of importance bits: 8 exponent + 3 mantissa bits
constexpr int kBuckets = 1 << (31 - kBucketShift);
// exp2 on [-0.5, 0.5] (Cephes exp2f): 1 + f*P(f), Horner from kExpP[0]; both paths use it as is.
constexpr float kExpP[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                            5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};

// A chunk of one (request, kv head): the unit of parallel work. Chunk sizes depend on the shapes
// only (never on the thread count), so the arithmetic, and hence the result, is fixed.
struct Unit {
  int32_t item;
  int64_t start, end;  // positions [start, end)
  int64_t slot;        // offset (floats) of its probabilities [R][C] and tile references [R][C / kTile]
  // top-k bookkeeping
  int64_t above = 0, bnd_count = 0, bnd_off = 0, out_off = 0;
};

struct Boundary {  // an importance in the threshold bucket
  uint32_t bits;
  int32_t pos;
};

struct Prefetch {  // rows of a later tile to prefetch while the current one is computed
  const uint16_t* rows = nullptr;
  int64_t stride = 0;
  int n = 0;
  bool l2 = false;  // prefetcht1 (to L2) instead of prefetcht0
};

struct Queries {  // one item's query rows, in the layouts the scoring forms read
  const uint16_t* q;   // bf16 [R][D]
  const float* qf;     // float32 [R][D], per 32-dim chunk 16 even then 16 odd elements
  const uint32_t* qr;  // [R][D / 2] dim pairs with the bf16 halves swapped (odd element low)
};

struct Item {
  int64_t b, h, len, C;
  int64_t k, rank;  // positions to select among the first `rank` (row_topk, rank_lengths)
  int64_t first_unit, n_units;
  bool select;  // needs the importance ranking (0 < k < rank)
  int64_t bucket = 0, need = 0;
  Boundary cut{0, 0};
  std::vector<Boundary> bnd;
};

struct Wave {  // consecutive items whose score rows fit the scratch budget together
  int64_t item0, item1, unit0, unit1, score_floats;
};

struct Plan {
  int64_t R = 0, P = 0;  // query rows per kv head, bf16 pairs per row
  bool want_topk = false, want_out = false;
  std::vector<Item> items;
  std::vector<Unit> units;
  std::vector<Wave> waves;
  int64_t max_score_floats = 0, max_wave_units = 0;
};

Plan make_plan(const SelectArgs& a, int threads);

// Top-k steps on a unit's importance row imp[0 .. end-start).
void unit_histogram(const float* imp, int64_t n, uint16_t* hist);
void item_bucket(Plan& p, Item& it, const uint16_t* hists, int64_t k);  // hists of the item's units
void item_cutoff(const SelectArgs& a, Plan& p, Item& it);  // also pads idx past the item's k with -1
void write_all_positions(const SelectArgs& a, const Item& it);  // k >= rank (or 0)

}  // namespace cllm
