// matmul.cu: y = W . xhat for the tokens of a call, W: [rows, K] row-major (HF Linear),
// with the layer's epilogue fused in. xhat = x, or rmsnorm(x) * norm_w when norm_w is
// given: each block takes 1 / rms of its tokens itself.
//
// Geometry: block = 128 threads (4 warps) but for _t16 (prefill, 16-token tiles on the tensor
// cores, tile16_body): a block of 4 to 16 warps owns T16_UNITS units (2 * T16_UNITS rows) and
// T16_TOKENS tokens, its warps splitting K; grid = (ceil(n_max / T16_TOKENS), ceil(units /
// T16_UNITS)); tiles at or past state[STATE_N] tokens exit. _t1 (one token: decode, and the LM
// head's last token): a warp owns a unit (two output rows); a unit may go to `split` warps (1, 2
// or 4) that share its K, and the grid may be smaller than ceil(units * split / 4): the blocks
// stride over the row groups (grid-stride), each warp loading its next unit's weights while it
// sums the current one. The _t1 kernels issue a warp's first MV_BATCH weight loads per row and
// lane before the wait for the previous kernel, so the weights stream in while the block waits
// (nothing but the weights is needed to start). _sp (one token, staged_body): a block of 4 warps
// owns `per_block` units whose rows it copies into shared memory before that wait; see
// staged_body.
// Dtypes: W, bias, norm_w: wt; x, outputs and sums: fp32; cache slots fp32.
//
// Epilogues (one extern "C" wrapper each):
//   matmul_residual  units = ceil(rows / 2), rows 2u and 2u + 1: out[t, r] += y  (o, down)
//   matmul_store     same units: out[t, r] = y; a non-finite y sets bit 0 of
//                    state[STATE_FLAGS]; last_only runs only the call's last token (LM head)
//   matmul_swiglu    units = inter, rows u (gate) and inter + u (up): act[t, u] = silu(g) * up
//   matmul_qkv_rope  units = q and k RoPE pairs (rows i and i + d/2 of a head), then v row
//                    pairs; adds the bias, rotates q and k at position start + t with the
//                    cos/sin tables ([2 * cap, d/2], row cap + position), writes q to q_out
//                    [n_max, q_size] and k, v to cache slot start + t ([cap, n_kv, d]).
#include "common.cuh"
#include "matvec.cuh"
#include "pdl.cuh"


// Prefill tiles (_t16) on the tensor cores: y = W . xhat for T16_TOKENS tokens and the
// T16_UNITS units (2 * T16_UNITS rows) of a block (grid = (ceil(n_max / T16_TOKENS),
// ceil(units / T16_UNITS)): the token tiles of a row group are neighbours in launch order,
// so a weight read by one comes from L2 for the others). The block's W warps (4 .. 16, the
// backend's choice: t16_warps) split K: warp w takes the 32-column chunks w, w + W, ...,
// so that a grid of few blocks still has many warps an SM to hide latency (a warp with many
// chunks in a row would wait on each). Each warp multiplies its chunks with mma.m16n8k8 in
// TF32 for all of the block's rows and tokens: m16 tile m (of T16_UNITS / 8) takes as the 16
// rows of A the r0 rows of units u0 + 8m .. u0 + 8m + 7 and then their r1 rows, n8 tile i (of
// T16_TOKENS / 8) of B tokens 8i .. 8i + 7, so each weight loaded serves T16_TOKENS tokens and
// each activation 2 * T16_UNITS rows. Within a chunk, lane (g, t)
// (g = lane / 4, t = lane % 4) loads the 8 columns 8t .. 8t + 7 of its units' two rows and
// of tokens 8i + g (one 16-byte load a row of 16-bit weights), and k-step j takes its
// columns 8t + 2j and 8t + 2j + 1 as the operands' logical columns t and t + 4: every
// lane's A and B agree on which column is which, and every column of the chunk is one
// logical column of one step.
// Exactness: a bf16 or fp16 weight is exact in TF32; the activation is split into a TF32
// high part and the TF32 rounding of what is left (x = hi + lo to about 2^-22 of x), so two
// products carry each term to fp32 accuracy (fp32 weights are split too: three products,
// lo x lo dropped). xhat = x * norm_w multiplies the tensor cores; 1 / rms, a factor of the
// whole token, multiplies the sum in the epilogue, from the sum of squares the warps take
// of the x they load anyway. The warps' partial sums meet in shared memory, in warp order,
// and the block's threads run the epilogues of its (unit, token) pairs in turn.
#if defined(RT_WEIGHT_F32)   // chunks a warp loads together before it multiplies them
#define TC_BATCH_W 1
#else
#define TC_BATCH_W T16_BATCH
#endif

