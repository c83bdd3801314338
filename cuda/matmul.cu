// matmul.cu: y = W . xhat for the tokens of a call, W: [rows, K] row-major (HF Linear),
// with the layer's epilogue fused in. xhat = x, or rmsnorm(x) * norm_w when norm_w is
// given: each block first computes 1 / rms of its tokens, then normalizes on the fly.
//
// Geometry: block = 128 threads (4 warps; both kinds' launch bounds say so). _t16 (prefill,
// 16-token tiles, tile16_body): a block owns 8 units (16 rows, 2 units a warp) and 16
// tokens, its lanes along K; grid = (ceil(units / 8), ceil(n_max / 16)); tiles at or past
// state[STATE_N] tokens exit. _t1 (one token: decode, and the LM head's last token): a
// warp owns a unit (two output rows); a unit may go to `split` warps (1, 2 or 4) that
// share its K, and the grid may be smaller than ceil(units * split / 4): the blocks
// stride over the row groups (grid-stride), each warp loading its next unit's weights
// while it sums the current one. The _t1 kernels issue a warp's first MV_BATCH weight
// loads per row and lane before the wait for the previous kernel, so the weights stream
// in while the block waits (nothing but the weights is needed to start). _sp (one token,
// staged_body): a block of 4 warps owns `per_block` units whose rows it copies into
// shared memory before that wait; see staged_body.
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


// inv_rms[t] = 1 / rms of token t of the tile (1 without a norm), t < count: warp w takes
// tokens w, w + warps, ... four at a time, each lane 16-byte loads of the four rows
// together (K % 4 == 0), so a warp waits for x about once per 2048 values of K, not once
// per 32; then one barrier for the whole block.
__device__ __forceinline__ void tile_inv_rms(const float* xt, int K, const wt* norm_w, float eps,
                                             int n_t, int count, float* inv_rms) {
  const int lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
  for (int t0 = threadIdx.x / WARP; t0 < count; t0 += 4 * warps) {
    float ss[4] = {0.f, 0.f, 0.f, 0.f};
    if (norm_w && (K & 3) == 0) {
#pragma unroll 4
      for (int k = 4 * lane; k < K; k += 4 * WARP) {
        float4 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int t = t0 + i * warps;
          v[i] = t < n_t ? *reinterpret_cast<const float4*>(xt + (long long)t * K + k)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
          ss[i] += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
      }
    } else if (norm_w) {
      for (int k = lane; k < K; k += WARP)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int t = t0 + i * warps;
          if (t < n_t) ss[i] = fmaf(xt[(long long)t * K + k], xt[(long long)t * K + k], ss[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = t0 + i * warps;
      const float s = warp_sum(ss[i]);
      if (lane == 0 && t < count) inv_rms[t] = norm_w ? 1.f / sqrtf(s / K + eps) : 1.f;
    }
  }
  __syncthreads();
}

// Four consecutive weights, raw (common.cuh's load_w<4>); or, scalar, the last `count` (< 4)
// of a row, zeros past it.
__device__ __forceinline__ w4raw load_w4_scalar(const wt* p, int count) {
  wt v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = j < count ? p[j] : (wt)0;
  w4raw r;
#if defined(RT_WEIGHT_F32)
  r.a = make_float4(v[0], v[1], v[2], v[3]);
#else
  r.a = make_uint2(v[0] | ((unsigned)v[1] << 16), v[2] | ((unsigned)v[3] << 16));
#endif
  return r;
}

// Four consecutive floats from p: one 16-byte load when `aligned` (and count >= 4), else
// the first min(count, 4) with zeros after them.
__device__ __forceinline__ float4 load4f_upto(const float* p, int count, bool aligned) {
  if (aligned && count >= 4) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], count > 1 ? p[1] : 0.f, count > 2 ? p[2] : 0.f,
                     count > 3 ? p[3] : 0.f);
}

// Four RMSNorm weights from p as fp32, ones past the first min(count, 4).
__device__ __forceinline__ float4 load_norm4_upto(const wt* p, int count) {
  return make_float4(w2f(p[0]), count > 1 ? w2f(p[1]) : 1.f, count > 2 ? w2f(p[2]) : 1.f,
                     count > 3 ? w2f(p[3]) : 1.f);
}

