// attention.cu: causal GQA attention of the call's n queries over the KV cache, split over
// the cache length (flash-decoding), plus each cached token's attention mass.
//
// Query qi of head h sits at position start + qi and sees keys 0 .. start + qi. Head h
// reads kv head h / (n_heads / n_kv). Rows are (h, qi) pairs, row = h * n_max + qi.
//   attn_partial  grid (n_heads * n_max, <= ceil(cap / chunk)), block 128, dynamic shared
//                 memory (2 * chunk * d + chunk + d) floats; a block takes the splits
//                 blockIdx.y, + gridDim.y, ... that hold keys. Stages the split's keys and
//                 values in shared memory, then the row's scaled scores (kept in `scores`
//                 [rows, cap] for the mass), their max m, sum l of exp(score - m) and the
//                 exp-weighted sum of values.
//   attn_combine  grid (n_heads * n_max), block 128: merges the splits into out
//                 [n_max, n_heads * d] and turns the row's scores into probabilities.
//   attn_decode   one query (decode): grid (n_heads, ceil(cap / chunk)), block 128, chunk
//                 <= 64, d <= 256, at most ATT_MAX_SPLITS splits. No staging: each thread
//                 first loads its key's row and its (key group, float4 column) share of the
//                 values into registers, all at once, the older keys before it waits for
//                 the previous kernel (only the new token's slot comes from it); then
//                 scores, softmax, values. The last split of a head to finish (a counter
//                 per head, reset by that block) merges every split into out
//                 [n_heads * d] and writes the head's softmax max and sum to row_ml
//                 [n_heads, 2]; its scores stay raw (attn_mass normalizes them):
//                 attn_combine's work without its launch. A verify pass runs its tokens
//                 as grid.z: query qi at position start + qi, exactly the blocks and sums of
//                 the decode step at that position, its scores and row_ml score_stride and
//                 ml_stride floats on, its partials, counters and output a query's on.
//   attn_mass     grid ceil(cap / 32), block 256: for key t < start + n, adds the
//                 probabilities of every row (layers x heads x queries, stride cap) to
//                 mass[t]; with `first` set and state[STATE_MASS_ACC] 0 (a call's first
//                 chunk), old values are dropped. With row_ml (decode) the rows hold raw
//                 scores and the probability is exp(score - M_row) / L_row. tok_stride > 0
//                 (a verify pass, grid.y = its tokens, n_max 1): token qi's rows start
//                 qi * tok_stride floats on, its mass (as its decode step's) at mass + qi * cap.
// Dtypes: q, scores, partials, mass: fp32; the cache kvt (common.cuh: fp32, or int8 codes
// with k_scale/v_scale per slot and kv head; null with fp32). head_dim d: a multiple of 4,
// <= 256.
#include "common.cuh"

#ifndef ATT_MAX_SPLITS  // set by the loader (cuda_kernels.py), which the backend checks against
#error "ATT_MAX_SPLITS must be defined by the build options"
#endif
#define ATT_KPRE 16   // float4s of a key row loaded ahead: all of it for d <= 64
#define ATT_VPRE 8    // keys per value thread loaded ahead: all of them for the backend's
                      // chunk (64, 32, 16 keys for d <= 64, 128, 256)