__device__ __forceinline__ unsigned to_tf32(float f) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
  return r;
}

// c += A . B for one m16n8k8 TF32 step (fragments as the PTX ISA lays them out).
__device__ __forceinline__ void mma_tf32(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight consecutive weights of a row from p, raw: one vector load when `vec` and all eight
// lie before the row's end (count = values left in the row), else scalars, zeros past it.
__device__ __forceinline__ w8raw load_w8_upto(const wt* p, int count, bool vec) {
  if (vec && count >= 8) return load_w8(p);
  wt v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < count ? p[j] : (wt)0;
  w8raw r;
#if defined(RT_WEIGHT_F32)
  r.a = make_float4(v[0], v[1], v[2], v[3]);
  r.b = make_float4(v[4], v[5], v[6], v[7]);
#else
  r.a = make_uint4(v[0] | ((unsigned)v[1] << 16), v[2] | ((unsigned)v[3] << 16),
                   v[4] | ((unsigned)v[5] << 16), v[6] | ((unsigned)v[7] << 16));
#endif
  return r;
}

// Eight consecutive fp32 activations from p, as load_w8_upto (`vec`: p 16-byte aligned).
__device__ __forceinline__ void load8f_upto(const float* p, int count, bool vec, float* o) {
  if (vec && count >= 8) {
    load8f(p, o);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = j < count ? p[j] : 0.f;
}

// A weight as a TF32 operand: exact for bf16 and fp16. fp32 weights: hi, and lo = the TF32
// rounding of w - hi.
__device__ __forceinline__ void w_tf32(float w, unsigned& hi, unsigned& lo) {
#if defined(RT_WEIGHT_F32)
  hi = to_tf32(w);
  lo = to_tf32(w - __uint_as_float(hi));
#else
  hi = __float_as_uint(w);
  lo = 0u;
#endif
}

template <int EPI>
__device__ void tile16_body(int* __restrict__ state, const wt* __restrict__ W, int rows, int K,
                            const float* __restrict__ x, const wt* __restrict__ norm_w, float eps,
                            float* __restrict__ out, int units, int last_only, QkvArgs qa,
                            int /* split: always 1 */) {
  static_assert(T16_TOKENS % 8 == 0 && T16_UNITS % 8 == 0, "n8 tiles of tokens, m16 tiles of rows");
  constexpr int TM = T16_UNITS / 8, TN = T16_TOKENS / 8;   // m16 tiles, n8 tiles a warp
  __shared__ float2 red[T16_MAX_WARPS][T16_UNITS][T16_TOKENS];   // each warp's (y0, y1) sums
  __shared__ float ssq[T16_MAX_WARPS][T16_TOKENS];               // and sums of squares of x
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  const int g = lane / 4, t = lane % 4;
  const int u0 = blockIdx.y * T16_UNITS;
  const wt* w0[TM];
  const wt* w1[TM];
#pragma unroll
  for (int m = 0; m < TM; ++m) {
    int r0, r1, kind;
    unit_rows<EPI>(min(u0 + 8 * m + g, units - 1), rows, qa, &r0, &r1, &kind);
    w0[m] = W + (long long)r0 * K;
    w1[m] = W + (long long)r1 * K;
  }
  const bool wvec = (K % (16 / (int)sizeof(wt))) == 0, xvec = (K & 3) == 0;
  const int n_chunks = (K + 31) / 32;
  w8raw wa[TC_BATCH_W][TM], wb[TC_BATCH_W][TM];
#pragma unroll
  for (int b = 0; b < TC_BATCH_W; ++b) {   // the first weights load before the wait
    const int k = 32 * (warp + warps * b) + 8 * t;
    if (k < K) {
#pragma unroll
      for (int m = 0; m < TM; ++m) {
        wa[b][m] = load_w8_upto(w0[m] + k, K - k, wvec);
        wb[b][m] = load_w8_upto(w1[m] + k, K - k, wvec);
      }
    }
  }
  pdl_wait_then_release();   // x comes from the previous kernel
  const int n = state[STATE_N], start = state[STATE_START];
  if (last_only && blockIdx.x > 0) return;
  const int t0 = last_only ? n - 1 : blockIdx.x * T16_TOKENS;
  const int n_t = last_only ? 1 : min(T16_TOKENS, n - t0);
  if (n_t <= 0) return;   // the whole block leaves together
  const int tiles = (n_t + 7) / 8;   // n8 tiles holding a token (the same for the whole block)
  float acc[TM][TN][2][4];   // [m16 tile][n8 tile][term: x hi, x lo][fragment]
#if defined(RT_WEIGHT_F32)
  float acc_wlo[TM][TN][4];  // fp32 weights' low parts times x hi
#endif
#pragma unroll
  for (int m = 0; m < TM; ++m)
#pragma unroll
    for (int i = 0; i < TN; ++i)
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        acc[m][i][0][f] = acc[m][i][1][f] = 0.f;
#if defined(RT_WEIGHT_F32)
        acc_wlo[m][i][f] = 0.f;
#endif
      }
  float ss[TN];
#pragma unroll
  for (int i = 0; i < TN; ++i) ss[i] = 0.f;
  for (int c0 = warp; c0 < n_chunks; c0 += warps * TC_BATCH_W) {
    if (c0 != warp) {
#pragma unroll
      for (int b = 0; b < TC_BATCH_W; ++b) {
        const int k = 32 * (c0 + warps * b) + 8 * t;
        if (k < K) {
#pragma unroll
          for (int m = 0; m < TM; ++m) {
            wa[b][m] = load_w8_upto(w0[m] + k, K - k, wvec);
            wb[b][m] = load_w8_upto(w1[m] + k, K - k, wvec);
          }
        }
      }
    }
    float xv[TC_BATCH_W][TN][8];   // token 8i + g of the tile, columns 8t .. 8t + 7
#pragma unroll
    for (int b = 0; b < TC_BATCH_W; ++b) {
      const int k = 32 * (c0 + warps * b) + 8 * t;
#pragma unroll
      for (int i = 0; i < TN; ++i) {
        const bool here = 8 * i + g < n_t;
        load8f_upto(x + (long long)(t0 + 8 * i + g) * K + k, here ? K - k : 0, xvec, xv[b][i]);
      }
    }
#pragma unroll
    for (int b = 0; b < TC_BATCH_W; ++b) {
      const int k = 32 * (c0 + warps * b) + 8 * t;
      if (c0 + warps * b >= n_chunks) break;   // the same for the whole warp
      float nw[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) nw[j] = 1.f;
      if (norm_w && k < K) {
        if (wvec && K - k >= 8) {
          load8(norm_w + k, nw);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) if (j < K - k) nw[j] = w2f(norm_w[k + j]);
        }
      }
#pragma unroll
      for (int i = 0; i < TN; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          ss[i] = fmaf(xv[b][i][j], xv[b][i][j], ss[i]);
          xv[b][i][j] *= nw[j];
        }
      float fa[TM][8], fb[TM][8];
#pragma unroll
      for (int m = 0; m < TM; ++m) {
        if (k < K) {
          w8_floats(wa[b][m], fa[m]);
          w8_floats(wb[b][m], fb[m]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) fa[m][j] = fb[m][j] = 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        unsigned h0[TN], h1[TN], e0[TN], e1[TN];   // the tokens' x, hi and lo parts
#pragma unroll
        for (int i = 0; i < TN; ++i) {
          const float v0 = xv[b][i][2 * j], v1 = xv[b][i][2 * j + 1];
          h0[i] = to_tf32(v0);
          h1[i] = to_tf32(v1);
          e0[i] = to_tf32(v0 - __uint_as_float(h0[i]));
          e1[i] = to_tf32(v1 - __uint_as_float(h1[i]));
        }
#pragma unroll
        for (int m = 0; m < TM; ++m) {
          unsigned a0, a1, a2, a3, l0, l1, l2, l3;
          w_tf32(fa[m][2 * j], a0, l0);
          w_tf32(fb[m][2 * j], a1, l1);
          w_tf32(fa[m][2 * j + 1], a2, l2);
          w_tf32(fb[m][2 * j + 1], a3, l3);
#pragma unroll
          for (int i = 0; i < TN; ++i) {
            if (i >= tiles) break;   // no token of the block in this n8 tile
            mma_tf32(acc[m][i][0], a0, a1, a2, a3, h0[i], h1[i]);
            mma_tf32(acc[m][i][1], a0, a1, a2, a3, e0[i], e1[i]);
#if defined(RT_WEIGHT_F32)
            mma_tf32(acc_wlo[m][i], l0, l1, l2, l3, h0[i], h1[i]);
#endif
          }
        }
      }
    }
  }
  // lane (g, t) holds, for m16 tile m and n8 tile i: unit u0 + 8m + g, tokens 8i + 2t + e
  // (e = 0, 1): y0 in fragment e, y1 in fragment 2 + e
#pragma unroll
  for (int m = 0; m < TM; ++m)
#pragma unroll
    for (int i = 0; i < TN; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float y0 = acc[m][i][0][e] + acc[m][i][1][e];
        float y1 = acc[m][i][0][2 + e] + acc[m][i][1][2 + e];
#if defined(RT_WEIGHT_F32)
        y0 += acc_wlo[m][i][e];
        y1 += acc_wlo[m][i][2 + e];
#endif
        red[warp][8 * m + g][8 * i + 2 * t + e] = make_float2(y0, y1);
      }
#pragma unroll
  for (int i = 0; i < TN; ++i) {   // token 8i + g's squares over the lanes t of its row
    float s = ss[i];
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    s += __shfl_xor_sync(FULL_MASK, s, 2);
    if (t == 0) ssq[warp][8 * i + g] = s;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < T16_UNITS * T16_TOKENS; p += blockDim.x) {
    const int lu = p / T16_TOKENS, tt = p % T16_TOKENS;
    const int u = u0 + lu;
    if (u >= units || tt >= n_t) continue;
    float y0 = 0.f, y1 = 0.f, sq = 0.f;
    for (int w = 0; w < warps; ++w) {
      y0 += red[w][lu][tt].x;
      y1 += red[w][lu][tt].y;
      sq += ssq[w][tt];
    }
    if (norm_w) {
      const float inv_rms = 1.f / sqrtf(sq / K + eps);
      y0 *= inv_rms;
      y1 *= inv_rms;
    }
    int r0, r1, kind;
    unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
    epilogue<EPI>(state, t0 + tt, u, rows, r0, r1, kind, y0, y1, out, last_only, start, qa);
  }
}

#ifndef MV_BATCH  // chunks of 8 weights per lane and batch: set by the loader (cuda_kernels.py)
#error "MV_BATCH must be defined by the build options"
#endif

// Where element k of a token's xhat sits in a verify block's staged row of K (K % 8 == 0):
// the first four of each chunk of 8 in the first half of the row, the last four in the
// second, so that lane c's two 16-byte reads of chunk c are at 16 * c in each half.
__device__ __forceinline__ int tv_slot(int k, int K) {
  return ((k & 7) >= 4 ? K / 2 : 0) + 4 * (k >> 3) + (k & 3);
}
#define TV_LOADS 8   // 16-byte loads of x a thread issues together when it stages them

// One token (decode, or the last token for the LM head), grid-stride: block b takes the
// unit groups b, b + gridDim.x, ... (a group = blockDim / 32 / split units), so a grid
// sized to what is resident streams the whole matrix without waves of block exits and
// launches, and the norm's reduction is paid once a block. The first unit's first batch of
// weights is loaded before the wait for the previous kernel; each later unit's first batch
// is issued while the unit before it is being summed (a register freed by the conversion
// to fp32 takes the next load at once), so a warp always has loads in flight.
// split (1, 2 or 4, dividing the block's warps): warps per unit, each taking a contiguous
// 1/split of K, their sums added in shared memory, so that a long row is one batch of
// loads per lane and a short matrix covers more SMs.
// NT tokens a block (a verify pass, _tv: tokens blockIdx.y * NT ..): each weight loaded
// once serves them all, and each token's sums are those of the one-token kernel (NT = 1)
// for it alone, term for term in the same order: the rows of a verify pass equal decode
// steps bit for bit. When the launch gives it the dynamic shared memory (the block's tokens
// * K floats, the backend's tv_shared), the block first stages every token's xhat there,
// each value the very product x * (1 / rms) * norm_w the unstaged loop forms, so that the
// loop over rows reads it from shared memory instead of loading and normalizing x again
// for every row pair (tv_slot: where each value sits).
template <int EPI, int NT>
__device__ void matvec_body(int* __restrict__ state, const wt* __restrict__ W, int rows, int K,
                            const float* __restrict__ x, const wt* __restrict__ norm_w,
                            float eps, float* __restrict__ out, int units, int last_only,
                            QkvArgs qa, int split) {
  __shared__ float scratch[WARP * NT];
  __shared__ float2 part_sums[2][8][NT];   // [round parity][warp][token]: its share of K
  const int n = state[STATE_N], start = state[STATE_START];
  // grid.y: one block row per NT tokens
  const int tok = last_only ? n - 1 : blockIdx.y * NT;
  if (tok >= n) {  // the whole block leaves together
    pdl_wait_then_release();
    return;
  }
  const int nt = min(NT, n - tok);   // this block's tokens: tok .. tok + nt - 1
  const float* xt = x + (long long)tok * K;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int per_group = blockDim.x / WARP / split, part = warp % split;
  const int stride = gridDim.x * per_group;   // units between a warp's rounds
  const bool vec = (K & 7) == 0;
  // this warp's chunks of 8 weights: [c_begin, c_end) of K / 8
  const int per_part = (K / 8 + split - 1) / split;
  const int c_begin = part * per_part, c_end = min(K / 8, c_begin + per_part);
  const int half = qa.head_dim / 2, q_size = qa.n_heads * qa.head_dim;
  int u = blockIdx.x * per_group + warp / split;
  int r0 = 0, r1 = 0, kind = 0;
  if (u < units) unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
  w8raw wa[MV_BATCH], wb[MV_BATCH];
  if (u < units && vec) {
    const wt* w0 = W + (long long)r0 * K;
    const wt* w1 = W + (long long)r1 * K;
#pragma unroll
    for (int b = 0; b < MV_BATCH; ++b) {
      const int c = c_begin + lane + b * WARP;
      if (c < c_end) { wa[b] = load_w8(w0 + 8 * c); wb[b] = load_w8(w1 + 8 * c); }
    }
  }
  pdl_wait_then_release();   // the weights are in flight; x comes from the previous kernel
  extern __shared__ __align__(16) float tv_xs[];   // staged xhat: [nt][K], swizzled
  unsigned dyn_shared = 0;
  if (NT > 1) asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_shared));
  const bool stage = NT > 1 && vec && 4ull * nt * K <= dyn_shared;
  if (stage) {   // the block's x, 16 bytes a load and TV_LOADS loads a thread in flight
    const int n4 = nt * K / 4, k4 = K / 4;
    const float4* x4 = reinterpret_cast<const float4*>(xt);
    for (int i = threadIdx.x; i < n4; i += TV_LOADS * blockDim.x) {
      float4 v[TV_LOADS];
#pragma unroll
      for (int b = 0; b < TV_LOADS; ++b) {
        const int at = i + b * blockDim.x;
        if (at < n4) v[b] = x4[at];
      }
#pragma unroll
      for (int b = 0; b < TV_LOADS; ++b) {
        const int at = i + b * blockDim.x;
        if (at < n4) {   // four values of one half of a chunk: contiguous when staged
          const int t = at / k4, k = 4 * (at - t * k4);
          *reinterpret_cast<float4*>(tv_xs + t * K + tv_slot(k, K)) = v[b];
        }
      }
    }
    __syncthreads();
  }
  float inv_rms[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) inv_rms[t] = 1.f;
  if (norm_w) {   // each token's sum of squares in the one-token kernel's order, reduced together
    float ss[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) ss[t] = 0.f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      const int at = stage ? tv_slot(k, K) : k;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t < nt) {
          const float v = stage ? tv_xs[t * K + at] : xt[(long long)t * K + k];
          ss[t] = fmaf(v, v, ss[t]);
        }
      }
    }
    block_sums<NT>(ss, scratch);