// One step of a warp's reduce-scatter of value pairs: before it, s holds 2 * O pairs (4 * O
// values); the lanes with bit O set keep the upper O pairs, the others the lower, each
// adding its partner's (lane ^ O) copy of what it keeps.
template <int O>
__device__ __forceinline__ void reduce_scatter_step(float* s, int lane) {
  const bool up = (lane & O) != 0;
#pragma unroll
  for (int i = 0; i < 2 * O; ++i) {
    const float lo = s[i], hi = s[i + 2 * O];
    s[i] = (up ? hi : lo) + __shfl_xor_sync(FULL_MASK, up ? lo : hi, O);
  }
}

#define T16_KC 640                 // values of K a stage: a multiple of 128 (5 chunks a lane)
#define T16_PITCH (T16_KC + 4)
#define T16_BATCH 5                // float4 loads a thread has in flight while staging
#define T16_BATCHES (T16_TOKENS * T16_KC / 4 / 128 / T16_BATCH)

// Prefill tiles (_t16): y = W . xhat for T16_TOKENS tokens and the 8 units (16 rows) of a
// block of 4 warps, 2 units (4 rows) a warp (grid = (ceil(units / 8), ceil(n_max / 16)),
// tiles past the call's tokens exit). The lanes run along K: lane l takes the 4-weight
// chunks l, l + 32, ... of its warp's 4 rows, so a warp's weight load is 256 contiguous
// bytes a row (the design before, a lane per token, read each chunk at one address for
// 16 lanes: 32 bytes a load, too few in flight to stream the weights), each weight is
// converted once, and each 16-byte read of xhat feeds 16 multiply-adds (4 rows). xhat (x,
// or rmsnorm(x) * norm_w) is staged in shared memory T16_KC values of K at a time, every
// thread issuing its loads of a stage together, and a lane's next chunk loads while it
// multiplies the current one (its first before the wait for the previous kernel). At the
// end a lane holds 4 rows x 16 tokens of partial sums; a butterfly over the warp
// (reduce-scatter, 62 shuffles) leaves lane l the two rows of unit l / 16, token l % 16,
// which it runs through the epilogue.
template <int EPI>
__device__ void tile16_body(int* __restrict__ state, const wt* __restrict__ W, int rows, int K,
                            const float* __restrict__ x, const wt* __restrict__ norm_w, float eps,
                            float* __restrict__ out, int units, int last_only, QkvArgs qa,
                            int /* split: always 1 */) {
  static_assert(T16_BATCHES * T16_BATCH * 4 * 128 == T16_TOKENS * T16_KC, "staging items");
  static_assert(T16_KC % 128 == 0, "a stage must hold whole rounds of the warp's chunks");
  __shared__ __align__(16) float xs[T16_TOKENS][T16_PITCH];
  __shared__ float inv_rms[T16_TOKENS];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int u0 = blockIdx.x * T16_UNITS + 2 * warp;   // this warp's two units
  const bool vec = (K & 3) == 0;
  const int n4 = (K + 3) / 4;
  const wt* wrow[4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    int r0, r1, kind;
    unit_rows<EPI>(min(u0 + i, units - 1), rows, qa, &r0, &r1, &kind);
    wrow[2 * i] = W + (long long)r0 * K;
    wrow[2 * i + 1] = W + (long long)r1 * K;
  }
  int g = lane;   // this lane's chunk: weights W[., 4g .. 4g + 3]
  w4raw cur[4];
  if (g < n4) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      cur[j] = vec ? load_w<4>(wrow[j] + 4 * g) : load_w4_scalar(wrow[j] + 4 * g, min(4, K - 4 * g));
  }
  pdl_wait_then_release();   // the weights are in flight; x comes from the previous kernel
  const int n = state[STATE_N], start = state[STATE_START];
  const int t0 = last_only ? n - 1 : blockIdx.y * T16_TOKENS;
  const int n_t = last_only ? 1 : min(T16_TOKENS, n - t0);
  if (n_t <= 0) return;  // the whole block leaves together
  const float* xt = x + (long long)t0 * K;
  tile_inv_rms(xt, K, norm_w, eps, n_t, T16_TOKENS, inv_rms);
  float acc[T16_TOKENS][4];
