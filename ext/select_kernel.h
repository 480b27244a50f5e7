// The select() and gather() algorithms, written once over a 16-lane float vector V and a few
// tile primitives. Included inside namespace cllm::<isa> by backend_<isa>.cpp, after these:
//   V vzero(), vset(float), vload(const float*), vstore(float*, V), vadd, vmul,
//   vexp2_rel(V x, float m) (the shared exp2 recipe below), bool vany_gt(V, float), vtail(V, n, fill),
//   float vhmax(V), vhsum(V),
//   score_tile(k, k_ss, n, D, Queries, R, c, s[R][16], tmp, pk, pv)   s = c * (q . k), 16 keys,
//     issuing the prefetches pk, pv (rows of later tiles) along the way,
//   pv_tile(v, v_ss, n, D, p[R][16], R, o[R][D], tmp)       o += p @ v over 16 keys,
//   collect_bucket(imp, n, start, bucket, out), emit_selected(imp, n, start, cut_bits, cut_pos, out),
//   gather_prefetch(row, D), copy_row(dst, src, bytes), zero_row(dst, bytes), store_fence(),
//   thread_enter(R), thread_leave(R)   per-thread set-up around a thread's score_tile calls.
// Every step whose result feeds idx or lse uses the same operations in the same order in both
// paths (no contraction: built with -ffp-contract=off), so both paths select the same positions.
// exp2 recipe (Cephes exp2f, ~2e-7 relative): 2^(x - m) for an integer m is (1 + f*P(f)) * 2^(n - m)
// with n = round(x) (to even) and f = x - n in [-0.5, 0.5], or 0 when n - m < -125. The polynomial
// depends on x only and the scaling is exact, so equal scores give equal probabilities under any
// integer reference m: that is what lets the importance reuse the softmax's probabilities.

constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^d for an integer-valued d <= 0, exact; 0 below -125 (and for -inf).
inline float pow2i(float d) {
  if (!(d >= -125.f)) return 0.f;
  const uint32_t u = uint32_t(int32_t(d) + 127) << 23;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// Grow-only scratch shared by calls (a lock serialises calls): no page faults after warm-up.
struct Arena {
  void* p = nullptr;
  size_t cap = 0;
  template <class T>
  T* get(size_t n) {
    size_t bytes = std::max<size_t>(n * sizeof(T), 64);
    if (bytes > cap) {
      std::free(p);
      cap = (bytes + 4095) & ~size_t(4095);
      p = std::aligned_alloc(4096, cap);
      if (!p) {
        cap = 0;
        throw std::bad_alloc();
      }
    }
    return static_cast<T*>(p);
  }
};

struct AlignedBuf {
  void* p;
  explicit AlignedBuf(size_t bytes) : p(std::aligned_alloc(64, (std::max<size_t>(bytes, 64) + 63) & ~size_t(63))) {}
  ~AlignedBuf() { std::free(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// Per-thread tiles: packed query rows, scores and probabilities of one tile, lane sums, temp.
// q and s have R rounded up to 16 rows (AMX tiles read and write 16 rows); q's extra rows are zero.
struct ThreadBuf {
  AlignedBuf q, qf, qr, s, pr, lv, tmp;
  int64_t q_item = -1;
  ThreadBuf(int64_t R, int64_t D)
      : q(round16(R) * D * 2), qf(R * D * 4), qr(R * D * 2), s(round16(R) * kTile * 4), pr(R * kTile * 4),
        lv(R * kTile * 4), tmp(std::max<int64_t>(kTile * D * 4, kScoreRowBlock * 8 * 64)) {
    std::memset(q.as<uint16_t>() + R * D, 0, (round16(R) - R) * D * 2);
  }
  static int64_t round16(int64_t R) { return (R + 15) & ~int64_t(15); }
  Queries queries() const { return {q.as<uint16_t>(), qf.as<float>(), qr.as<uint32_t>()}; }
};

inline void pack_query_row(const uint16_t* src, int64_t r, int64_t D, ThreadBuf& t) {
  std::memcpy(t.q.as<uint16_t>() + r * D, src, D * 2);
  float* qf = t.qf.as<float>() + r * D;
  for (int64_t d = 0; d < D; ++d) {  // per 32-dim chunk: 16 even elements, then 16 odd
    const uint32_t u = uint32_t(src[d]) << 16;
    std::memcpy(qf + (d / 32) * 32 + (d % 2) * 16 + (d % 32) / 2, &u, 4);
  }
  uint32_t* qr = t.qr.as<uint32_t>() + r * (D / 2);
  for (int64_t p = 0; p < D / 2; ++p) qr[p] = uint32_t(src[2 * p]) << 16 | src[2 * p + 1];
}

inline void pack_queries(const SelectArgs& a, const Item& it, int64_t R, ThreadBuf& t) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / a.n_q, i = r % a.n_q;
    pack_query_row(a.q + it.b * a.q_sb + (it.h * a.G + g) * a.q_sh + i * a.q_sn, r, a.D, t);
  }
}

// Phase A: stream one unit's keys (and values) once; keep the online-softmax state m, l, o of every
// query row, with m an integer reference >= the running max (rescales are exact powers of two). For
// the ranking keep the probabilities 2^(score - m) [R][C] and each tile's m [R][C / kTile].
inline void scan_unit(const SelectArgs& a, const Plan& p, const Unit& u, float* srow, float* st, ThreadBuf& t) {
  const Item& it = p.items[u.item];
  const int64_t R = p.R, D = a.D, C = it.C;
  if (t.q_item != u.item) {
    pack_queries(a, it, R, t);
    t.q_item = u.item;
  }
  float* m = st;
  float* l = st + R;
  float* o = p.want_out ? st + 2 * R : nullptr;
  float* lv = t.lv.as<float>();
  for (int64_t r = 0; r < R; ++r) {
    m[r] = kNegInf;
    vstore(lv + r * kTile, vzero());
  }
  if (o) std::memset(o, 0, sizeof(float) * R * D);
  const int64_t pb = a.rows ? a.rows[it.b] : it.b;  // the pool entry request it.b reads
  const uint16_t* kb = a.k + pb * a.k_sb + it.h * a.k_sh;
  const uint16_t* vb = o ? a.v + pb * a.v_sb + it.h * a.v_sh : nullptr;
  const float c = a.scale * kLog2e;
  const int64_t pf = int64_t(a.prefetch) * kTile;
  float* s = t.s.as<float>();
  float* pr = t.pr.as<float>();
  for (int64_t s0 = u.start; s0 < u.end; s0 += kTile) {
    const int n = int(std::min<int64_t>(kTile, u.end - s0));
    Prefetch pk, pv;  // keys `prefetch` tiles ahead and values one tile less (V(t) is read after K(t))
    if (pf && s0 + pf < u.end)
      pk = Prefetch{kb + (s0 + pf) * a.k_ss, a.k_ss, int(std::min<int64_t>(kTile, u.end - s0 - pf)), a.prefetch_l2};
    if (pf && vb && s0 + pf - kTile < u.end)
      pv = Prefetch{vb + (s0 + pf - kTile) * a.v_ss, a.v_ss, int(std::min<int64_t>(kTile, u.end - s0 - pf + kTile)),
                    a.prefetch_l2};
    score_tile(kb + s0 * a.k_ss, a.k_ss, n, int(D), t.queries(), int(R), c, s, t.tmp.p, pk, pv);
    const int64_t j = s0 - u.start;
    for (int64_t r = 0; r < R; ++r) {
      V x = vload(s + r * kTile);
      if (n < kTile) x = vtail(x, n, kNegInf);
      V lr = vload(lv + r * kTile);
      if (vany_gt(x, m[r])) {  // rescale only when the running max passes m (rare after the first tiles)
        const float mn = std::ceil(vhmax(x));
        const float alpha = pow2i(m[r] - mn);
        m[r] = mn;
        lr = vmul(lr, vset(alpha));
        if (o)
          for (int64_t d = 0; d < D; ++d) o[r * D + d] *= alpha;
      }
      const V e = vexp2_rel(x, m[r]);
      vstore(lv + r * kTile, vadd(lr, e));
      if (srow) {
        vstore(srow + r * C + j, e);
        srow[R * C + r * (C / kTile) + j / kTile] = m[r];
      }
      if (o) vstore(pr + r * kTile, e);
    }
    if (o) pv_tile(vb + s0 * a.v_ss, a.v_ss, n, int(D), pr, int(R), o, t.tmp.as<float>());
  }
  for (int64_t r = 0; r < R; ++r) l[r] = vhsum(vload(lv + r * kTile));
}

// Phase B: merge the units of one (item, row) in position order; write out and lse, keep the
// final max and 1/normaliser for the ranking.
inline void merge_row(const SelectArgs& a, const Plan& p, int64_t item, int64_t r, const float* states,
                      int64_t st_stride, int64_t unit0, float* ml) {
  const Item& it = p.items[item];
  const int64_t R = p.R, D = a.D;
  float M = kNegInf;
  for (int64_t u = 0; u < it.n_units; ++u) M = std::max(M, states[(it.first_unit + u - unit0) * st_stride + r]);
  std::vector<float> w(it.n_units);
  float L = 0.f;
  for (int64_t u = 0; u < it.n_units; ++u) {
    const float* st = states + (it.first_unit + u - unit0) * st_stride;
    w[u] = pow2i(st[r] - M);
    L = L + st[R + r] * w[u];
  }
  const float inv = it.len > 0 ? 1.f / L : 0.f;
  ml[item * 2 * R + r] = M;
  ml[item * 2 * R + R + r] = inv;
  const int64_t row = (it.b * a.KVH + it.h) * R + r;  // == (b*Hq + h*G + g)*n_q + i
  if (a.lse) a.lse[row] = it.len > 0 ? (M + std::log2(L)) * kLn2 : kNegInf;
  if (a.out) {
    float* out = a.out + row * D;
    for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
    for (int64_t u = 0; u < it.n_units; ++u) {
      const float* o = states + (it.first_unit + u - unit0) * st_stride + 2 * R + r * D;
      const float wu = w[u] * inv;
      for (int64_t d = 0; d < D; ++d) out[d] += o[d] * wu;
    }
  }
}

// Phase C: importance[s] = sum_r p[r][s] * (2^(m_tile - M_r) / L_r), written over row 0 of srow,
// and its histogram. The factor is exact (a power of two times 1/L), so exact ties stay exact.
// Positions past the item's rank length get importance 0: with ties to the lower position they rank below every
// position before it, and k < rank of those exist, so none is selected.
inline void importance_unit(const Plan& p, const Unit& u, float* srow, const float* ml, uint16_t* hist) {
  const Item& it = p.items[u.item];
  const int64_t R = p.R, C = it.C, T = C / kTile, n = u.end - u.start, nt = (n + kTile - 1) / kTile;
  const float* M = ml + u.item * 2 * R;
  const float* inv = M + R;
  const float* refs = srow + R * C;
  float w[kMaxChunk / kTile];
  // Row by row (sequential reads; the running sum, row 0, stays in L1), rows added in order.
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < nt; ++t) w[t] = pow2i(refs[r * T + t] - M[r]) * inv[r];
    const float* e = srow + r * C;
    for (int64_t t = 0; t < nt; ++t) {
      const V x = vmul(vload(e + t * kTile), vset(w[t]));
      vstore(srow + t * kTile, r ? vadd(vload(srow + t * kTile), x) : x);
    }
  }
  for (int64_t j = std::max<int64_t>(it.rank - u.start, 0); j < n; ++j) srow[j] = 0.f;
  unit_histogram(srow, n, hist);
}