#pragma unroll
    for (int t = 0; t < NT; ++t) if (t < nt) inv_rms[t] = 1.f / sqrtf(ss[t] / K + eps);
  }
  if (stage && norm_w) {   // xhat in place (without a norm, x * 1 * 1 is x: nothing to do)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < nt) {
        float* xs = tv_xs + t * K;
        for (int k = threadIdx.x; k < K; k += blockDim.x) {
          const float nw = w2f(norm_w[k]);
          const int at = tv_slot(k, K);
          xs[at] = xs[at] * inv_rms[t] * nw;
        }
      }
    }
    __syncthreads();
  }
  // rounds: every warp of the block runs the same count (the split's barrier needs it)
  for (int round = 0, base_u = blockIdx.x * per_group; base_u < units;
       ++round, base_u += stride, u += stride) {
    const bool active = u < units;
    const int nu = u + stride;   // this warp's next unit
    int n0 = 0, n1 = 0, nkind = 0;
    if (nu < units) unit_rows<EPI>(nu, rows, qa, &n0, &n1, &nkind);
    float rc = 0.f, rs = 0.f;   // qkv: this pair's rotation (NT > 1: the epilogue's own)
    if (NT == 1 && EPI == EPI_QKV_ROPE && active && kind < 2 && lane == 0 && part == 0) {
      const int i = (kind == 0 ? r0 : r0 - q_size) % qa.head_dim;
      const long long at = (long long)(qa.cap + start + tok) * half + i;
      rc = qa.cos_t[at];
      rs = qa.sin_t[at];
    }
    const wt* w0 = W + (long long)r0 * K;
    const wt* w1 = W + (long long)r1 * K;
    const wt* nw0 = W + (long long)n0 * K;
    const wt* nw1 = W + (long long)n1 * K;
    float a0[NT], a1[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) a0[t] = a1[t] = 0.f;
    if (active && vec) {
      for (int base = c_begin; base < c_end; base += MV_BATCH * WARP) {
        if (base != c_begin) {
#pragma unroll
          for (int b = 0; b < MV_BATCH; ++b) {
            const int c = base + lane + b * WARP;
            if (c < c_end) { wa[b] = load_w8(w0 + 8 * c); wb[b] = load_w8(w1 + 8 * c); }
          }
        }
        // the last batch of this unit: each register, once converted, loads the next
        // unit's first batch (the whole next unit when a unit is one batch)
        const bool last = base + MV_BATCH * WARP >= c_end;
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) {
          const int c = base + lane + b * WARP, cn = c_begin + lane + b * WARP;
          const bool have = c < c_end;
          float fa[8], fb[8];
          if (have) {
            w8_floats(wa[b], fa);
            w8_floats(wb[b], fb);
          }
          if (last && nu < units && cn < c_end) {
            wa[b] = load_w8(nw0 + 8 * cn);
            wb[b] = load_w8(nw1 + 8 * cn);
          }
          if (have && stage) {   // xhat from shared memory: two 16-byte halves a chunk
#pragma unroll
            for (int t = 0; t < NT; ++t) {
              if (t < nt) {
                const float* xs = tv_xs + t * K;
                const float4 lo = *reinterpret_cast<const float4*>(xs + 4 * c);
                const float4 hi = *reinterpret_cast<const float4*>(xs + K / 2 + 4 * c);
                const float xn[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                  a0[t] = fmaf(fa[j], xn[j], a0[t]);
                  a1[t] = fmaf(fb[j], xn[j], a1[t]);
                }
              }
            }
          } else if (have) {
            const int k = 8 * c;
            float nw[8];
            load_norm8(norm_w, k, nw);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
              if (t < nt) {
                float xv[8];
                load8f(xt + (long long)t * K + k, xv);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                  const float xn = xv[j] * inv_rms[t] * nw[j];
                  a0[t] = fmaf(fa[j], xn, a0[t]);
                  a1[t] = fmaf(fb[j], xn, a1[t]);
                }
              }
            }
          }
        }
      }
    } else if (active) {  // rows not 16-byte aligned: scalar loads, the parts interleaved
      for (int k = part * WARP + lane; k < K; k += WARP * split) {
        const float nw = norm_w ? w2f(norm_w[k]) : 1.f;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t < nt) {
            const float xn = xt[(long long)t * K + k] * inv_rms[t] * nw;
            a0[t] = fmaf(w2f(w0[k]), xn, a0[t]);
            a1[t] = fmaf(w2f(w1[k]), xn, a1[t]);
          }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      a0[t] = warp_sum(a0[t]);
      a1[t] = warp_sum(a1[t]);
    }
    bool mine = active && lane == 0;
    if (split > 1) {
      if (lane == 0)
#pragma unroll
        for (int t = 0; t < NT; ++t) part_sums[round & 1][warp][t] = make_float2(a0[t], a1[t]);
      __syncthreads();
      mine = mine && part == 0;
      if (mine)
        for (int p = 1; p < split; ++p)
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            a0[t] += part_sums[round & 1][warp + p][t].x;
            a1[t] += part_sums[round & 1][warp + p][t].y;
          }
    }
    if (mine)
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (t < nt)
          epilogue<EPI>(state, tok + t, u, rows, r0, r1, kind, a0[t], a1[t], out, last_only,
                        start, qa, NT == 1, rc, rs);
    r0 = n0; r1 = n1; kind = nkind;
  }
}