extern "C" __global__ void __launch_bounds__(128)
attn_partial(const int* __restrict__ state, const float* __restrict__ q,
             const kvt* __restrict__ k_cache, const kvt* __restrict__ v_cache,
             const float* __restrict__ k_scale, const float* __restrict__ v_scale,
             float* __restrict__ scores, float* __restrict__ part_ml, float* __restrict__ part_o,
             int n_max, int n_heads, int n_kv, int d, int cap, int n_splits, int chunk,
             float scale) {
  pdl_wait_then_release();
  extern __shared__ float4 smem4[];
  float* ks = reinterpret_cast<float*>(smem4);   // [chunk, d]
  float* vs = ks + chunk * d;                     // [chunk, d]
  float* p = vs + chunk * d;                      // [chunk]
  float* qs = p + chunk;                          // [d]
  __shared__ float scratch[WARP];
  const int row = blockIdx.x, h = row / n_max, qi = row % n_max;
  const int n = state[STATE_N], start = state[STATE_START];
  if (qi >= n) return;
  const int hk = h / (n_heads / n_kv), d4 = d / 4;
  for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = q[(long long)qi * n_heads * d + h * d + i];
  // the splits s = blockIdx.y, + gridDim.y, ... (grid-stride: the grid's y may be smaller
  // than n_splits, so a prefill near the start of the cache launches few empty blocks)
  for (int s = blockIdx.y; s < n_splits; s += gridDim.y) {
    const int k0 = s * chunk, k1 = min(k0 + chunk, start + qi + 1);
    if (k0 >= k1) break;  // so are the later splits; attn_combine reads only those with keys
    const int count = k1 - k0;
    // stage keys and values: four float4s of each per thread in flight before any is stored
    const int total = count * d4;
    for (int base = threadIdx.x; base < total; base += 4 * blockDim.x) {
      float4 tk[4], tv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = base + u * blockDim.x;
        if (e < total) {
          const long long src = ((long long)(k0 + e / d4) * n_kv + hk) * d4 + e % d4;
          tk[u] = kv_load4(k_cache, k_scale, src, d4, false);
          tv[u] = kv_load4(v_cache, v_scale, src, d4, false);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = base + u * blockDim.x;
        if (e < total) {
          smem4[e] = tk[u];                // row e / d4, column e % d4
          smem4[chunk * d4 + e] = tv[u];
        }
      }
    }
    __syncthreads();
    float mine = NEG_INF;
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
      float acc = 0.f;
      int c = j % d;   // skewed start: a warp's threads read 32 different banks
      for (int i = 0; i < d; ++i) {
        acc = fmaf(qs[c], ks[j * d + c], acc);
        if (++c == d) c = 0;
      }
      acc *= scale;
      p[j] = acc;
      scores[(long long)row * cap + k0 + j] = acc;
      mine = fmaxf(mine, acc);
    }
    const float m = block_max(mine, scratch);
    float e_sum = 0.f;
    for (int j = threadIdx.x; j < count; j += blockDim.x) {
      const float e = expf(p[j] - m);
      p[j] = e;
      e_sum += e;
    }
    const float l = block_sum(e_sum, scratch);   // its barriers also publish p
    float* po = part_o + ((long long)row * n_splits + s) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      float o = 0.f;
      for (int j = 0; j < count; ++j) o = fmaf(p[j], vs[j * d + i], o);
      po[i] = o;
    }
    if (threadIdx.x == 0) {
      part_ml[((long long)row * n_splits + s) * 2] = m;
      part_ml[((long long)row * n_splits + s) * 2 + 1] = l;
    }
    __syncthreads();   // every thread is done with this split's keys, values and p
  }
}

// Merge the splits of one row: out[i] = sum_s exp(m_s - M) o_s[i] / L; returns (M, L) to
// every thread. Reads through L2 (ld_cg): in attn_decode the partials come from other
// blocks of the same launch.
__device__ __forceinline__ float2 merge_splits(const float* part_ml, const float* part_o,
                                               float* out, int used, int d) {
  __shared__ float wm[ATT_MAX_SPLITS], wl[ATT_MAX_SPLITS];
  __shared__ float ml[2];
  for (int s = threadIdx.x; s < used; s += blockDim.x) {
    wm[s] = ld_cg(part_ml + 2 * s);
    wl[s] = ld_cg(part_ml + 2 * s + 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = NEG_INF, L = 0.f;
    for (int s = 0; s < used; ++s) M = fmaxf(M, wm[s]);
    for (int s = 0; s < used; ++s) L += wl[s] * expf(wm[s] - M);
    ml[0] = M;
    ml[1] = L;
  }
  __syncthreads();
  const float M = ml[0], L = ml[1];
  for (int s = threadIdx.x; s < used; s += blockDim.x) wm[s] = expf(wm[s] - M) / L;
  __syncthreads();
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float o = 0.f;
#pragma unroll 4
    for (int s = 0; s < used; ++s) o = fmaf(ld_cg(part_o + (long long)s * d + i), wm[s], o);
    out[i] = o;
  }
  return make_float2(M, L);
}

