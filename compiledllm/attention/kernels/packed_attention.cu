// Packed block-diffusion attention: each row's KV prefix plus the window's own keys under a mask rule.
//
// Flash-attention style forward on the tensor cores (mma.sync m16n8k16, fp32 accumulate).
// One CTA owns BM query rows of ONE (batch row, KV head): rows are (query i, group head g)
// pairs, i-major, so all G query heads of a KV head share every K/V tile (GQA read once).
// blockIdx.z splits the prefix (flash-decoding) when B * KVH is too small to fill the GPU;
// the last split also covers the window. Splits write fp32 partials + lse, combined by
// packed_attn_combine. Header-free so that NVRTC needs no include paths.
//
// Compile-time configuration (set with -D by cupy_packed.py):
//   IS_BF16 (1 bf16 / 0 fp16), HEAD_DIM (64/128), NWARPS, MTILES (16-row tiles per warp),
//   BLOCK_N (keys per tile), STAGES (cp.async ring depth), QREGS (Q fragments kept in registers),
//   MINBLOCKS (launch-bounds occupancy hint),
//   RULE_GROUPS (1: QueryGroups, window key j visible to query i iff bit group[j] of see[group[i]] is set;
//   0: block-causal by `slot`), PAGED_KV (1: prefix key s of row b is pool row kv_index[b, s] of kc / vc
//   [N, KVH, D]; 0: row b's own cache). Both are defines so that the block-causal dense build is the code it
//   was before them.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

constexpr int D = HEAD_DIM;
constexpr int NW = NWARPS;
constexpr int MT = MTILES;
constexpr int BM = NW * 16 * MT;
constexpr int BN = BLOCK_N;
constexpr int NST = STAGES;
constexpr int THREADS = NW * 32;
constexpr int CHUNKS = D / 8;  // 16-byte chunks per smem row
constexpr int KT = D / 16;     // k-steps of Q K^T
constexpr int NT = BN / 8;     // n-tiles of S
constexpr int DT = D / 8;      // n-tiles of O
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