inline void unit_boundary(const Plan& p, Unit& u, const float* imp) {
  Item& it = const_cast<Item&>(p.items[u.item]);  // each unit writes its own slice of it.bnd
  collect_bucket(imp, u.end - u.start, u.start, uint32_t(it.bucket), it.bnd.data() + u.bnd_off);
}

inline void run_select(const SelectArgs& a, Arena& scores_a, Arena& states_a, Arena& hists_a) {
  const int T = a.threads > 0 ? a.threads : omp_get_max_threads();
  Plan p = make_plan(a, T);
  const int64_t R = p.R;
  const int64_t st_stride = (R * (2 + (p.want_out ? a.D : 0)) + 15) & ~int64_t(15);  // own cache lines
  float* scores = scores_a.get<float>(p.max_score_floats);
  float* states = states_a.get<float>(p.max_wave_units * st_stride);
  uint16_t* hists = hists_a.get<uint16_t>(p.want_topk ? p.max_wave_units * kBuckets : 1);
  std::vector<float> ml(p.items.size() * 2 * R);
#pragma omp parallel num_threads(T)
  {
    ThreadBuf t(R, a.D);
    thread_enter(R);
    for (const Wave& w : p.waves) {
      const int64_t nu = w.unit1 - w.unit0;
#pragma omp for schedule(static)
      for (int64_t x = 0; x < nu; ++x) {
        const Unit& u = p.units[w.unit0 + x];
        float* srow = p.items[u.item].select ? scores + u.slot : nullptr;
        scan_unit(a, p, u, srow, states + x * st_stride, t);
      }
      const int64_t nrows = (w.item1 - w.item0) * R;
#pragma omp for schedule(static)
      for (int64_t x = 0; x < nrows; ++x)
        merge_row(a, p, w.item0 + x / R, x % R, states, st_stride, w.unit0, ml.data());
      if (!p.want_topk) continue;
#pragma omp for schedule(static)
      for (int64_t x = 0; x < nu; ++x) {  // same split as phase A: score rows are still in this core's L2
        const Unit& u = p.units[w.unit0 + x];
        if (p.items[u.item].select) importance_unit(p, u, scores + u.slot, ml.data(), hists + x * kBuckets);
      }
#pragma omp for schedule(dynamic)
      for (int64_t i = w.item0; i < w.item1; ++i) {
        Item& it = p.items[i];
        if (it.select)
          item_bucket(p, it, hists + (it.first_unit - w.unit0) * kBuckets, it.k);
        else
          write_all_positions(a, it);
      }
#pragma omp for schedule(static)
      for (int64_t x = 0; x < nu; ++x) {
        Unit& u = p.units[w.unit0 + x];
        if (p.items[u.item].select) unit_boundary(p, u, scores + u.slot);
      }
#pragma omp for schedule(dynamic)
      for (int64_t i = w.item0; i < w.item1; ++i)
        if (p.items[i].select) item_cutoff(a, p, p.items[i]);
#pragma omp for schedule(static)
      for (int64_t x = 0; x < nu; ++x) {
        const Unit& u = p.units[w.unit0 + x];
        const Item& it = p.items[u.item];
        if (it.select)
          emit_selected(scores + u.slot, u.end - u.start, u.start, it.cut.bits, it.cut.pos,
                        a.idx + (it.b * a.KVH + it.h) * a.topk + u.out_off);
      }
    }
    thread_leave(R);
  }
}