extern "C" __global__ void __launch_bounds__(128)
attn_decode(const int* __restrict__ state, const float* __restrict__ q,
            const kvt* __restrict__ k_cache, const kvt* __restrict__ v_cache,
            const float* __restrict__ k_scale, const float* __restrict__ v_scale,
            float* __restrict__ scores, float* part_ml, float* part_o, float* __restrict__ out,
            float* __restrict__ row_ml, int* counters, int n_heads, int n_kv, int d, int cap,
            int n_splits, int chunk, float scale, int score_stride, int ml_stride) {
  __shared__ float4 qs4[64];     // [d / 4]
  __shared__ float p[64];        // [chunk]
  __shared__ float4 acc4[128];   // [groups, d / 4]
  __shared__ float scratch[WARP];
  __shared__ int is_last;
  // query qi of the call (verify: grid.z = the call's tokens), at position call_start + qi
  const int h = blockIdx.x, s = blockIdx.y, qi = blockIdx.z;
  const int call_start = state[STATE_START], start = call_start + qi, visible = start + 1;
  const int k0 = s * chunk, k1 = min(k0 + chunk, visible);
  if (k0 >= k1 || qi >= state[STATE_N]) {  // only the splits that hold keys take part
    pdl_wait_then_release();
    return;
  }
  q += (long long)qi * n_heads * d;
  out += (long long)qi * n_heads * d;
  scores += (long long)qi * score_stride;
  row_ml += (long long)qi * ml_stride;
  part_ml += (long long)qi * n_heads * n_splits * 2;
  part_o += (long long)qi * n_heads * n_splits * d;
  counters += qi * n_heads;
  const int hk = h / (n_heads / n_kv), count = k1 - k0, d4 = d / 4;
  const int groups = blockDim.x / d4, g = threadIdx.x / d4, c = threadIdx.x % d4;
  const int j = threadIdx.x;   // this thread's key (count <= chunk <= blockDim)
  // every load of the split goes out before anything waits: this thread's key row (its first
  // ATT_KPRE float4s) and its value column (ATT_VPRE keys). Keys before the call's start were
  // written by earlier calls, so they load before the wait for the previous kernel; the
  // call's keys and values (written by matmul_qkv_rope just before) after it.
  const long long kr = ((long long)(k0 + j) * n_kv + hk) * d4;   // this key's row (float4s)
  float4 kpre[ATT_KPRE], vpre[ATT_VPRE];
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) pdl_wait_then_release();
    if (j < count && (k0 + j < call_start) == (pass == 0)) {
#pragma unroll
      for (int b = 0; b < ATT_KPRE; ++b)
        if (b < d4) kpre[b] = kv_load4(k_cache, k_scale, kr + b, d4, pass);
    }
    if (g < groups) {
#pragma unroll
      for (int b = 0; b < ATT_VPRE; ++b) {
        const int jj = g + b * groups;
        if (jj < count && (k0 + jj < call_start) == (pass == 0))
          vpre[b] = kv_load4(v_cache, v_scale, ((long long)(k0 + jj) * n_kv + hk) * d4 + c, d4,
                             pass);
      }
    }
  }
  for (int e = threadIdx.x; e < d4; e += blockDim.x)
    qs4[e] = reinterpret_cast<const float4*>(q)[h * d4 + e];
  __syncthreads();
  float* sc = scores + (long long)h * cap;
  float a = NEG_INF;
  if (j < count) {
    float acc = 0.f;
#pragma unroll
    for (int b = 0; b < ATT_KPRE; ++b) {
      if (b < d4) {
        const float4 qv = qs4[b];
        acc = fmaf(kpre[b].x, qv.x, acc);
        acc = fmaf(kpre[b].y, qv.y, acc);
        acc = fmaf(kpre[b].z, qv.z, acc);
        acc = fmaf(kpre[b].w, qv.w, acc);
      }
    }
#pragma unroll 8
    for (int e = ATT_KPRE; e < d4; ++e) {
      const float4 kv = kv_load4(k_cache, k_scale, kr + e, d4, true), qv = qs4[e];
      acc = fmaf(kv.x, qv.x, acc);
      acc = fmaf(kv.y, qv.y, acc);
      acc = fmaf(kv.z, qv.z, acc);
      acc = fmaf(kv.w, qv.w, acc);
    }
    a = acc * scale;
    p[j] = a;
    sc[k0 + j] = a;   // raw score: attn_mass turns it into a probability with row_ml
  }
  const float m = block_max(a, scratch);
  float e_sum = 0.f;
  if (j < count) {
    const float e = expf(a - m);
    p[j] = e;
    e_sum = e;
  }
  const float l = block_sum(e_sum, scratch);   // its barriers also publish p
  if (g < groups) {
    float4 o;
    o.x = o.y = o.z = o.w = 0.f;
#pragma unroll
    for (int b = 0; b < ATT_VPRE; ++b) {
      const int jj = g + b * groups;
      if (jj < count) {
        const float pj = p[jj];
        o.x = fmaf(pj, vpre[b].x, o.x);
        o.y = fmaf(pj, vpre[b].y, o.y);
        o.z = fmaf(pj, vpre[b].z, o.z);
        o.w = fmaf(pj, vpre[b].w, o.w);
      }
    }
    for (int jj = g + ATT_VPRE * groups; jj < count; jj += groups) {
      const float4 vv = kv_load4(v_cache, v_scale, ((long long)(k0 + jj) * n_kv + hk) * d4 + c,
                                 d4, true);
      const float pj = p[jj];
      o.x = fmaf(pj, vv.x, o.x);
      o.y = fmaf(pj, vv.y, o.y);
      o.z = fmaf(pj, vv.z, o.z);
      o.w = fmaf(pj, vv.w, o.w);
    }
    acc4[g * d4 + c] = o;
  }
  __syncthreads();
  const float* acc = reinterpret_cast<const float*>(acc4);
  float* po = part_o + ((long long)h * n_splits + s) * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float o = 0.f;
    for (int gg = 0; gg < groups; ++gg) o += acc[gg * d + i];
    po[i] = o;
  }
  if (threadIdx.x == 0) {
    part_ml[((long long)h * n_splits + s) * 2] = m;
    part_ml[((long long)h * n_splits + s) * 2 + 1] = l;
  }
  // publish this split, then the last one of the head to arrive merges them all
  __threadfence();
  __syncthreads();
  const int used = (visible + chunk - 1) / chunk;
  if (threadIdx.x == 0) is_last = atomicAdd(counters + h, 1) == used - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (threadIdx.x == 0) counters[h] = 0;
  const float2 ml = merge_splits(part_ml + (long long)h * n_splits * 2,
                                 part_o + (long long)h * n_splits * d, out + (long long)h * d,
                                 used, d);
  if (threadIdx.x == 0) {
    row_ml[2 * h] = ml.x;
    row_ml[2 * h + 1] = ml.y;
  }
}

