// Contract of the CPU selection extension (compiledllm._cpu_select); no libtorch, raw pointers only.
//
// Keys / values, one layer of the full pool, bf16 bits:
//   element [b][h][s][d] at ptr + b*sb + h*sh + s*ss + d      (strides in elements, d contiguous)
//   b < B requests, h < KVH kv heads, s < lengths[b] valid positions, d < D (D % 32 == 0, D <= 256);
//   with `rows`, request b is the pool's entry rows[b] (b replaced by rows[b] above: any entries, in any order, so
//   one call can cover several layers of a stacked pool).
// Queries, bf16 bits: [b][hq][i][d] at q + b*q_sb + hq*q_sh + i*q_sn + d, hq < KVH*G, i < n_q.
//   Query head hq reads kv head hq / G. Inside a kv head the G*n_q rows are r = g*n_q + i.
// Scores are float32 dot products of bf16 values, times scale. Each bf16 product is exact in
// float32; the order of the (rounded) adds is part of the contract, so every path gives the same bits:
//   R = G*n_q < kTransposeMinRows: lane l sums dim pairs (32c + 2l, +1) over chunks c, odd element
//     first (VDPBF16PS's order), then the 16 lanes reduce in a fixed tree (backend_portable.cpp);
//   R >= kTransposeMinRows: one chain over pairs 0 .. D/2-1 in order, even element first, then odd
//     (TDPBF16PS's order in Intel's pseudocode, so AMX can compute it).
// Per (b, h):
//   importance[s] = sum_r exp(score[r][s] - lse[r]),  lse[r] = log sum_s exp(score[r][s])
//   idx  int32 [B][KVH][topk]: the k_b positions of largest importance (ties: lower position
//        first) among the first rank_b, in ascending position order, then -1 up to topk; if
//        k_b >= rank_b, 0..rank_b-1 then -1. k_b = row_topk[b] (<= topk; topk without row_topk),
//        rank_b = rank_lengths[b] (<= lengths[b]; lengths[b] without): the positions past rank_b
//        count in the softmax (importance, out, lse) but are never selected.
//   out  float32 [B][KVH*G][n_q][D]: softmax(score) @ V;  lse float32 [B][KVH*G][n_q].
// Results do not depend on the thread count, and both dispatch paths give the same idx and lse.
#pragma once
#include <cstdint>
#include <string>

namespace cllm {

struct SelectArgs {
  const uint16_t* k = nullptr;  // bf16 bits
  const uint16_t* v = nullptr;  // may be null when out == nullptr
  int64_t k_sb = 0, k_sh = 0, k_ss = 0;
  int64_t v_sb = 0, v_sh = 0, v_ss = 0;
  int64_t B = 0, KVH = 0, D = 0;
  const int64_t* lengths = nullptr;  // [B]
  const uint16_t* q = nullptr;       // bf16 bits
  int64_t q_sb = 0, q_sh = 0, q_sn = 0;
  int64_t G = 1, n_q = 1;
  float scale = 1.f;
  int64_t topk = 0;        // used only when idx != nullptr: idx's row length
  const int64_t* row_topk = nullptr;      // [B] optional: each request's k (<= topk)
  const int64_t* rank_lengths = nullptr;  // [B] optional: positions a request ranks (<= lengths)
  const int64_t* rows = nullptr;  // [B] optional: request b reads the pool's entry rows[b] (k + rows[b] * k_sb)
  int32_t* idx = nullptr;  // optional outputs
  float* out = nullptr;
  float* lse = nullptr;
  int threads = 0;   // 0: OpenMP default
  int prefetch = 0;  // software prefetch distance in 16-key tiles (0: hardware prefetch only)
  bool prefetch_l2 = false;  // prefetch into L2 (prefetcht1) rather than L1
  int64_t score_budget = 0;  // floats of score rows held at once (0: kWaveFloatsPerThread per thread)
};

// dst bf16 [2][B][KVH][topk][D] (K then V; without k, [1][B][KVH][topk][D]: V alone), one contiguous block for
// one host-to-device copy.
// Row i of (b, h) is row idx[b][h][i] of the pool; idx < 0 gives a zero row.
struct GatherArgs {
  const uint16_t* k = nullptr;  // null: values only
  const uint16_t* v = nullptr;
  int64_t k_sb = 0, k_sh = 0, k_ss = 0;
  int64_t v_sb = 0, v_sh = 0, v_ss = 0;
  int64_t B = 0, KVH = 0, D = 0;
  const int32_t* idx = nullptr;  // [B][KVH][topk]
  const int64_t* rows = nullptr;  // [B] optional: request b reads the pool's entry rows[b], as in SelectArgs
  int64_t topk = 0;
  uint16_t* dst = nullptr;
  int threads = 0;
};

// One namespace per instruction set; the same algorithm is compiled into each.
namespace avx512 {
// Same bits, speed differs by CPU; kAmxInexact is a mode only: AMX tiles even where the self-check found other bits
enum DotForm : int { kFma = 0, kVdpbf16ps = 1, kAmx = 2, kAmxInexact = 3 };
struct AmxStatus {
  bool compiled = false;  // built with the AMX intrinsics
  bool cpu = false;       // cpuid and XCR0 offer AMX-BF16 tiles (palette 1)
  bool os = false;        // the OS granted this process the tile data state
  bool checked = false;   // the start-up self-check ran
  bool passed = false;    // every AMX score had the contract's bits: AMX is used for many-row tiles
  std::string selfcheck;  // its outcome in words
  std::string reason;     // why AMX is not used ("" when it is)
};
bool compiled();  // false when the compiler or target cannot build the AVX-512-BF16 path
void select(const SelectArgs& a);
void gather(const GatherArgs& a);
uint64_t read_probe(const uint8_t* p, int64_t bytes, int threads);
// Seconds for iters x 12 instructions per thread; kind 0: VDPBF16PS, 1: FMA, 2: TDPBF16PS (AMX active only)
double compute_probe(int kind, int64_t iters, int threads);
// -1: auto (AMX for many rows when active, else the faster of FMA / VDPBF16PS, measured once);
// kFma / kVdpbf16ps: that form everywhere; kAmx: AMX for many rows (needs amx_status().passed), auto otherwise;
// kAmxInexact: AMX for many rows wherever the OS grants the tiles (scores may differ from the other paths in the
// last bit, so positions may differ at near-ties: an explicit opt-in, never chosen by auto).
void set_dot(int mode);
int dot_form(bool many_rows);      // the DotForm select() uses for R >= kTransposeMinRows or fewer rows
const AmxStatus& amx_status();     // probed once per process (runs the self-check)
// One tile's scores s[R][16] (for tests): keys k + j * ks (j < n <= 16), query rows q + r * D.
void score_probe(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c, float* s, int form);
}  // namespace avx512
namespace portable {
void select(const SelectArgs& a);
void gather(const GatherArgs& a);
uint64_t read_probe(const uint8_t* p, int64_t bytes, int threads);
void score_probe(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c, float* s);
}  // namespace portable

}  // namespace cllm