// One tile's scores through the same score_tile, for tests: keys k + j * ks (j < n), rows q + r * D.
inline void probe_tile(const uint16_t* k, int64_t ks, int n, int D, const uint16_t* q, int R, float c, float* s) {
  ThreadBuf t(R, D);
  for (int r = 0; r < R; ++r) pack_query_row(q + int64_t(r) * D, r, D, t);
  thread_enter(R);
  score_tile(k, ks, n, D, t.queries(), R, c, t.s.as<float>(), t.tmp.p, Prefetch{}, Prefetch{});
  thread_leave(R);
  std::memcpy(s, t.s.p, sizeof(float) * R * kTile);
}

// gather: one unit = (K or V, request, kv head, slice of 256 rows); dynamic for uneven slices. Without k, V alone.
inline void run_gather(const GatherArgs& a) {
  constexpr int64_t kSlice = 256, kAhead = 8;
  const int64_t slices = (a.topk + kSlice - 1) / kSlice;
  const int64_t units = (a.k ? 2 : 1) * a.B * a.KVH * slices;
  const int64_t row_bytes = a.D * 2;
  const int T = a.threads > 0 ? a.threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic) num_threads(T)
  for (int64_t x = 0; x < units; ++x) {
    const int64_t sl = x % slices, bh = (x / slices) % (a.B * a.KVH), plane = x / (slices * a.B * a.KVH);
    const int64_t kv = a.k ? plane : 1;
    const int64_t b = bh / a.KVH, h = bh % a.KVH;
    const int64_t pb = a.rows ? a.rows[b] : b;
    const uint16_t* src = kv ? a.v + pb * a.v_sb + h * a.v_sh : a.k + pb * a.k_sb + h * a.k_sh;
    const int64_t ss = kv ? a.v_ss : a.k_ss;
    const int32_t* idx = a.idx + bh * a.topk;
    uint16_t* dst = a.dst + (plane * a.B * a.KVH + bh) * a.topk * a.D;
    const int64_t i0 = sl * kSlice, i1 = std::min(a.topk, i0 + kSlice);
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kAhead < i1 && idx[i + kAhead] >= 0) gather_prefetch(src + idx[i + kAhead] * ss, a.D);
      if (idx[i] >= 0)
        copy_row(dst + i * a.D, src + idx[i] * ss, row_bytes);
      else
        zero_row(dst + i * a.D, row_bytes);
    }
    store_fence();
  }
}