extern "C" __global__ void __launch_bounds__(128)
attn_combine(const int* __restrict__ state, const float* __restrict__ part_ml,
             const float* __restrict__ part_o, float* __restrict__ out,
             float* __restrict__ scores, int n_max, int n_heads, int d, int cap, int n_splits,
             int chunk) {
  pdl_wait_then_release();
  const int row = blockIdx.x, h = row / n_max, qi = row % n_max;
  const int n = state[STATE_N], start = state[STATE_START];
  if (qi >= n) return;
  const int visible = start + qi + 1, used = (visible + chunk - 1) / chunk;
  const float2 ml = merge_splits(part_ml + (long long)row * n_splits * 2,
                                 part_o + (long long)row * n_splits * d,
                                 out + (long long)qi * n_heads * d + h * d, used, d);
  const float M = ml.x, L = ml.y;
  float* sc = scores + (long long)row * cap;
  for (int t = threadIdx.x; t < visible; t += blockDim.x) sc[t] = expf(sc[t] - M) / L;
}

extern "C" __global__ void __launch_bounds__(256)
attn_mass(const int* __restrict__ state, const float* __restrict__ probs,
          const float* __restrict__ row_ml, float* __restrict__ mass, int n_max, int n_rows,
          int cap, int first, int tok_stride) {
  pdl_wait_then_release();
  __shared__ float part[8][WARP];
  int n = state[STATE_N], start = state[STATE_START];
  if (tok_stride) {   // a verify pass: grid.y = its tokens, each a decode step's mass
    const int qi = blockIdx.y;
    if (qi >= n) return;
    start += qi;
    n = 1;
    probs += (long long)qi * tok_stride;
    row_ml += (long long)qi * n_rows * 2;
    mass += (long long)qi * cap;
  }
  const int end = start + n;
  if (blockIdx.x * WARP >= end) return;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int t = blockIdx.x * WARP + lane;
  float acc = 0.f;
  if (t < end) {
#pragma unroll 4
    for (int r = warp; r < n_rows; r += 8) {
      const int qi = r % n_max;
      if (qi < n && t <= start + qi) {
        const float v = probs[(long long)r * cap + t];
        acc += row_ml ? expf(v - row_ml[2 * r]) / row_ml[2 * r + 1] : v;
      }
    }
  }
  part[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && t < end) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) sum += part[w][lane];
    const bool keep_old = !first || (state[STATE_MASS_ACC] && t < start);
    mass[t] = keep_old ? mass[t] + sum : sum;
  }
}