#pragma unroll
  for (int t = 0; t < T16_TOKENS; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.f;
  for (int kb = 0; kb < K; kb += T16_KC) {
    const int kc = min(T16_KC, K - kb);
#pragma unroll 1
    for (int b = 0; b < T16_BATCHES; ++b) {
      float4 v[T16_BATCH], nw[T16_BATCH];
#pragma unroll
      for (int s = 0; s < T16_BATCH; ++s) {
        const int item = threadIdx.x + 128 * (b * T16_BATCH + s);
        const int tt = item / (T16_KC / 4), k = kb + (item % (T16_KC / 4)) * 4;
        v[s] = make_float4(0.f, 0.f, 0.f, 0.f);
        nw[s] = make_float4(1.f, 1.f, 1.f, 1.f);
        if (tt < n_t && k < K) {
          v[s] = load4f_upto(xt + (long long)tt * K + k, K - k, vec);
          if (norm_w) nw[s] = load_norm4_upto(norm_w + k, K - k);
        }
      }
#pragma unroll
      for (int s = 0; s < T16_BATCH; ++s) {
        const int item = threadIdx.x + 128 * (b * T16_BATCH + s);
        const int tt = item / (T16_KC / 4), k4 = (item % (T16_KC / 4)) * 4;
        if (k4 < kc) {   // whole chunks of 4, zeros past K
          const float r = tt < n_t ? inv_rms[tt] : 0.f;
          *reinterpret_cast<float4*>(&xs[tt][k4]) =
              make_float4(v[s].x * r * nw[s].x, v[s].y * r * nw[s].y, v[s].z * r * nw[s].z,
                          v[s].w * r * nw[s].w);
        }
      }
    }
    __syncthreads();
    const int g_end = (kb + kc + 3) / 4;
#pragma unroll 1
    for (; g < g_end; g += WARP) {
      const int gn = g + WARP;
      w4raw nxt[4];
      if (gn < n4) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          nxt[j] = vec ? load_w<4>(wrow[j] + 4 * gn)
                       : load_w4_scalar(wrow[j] + 4 * gn, min(4, K - 4 * gn));
      }
      float w[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) w_floats<4>(cur[j], w[j]);
#pragma unroll
      for (int t = 0; t < T16_TOKENS; ++t) {
        const float4 xv = *reinterpret_cast<const float4*>(&xs[t][4 * g - kb]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          acc[t][j] = fmaf(w[j][3], xv.w, fmaf(w[j][2], xv.z,
                      fmaf(w[j][1], xv.y, fmaf(w[j][0], xv.x, acc[t][j]))));
      }
      if (gn < n4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) cur[j] = nxt[j];
      }
    }
    __syncthreads();   // the stage is rewritten next
  }
  // reduce-scatter over the warp: pair p = 16 * unit + token (rows r0, r1 of the unit) is
  // s[2p], s[2p + 1]; each step keeps the half of the pairs whose index bit matches the
  // lane's, adding the partner's copy of it, so lane l ends with pair l in s[0], s[1]
  float s[64];
#pragma unroll
  for (int p = 0; p < 32; ++p) {
    s[2 * p] = acc[p % T16_TOKENS][2 * (p / T16_TOKENS)];
    s[2 * p + 1] = acc[p % T16_TOKENS][2 * (p / T16_TOKENS) + 1];
  }
  reduce_scatter_step<16>(s, lane);
  reduce_scatter_step<8>(s, lane);
  reduce_scatter_step<4>(s, lane);
  reduce_scatter_step<2>(s, lane);
  reduce_scatter_step<1>(s, lane);
  const int u = u0 + lane / T16_TOKENS, tt = lane % T16_TOKENS;
  if (u >= units || tt >= n_t) return;
  int r0, r1, kind;
  unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
  epilogue<EPI>(state, t0 + tt, u, rows, r0, r1, kind, s[0], s[1], out, last_only, start, qa);
}

#ifndef MV_BATCH  // chunks of 8 weights per lane and batch: set by the loader (cuda_kernels.py)
#error "MV_BATCH must be defined by the build options"
#endif

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
// steps bit for bit.
template <int EPI, int NT>
__device__ void matvec_body(int* __restrict__ state, const wt* __restrict__ W, int rows, int K,
                            const float* __restrict__ x, const wt* __restrict__ norm_w,
                            float eps, float* __restrict__ out, int units, int last_only,
                            QkvArgs qa, int split) {
  __shared__ float scratch[WARP];
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
  float inv_rms[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    inv_rms[t] = 1.f;
    if (norm_w && t < nt) {
      const float* xr = xt + (long long)t * K;
      float ss = 0.f;
      for (int k = threadIdx.x; k < K; k += blockDim.x) ss = fmaf(xr[k], xr[k], ss);
      ss = block_sum(ss, scratch);
      inv_rms[t] = 1.f / sqrtf(ss / K + eps);
    }
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
          if (have) {
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
#define BOUNDS_t16 __launch_bounds__(128, 3)   // the backend's matmul block, 3 an SM

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