constexpr int RSTEP = THREADS / CHUNKS;  // K/V rows one pass of the CTA copies
static_assert(BN % 16 == 0 && D % 16 == 0 && NST >= 2, "bad tile config");
static_assert(THREADS % CHUNKS == 0 && BN % RSTEP == 0 && RSTEP % 8 == 0, "bad load split");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float fmax2(float a, float b) { return a > b ? a : b; }
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// XOR swizzle of 16-byte chunks within each group of 8 so that ldmatrix rows hit distinct banks.
__device__ __forceinline__ u32 swz(int row, int chunk) {
  return (u32)(row * D * 2 + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0: zero-fill (masked keys must not carry NaN garbage into P V)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
#if IS_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> packed 16-bit pair, `lo` in the low half (the lower column / address).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if IS_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

extern "C" __global__ void __launch_bounds__(THREADS, MINBLOCKS)
packed_attn_fwd(const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                const u16* __restrict__ kw, const u16* __restrict__ vw,
                const void* __restrict__ prefix_len, int prefix_is64,
                u16* __restrict__ out, float* __restrict__ lse,
                float* __restrict__ ws_o, float* __restrict__ ws_lse,
                int B, int Lq, int H, int KVH, int S, int slot, int nsplit, float scale_log2,
                i64 q_sb, i64 q_st, i64 q_sh, i64 kc_sb, i64 kc_st, i64 kc_sh,
                i64 vc_sb, i64 vc_st, i64 vc_sh, i64 kw_sb, i64 kw_st, i64 kw_sh,
                i64 vw_sb, i64 vw_st, i64 vw_sh,
                const int* __restrict__ group, i64 grp_sb, const int* __restrict__ see,
                const void* __restrict__ kv_index, int idx_is64, i64 idx_sb) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH, split = blockIdx.z;
  const int G = H / KVH, rows = G * Lq, row0 = blockIdx.x * BM;

  int ob = prefix_is64 ? (int)((const i64*)prefix_len)[b] : ((const int*)prefix_len)[b];
  ob = ob < 0 ? 0 : (ob > S ? S : ob);

  // This split's share of the prefix, in whole tiles, proportional to the row's own o_b.
  const int ntp = (ob + BN - 1) / BN;
  const int per = (ntp + nsplit - 1) / nsplit;
  const int t_lo = min(ntp, split * per), t_hi = min(ntp, t_lo + per);
  const int p_lo = t_lo * BN, p_hi = min(ob, t_hi * BN);
  const int n_pre = t_hi - t_lo;
  // The window goes to the last split, up to the end of the last slot any row here can see (groups: all of it).
  int n_win_keys = 0;
  if (split == nsplit - 1) {
#if RULE_GROUPS
    n_win_keys = Lq;
#else
    const int imax = (min(row0 + BM, rows) - 1) / G;
    n_win_keys = min(Lq, (imax / slot + 1) * slot);
#endif
  }
  const int ntiles = n_pre + (n_win_keys + BN - 1) / BN;

  const u32 sQ = smem_u32(smem);
  const u32 sKV = sQ + BM * D * 2;  // stage s: K at sKV + s*2*BN*D*2, V right after
  constexpr u32 TILE_BYTES = BN * D * 2;

  // Q tile (rows past G*Lq zero-filled).
  {
    const u16* qb = q + b * q_sb + (i64)(kvh * G) * q_sh;
    for (int c = tid; c < BM * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS, ch = c % CHUNKS, gr = row0 + r;
      const bool ok = gr < rows;
      const int i = ok ? gr / G : 0, g = ok ? gr % G : 0;
      cp_async16(sQ + swz(r, ch), qb + i * q_st + g * q_sh + ch * 8, ok);
    }
    cp_async_commit();
  }

  // K/V tile loads: thread tid copies chunk ld_c of rows ld_r + j * RSTEP (row & 7 fixed, so the
  // swizzled smem offset only moves by whole rows).
  const int ld_r = tid / CHUNKS, ld_c = tid % CHUNKS;
  const u32 ld_off = swz(ld_r, ld_c);
  auto load_tile = [&](int t, int stage) {
#if PAGED_KV
    if (t < n_pre) {  // pool rows through kv_index (unit last stride), 64-bit: a pool may pass 2^31 elements
      const int p0 = p_lo + t * BN;
      const i64 ib = (i64)b * idx_sb + p0 + ld_r;
      const u16* kb = kc + kvh * kc_sh + ld_c * 8;
      const u16* vb = vc + kvh * vc_sh + ld_c * 8;
      const u32 sK = sKV + stage * 2 * TILE_BYTES, sV = sK + TILE_BYTES;
#pragma unroll
      for (int j = 0; j < BN / RSTEP; ++j) {
        const bool ok = p0 + ld_r + j * RSTEP < p_hi;
        const i64 row = !ok ? 0
                        : idx_is64 ? ((const i64*)kv_index)[ib + j * RSTEP]
                                   : (i64)((const int*)kv_index)[ib + j * RSTEP];
        cp_async16(sK + ld_off + j * RSTEP * D * 2, kb + row * kc_st, ok);
        cp_async16(sV + ld_off + j * RSTEP * D * 2, vb + row * vc_st, ok);
      }
      return;
    }
#endif
    const u16 *kb, *vb;
    i64 kst, vst;
    int valid;
    if (t < n_pre) {
      const int p0 = p_lo + t * BN;
      valid = p_hi - p0;
      kb = kc + b * kc_sb + kvh * kc_sh + p0 * kc_st;
      vb = vc + b * vc_sb + kvh * vc_sh + p0 * vc_st;
      kst = kc_st;
      vst = vc_st;
    } else {
      const int w0 = (t - n_pre) * BN;
      valid = n_win_keys - w0;
      kb = kw + b * kw_sb + kvh * kw_sh + w0 * kw_st;
      vb = vw + b * vw_sb + kvh * vw_sh + w0 * vw_st;
      kst = kw_st;
      vst = vw_st;
    }
    const u32 sK = sKV + stage * 2 * TILE_BYTES, sV = sK + TILE_BYTES;
    const u16* kp = kb + ld_r * kst + ld_c * 8;
    const u16* vp = vb + ld_r * vst + ld_c * 8;
#pragma unroll
    for (int j = 0; j < BN / RSTEP; ++j) {
      const bool ok = ld_r + j * RSTEP < valid;
      cp_async16(sK + ld_off + j * RSTEP * D * 2, ok ? kp : kb, ok);
      cp_async16(sV + ld_off + j * RSTEP * D * 2, ok ? vp : vb, ok);
      kp += RSTEP * kst;
      vp += RSTEP * vst;
    }
  };

#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) load_tile(s, s);
    cp_async_commit();
  }

  // ldmatrix lane addressing. Every row a lane addresses is == x7 (mod 8), so the swizzle of
  // chunk 2*k + bit is (2*k) ^ (bit ^ x7): a per-lane constant XORed with an immediate.
  const int x7 = lane & 7, mi = lane >> 3;
  const int wrow = warp * 16 * MT;  // this warp's first row inside the CTA tile
  const u32 aq = sQ + (wrow + (mi & 1) * 8 + x7) * D * 2, cq = (u32)(((mi >> 1) ^ x7) << 4);
  const u32 ak = ((mi >> 1) * 8 + x7) * D * 2, ck = (u32)(((mi & 1) ^ x7) << 4);
  const u32 av = ((mi & 1) * 8 + x7) * D * 2, cv = cq;

#if QREGS
  u32 qf[MT][KT][4];
  cp_async_wait<NST - 1>();
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
      ldsm_x4(aq + mt * 16 * D * 2 + ((kk << 5) ^ cq), qf[mt][kk][0], qf[mt][kk][1], qf[mt][kk][2],
              qf[mt][kk][3]);
#endif

#if RULE_GROUPS
  // Each thread owns rows (lane>>2) and (lane>>2)+8 of each of its m-tiles: their group's see bitmask (rows
  // past G*Lq see no window key; they are never stored).
  const int* grp = group + (i64)b * grp_sb;
  u32 qsee[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + wrow + mt * 16 + (lane >> 2) + h * 8;
      qsee[mt][h] = row < rows ? (u32)see[grp[row / G]] : 0u;
    }
#else
  // Each thread owns rows (lane>>2) and (lane>>2)+8 of each of its m-tiles: their window slot.
  int qslot[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) qslot[mt][h] = ((row0 + wrow + mt * 16 + (lane >> 2) + h * 8) / G) / slot;
#endif

  float o[MT][DT][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<NST - 2>();
    __syncthreads();  // tile t visible to all; tile t-1's stage free for reuse
    if (t + NST - 1 < ntiles) load_tile(t + NST - 1, (t + NST - 1) % NST);
    cp_async_commit();

    const u32 sK = sKV + (t % NST) * 2 * TILE_BYTES, sV = sK + TILE_BYTES;

    // S = Q K^T
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
#if QREGS
#define AFRAG(mt) qf[mt][kk]
#else
      u32 a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(aq + mt * 16 * D * 2 + ((kk << 5) ^ cq), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#define AFRAG(mt) a[mt]
#endif
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        u32 b0, b1, b2, b3;
        ldsm_x4(sK + ak + np * 16 * D * 2 + ((kk << 5) ^ ck), b0, b1, b2, b3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(s[mt][2 * np], AFRAG(mt), b0, b1);
          mma(s[mt][2 * np + 1], AFRAG(mt), b2, b3);
        }
      }
#undef AFRAG
    }

    // Scale into the log2 domain; mask the tile's tail and the window keys the rule hides.
    const bool is_win = t >= n_pre;
    const int k0 = is_win ? (t - n_pre) * BN : p_lo + t * BN;
    const int kvalid = is_win ? n_win_keys - k0 : p_hi - k0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale_log2;
    if (is_win || kvalid < BN) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = nt * 8 + (lane & 3) * 2 + (e & 1);
            bool dead = col >= kvalid;
#if RULE_GROUPS
            if (is_win) dead = dead || !((qsee[mt][e >> 1] >> grp[k0 + col]) & 1u);  // not dead: k0 + col < Lq
#else
            if (is_win) dead = dead || (k0 + col) / slot > qslot[mt][e >> 1];
#endif
            if (dead) s[mt][nt][e] = neg_inf();
          }
    }

    // Online softmax (row stats shared by the 4 lanes of a quad).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmax2(mx, fmax2(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = fmax2(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmax2(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmax2(m[mt][h], mx);
        const float base = mnew == neg_inf() ? 0.f : mnew;  // all masked so far: keep exps at 0
        const float alpha = ex2(m[mt][h] - base);
        m[mt][h] = mnew;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          s[mt][nt][2 * h] = ex2(s[mt][nt][2 * h] - base);
          s[mt][nt][2 * h + 1] = ex2(s[mt][nt][2 * h + 1] - base);
          rs += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
        }
        l[mt][h] = l[mt][h] * alpha + rs;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * h] *= alpha;
          o[mt][dt][2 * h + 1] *= alpha;
        }
      }

    // O += P V, P straight from the S accumulators (C layout of two n-tiles == A layout of a k-step).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        u32 b0, b1, b2, b3;
        ldsm_x4_t(sV + av + kk * 16 * D * 2 + ((dp << 5) ^ cv), b0, b1, b2, b3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(o[mt][2 * dp], pa[mt], b0, b1);
          mma(o[mt][2 * dp + 1], pa[mt], b2, b3);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: normalise, write out (+lse), or this split's fp32 partial.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lsum = l[mt][h];
      lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
      lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
      const int row = row0 + wrow + mt * 16 + (lane >> 2) + h * 8;
      if (row >= rows) continue;
      const int i = row / G, hh = kvh * G + row % G;
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      const float lse_v = lsum > 0.f ? (m[mt][h] + lg2(lsum)) * LN2 : neg_inf();
      const i64 orow = ((i64)b * Lq + i) * H + hh;  // [B, Lq, H] row of out
      const i64 lrow = ((i64)b * H + hh) * Lq + i;  // [B, H, Lq] entry of lse
      if (nsplit == 1) {
        u32* dst = (u32*)(out + orow * D) + (lane & 3);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) dst[dt * 4] = pack2(o[mt][dt][2 * h] * inv, o[mt][dt][2 * h + 1] * inv);
        if (lse != nullptr && (lane & 3) == 0) lse[lrow] = lse_v;
      } else {
        const i64 nrows = (i64)B * Lq * H;
        float* dst = ws_o + (split * nrows + orow) * D + (lane & 3) * 2;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          dst[dt * 8] = o[mt][dt][2 * h] * inv;
          dst[dt * 8 + 1] = o[mt][dt][2 * h + 1] * inv;
        }
        if ((lane & 3) == 0) ws_lse[split * nrows + lrow] = lse_v;
      }
    }
}