// One token, staged (_sp): every weight of the block's units, and the RMSNorm weights,
// are copied into shared memory (cp.async, 16 bytes a thread and copy) *before* the wait
// for the previous kernel, and the block lets the next kernel launch at once, also before
// its wait. So a chain of staged kernels loads its weights while an earlier kernel still
// runs (the next one's blocks sit beside this one's, shared memory allowing), and after
// its wait a block has only x to read (from L2) and shared memory to multiply.
// Correctness: every block waits before it reads x or writes anything, and before it
// exits, so a kernel's completion still implies its predecessors' (common.cuh).
// Geometry: block = SP_THREADS (4 warps); block b owns units [b * per_block, ...) (fewer
// in the last), warp w the block's units w, w + 4, ..., its lanes along K in chunks of 8.
// Dynamic shared memory: per_block * 2 rows * K weights, K norm weights, K fp32 of xhat.
// Needs K % 8 == 0 (16-byte rows) and n == 1 (decode); the backend picks it per matrix
// when the block's rows fit (CudaBackend, staged_decode).


template <int EPI>
__device__ void staged_body(int* __restrict__ state, const wt* __restrict__ W, int rows, int K,
                            const float* __restrict__ x, const wt* __restrict__ norm_w,
                            float eps, float* __restrict__ out, int units, QkvArgs qa,
                            int per_block) {
  extern __shared__ __align__(16) unsigned char sp_smem[];
  __shared__ float scratch[WARP];
  wt* ws = reinterpret_cast<wt*>(sp_smem);                        // [per_block * 2][K]
  wt* nws = ws + (long long)per_block * 2 * K;                    // [K]
  float* xs = reinterpret_cast<float*>(nws + K);                  // [K] (16-byte aligned)
  const int u_begin = blockIdx.x * per_block;
  const int n_units = max(0, min(per_block, units - u_begin));
  constexpr int VEC = 16 / sizeof(wt);   // weights a 16-byte copy
  const int per_row = K / VEC;
  for (int i = threadIdx.x; i < n_units * 2 * per_row; i += blockDim.x) {
    const int slot = i / per_row, c = i - slot * per_row;
    int r0, r1, kind;
    unit_rows<EPI>(u_begin + slot / 2, rows, qa, &r0, &r1, &kind);
    const int r = (slot & 1) ? r1 : r0;
    cp_async16(ws + (long long)slot * K + c * VEC, W + (long long)r * K + c * VEC);
  }
  if (norm_w)
    for (int c = threadIdx.x; c < per_row; c += blockDim.x)
      cp_async16(nws + c * VEC, norm_w + c * VEC);
  pdl_release_early();
  pdl_wait();   // from here on x is the previous kernel's
  const int n = state[STATE_N], start = state[STATE_START];
  const int tok = n - 1;   // the one token of a decode step
  if (n_units == 0 || tok < 0) {
    cp_async_wait_all();
    return;   // the whole block leaves together
  }
  const float* xt = x + (long long)tok * K;
  float ss = 0.f;
  for (int k = 4 * threadIdx.x; k < K; k += 4 * blockDim.x) {
    const float4 v = ld_cg4(reinterpret_cast<const float4*>(xt + k));
    *reinterpret_cast<float4*>(xs + k) = v;
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  cp_async_wait_all();
  float inv_rms = 1.f;
  if (norm_w) inv_rms = 1.f / sqrtf(block_sum(ss, scratch) / K + eps);   // syncs the block
  if (norm_w)
    for (int k = 4 * threadIdx.x; k < K; k += 4 * blockDim.x)   // the same k as above
#pragma unroll
      for (int j = 0; j < 4; ++j) xs[k + j] *= inv_rms * w2f(nws[k + j]);
  __syncthreads();
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int half = qa.head_dim / 2, q_size = qa.n_heads * qa.head_dim;
  for (int lu = warp; lu < n_units; lu += blockDim.x / WARP) {
    const int u = u_begin + lu;
    int r0, r1, kind;
    unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
    const wt* w0 = ws + (long long)(2 * lu) * K;
    const wt* w1 = w0 + K;
    float a0 = 0.f, a1 = 0.f;
    for (int k = 8 * lane; k < K; k += 8 * WARP)
      fma_pair8(*reinterpret_cast<const w8raw*>(w0 + k), *reinterpret_cast<const w8raw*>(w1 + k),
                xs + k, a0, a1);
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    if (lane == 0) {
      float rc = 0.f, rs = 0.f;
      if (EPI == EPI_QKV_ROPE && kind < 2) {
        const int i = (kind == 0 ? r0 : r0 - q_size) % qa.head_dim;
        const long long at = (long long)(qa.cap + start + tok) * half + i;
        rc = qa.cos_t[at];
        rs = qa.sin_t[at];
      }
      epilogue<EPI>(state, tok, u, rows, r0, r1, kind, a0, a1, out, 0, start, qa, true, rc,
                    rs);
    }
  }
}


#ifndef MV_MIN_BLOCKS  // blocks of 128 threads a _t1 kernel must fit an SM: set by the loader
#error "MV_MIN_BLOCKS must be defined by the build options"
#endif
#define BOUNDS_t1 __launch_bounds__(128, MV_MIN_BLOCKS)   // the backend's matmul block
#define BOUNDS_t16 __launch_bounds__(32 * T16_MAX_WARPS)   // the backend's t16_warps

// Every wrapper takes `split` last (warps per unit); the _t16 bodies need it to be 1.
#define MATMUL_PLAIN(NAME, BOUNDS, BODY)                                                    \
  extern "C" __global__ void BOUNDS                                                         \
  NAME(int* state, const wt* W, int rows, int K, const float* x, const wt* norm_w,          \
       float eps, float* out, int units, int last_only, int split) {                        \
    QkvArgs none = {};                                                                      \
    BODY(state, W, rows, K, x, norm_w, eps, out, units, last_only, none, split);            \
  }

#define BOUNDS_tv __launch_bounds__(128)   // the verify rows' matmuls
#define T1(EPI) matvec_body<EPI, 1>
#define TV(EPI) matvec_body<EPI, VERIFY_NT>

MATMUL_PLAIN(matmul_residual_t1, BOUNDS_t1, T1(EPI_RESIDUAL))
MATMUL_PLAIN(matmul_residual_t16, BOUNDS_t16, tile16_body<EPI_RESIDUAL>)
MATMUL_PLAIN(matmul_residual_tv, BOUNDS_tv, TV(EPI_RESIDUAL))
MATMUL_PLAIN(matmul_store_t1, BOUNDS_t1, T1(EPI_STORE))
MATMUL_PLAIN(matmul_store_tv, BOUNDS_tv, TV(EPI_STORE))
MATMUL_PLAIN(matmul_swiglu_t1, BOUNDS_t1, T1(EPI_SWIGLU))
MATMUL_PLAIN(matmul_swiglu_t16, BOUNDS_t16, tile16_body<EPI_SWIGLU>)
MATMUL_PLAIN(matmul_swiglu_tv, BOUNDS_tv, TV(EPI_SWIGLU))

#define MATMUL_QKV(NAME, BOUNDS, BODY)                                                      \
  extern "C" __global__ void BOUNDS                                                         \
  NAME(int* state, const wt* W, int rows, int K, const float* x, const wt* norm_w,          \
       float eps, int units, const wt* bias, float* q_out, float* k_cache, float* v_cache,  \
       const float* cos_t, const float* sin_t, int n_heads, int n_kv, int head_dim,         \
       int cap, int split) {                                                                \
    QkvArgs qa = {bias, q_out, k_cache, v_cache, cos_t, sin_t, n_heads, n_kv, head_dim,     \
                  cap};                                                                     \
    BODY(state, W, rows, K, x, norm_w, eps, nullptr, units, 0, qa, split);                  \
  }

MATMUL_QKV(matmul_qkv_rope_t1, BOUNDS_t1, T1(EPI_QKV_ROPE))
MATMUL_QKV(matmul_qkv_rope_t16, BOUNDS_t16, tile16_body<EPI_QKV_ROPE>)
MATMUL_QKV(matmul_qkv_rope_tv, BOUNDS_tv, TV(EPI_QKV_ROPE))

// The staged one-token kernels: per_block (units a block) replaces last_only and split.
#define BOUNDS_sp __launch_bounds__(SP_THREADS, 8)
extern "C" __global__ void BOUNDS_sp
matmul_residual_sp(int* state, const wt* W, int rows, int K, const float* x, const wt* norm_w,
                   float eps, float* out, int units, int per_block) {
  QkvArgs none = {};
  staged_body<EPI_RESIDUAL>(state, W, rows, K, x, norm_w, eps, out, units, none, per_block);
}

extern "C" __global__ void BOUNDS_sp
matmul_swiglu_sp(int* state, const wt* W, int rows, int K, const float* x, const wt* norm_w,
                 float eps, float* out, int units, int per_block) {
  QkvArgs none = {};
  staged_body<EPI_SWIGLU>(state, W, rows, K, x, norm_w, eps, out, units, none, per_block);
}

extern "C" __global__ void BOUNDS_sp
matmul_qkv_rope_sp(int* state, const wt* W, int rows, int K, const float* x, const wt* norm_w,
                   float eps, int units, const wt* bias, float* q_out, float* k_cache,
                   float* v_cache, const float* cos_t, const float* sin_t, int n_heads,
                   int n_kv, int head_dim, int cap, int per_block) {
  QkvArgs qa = {bias, q_out, k_cache, v_cache, cos_t, sin_t, n_heads, n_kv, head_dim, cap};
  staged_body<EPI_QKV_ROPE>(state, W, rows, K, x, norm_w, eps, nullptr, units, qa, per_block);
}