// One warp per output row (b, i, h): merge the splits' partials by their lse.
extern "C" __global__ void packed_attn_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                                               u16* __restrict__ out, float* __restrict__ lse, int B, int Lq,
                                               int H, int nsplit) {
  constexpr int E = D / 32;  // elements per lane
  const i64 nrows = (i64)B * Lq * H;
  const i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= nrows) return;
  const int h = (int)(row % H), i = (int)((row / H) % Lq), b = (int)(row / ((i64)H * Lq));
  const i64 lrow = ((i64)b * H + h) * Lq + i;
  float mx = neg_inf();
  for (int s = 0; s < nsplit; ++s) mx = fmax2(mx, ws_lse[s * nrows + lrow]);
  const float base = mx == neg_inf() ? 0.f : mx;
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  float wsum = 0.f;
  for (int s = 0; s < nsplit; ++s) {
    const float w = ex2((ws_lse[s * nrows + lrow] - base) * LOG2E);
    wsum += w;
    const float* src = ws_o + (s * nrows + row) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] += w * src[e];
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  u32* dst = (u32*)(out + row * D + lane * E);
#pragma unroll
  for (int e = 0; e < E; e += 2) dst[e / 2] = pack2(acc[e] * inv, acc[e + 1] * inv);
  if (lse != nullptr && lane == 0) lse[lrow] = wsum > 0.f ? base + lg2(wsum) * LN2 : neg_inf();
}
