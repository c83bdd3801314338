// attention.cu: causal GQA attention of the call's n queries over the KV cache, split over
// the cache length (flash-decoding), plus each cached token's attention mass.
//
// Query qi of head h sits at position start + qi and sees keys 0 .. start + qi. Head h
// reads kv head h / (n_heads / n_kv). Rows are (h, qi) pairs, row = h * n_max + qi.
//   attn_partial  grid (n_heads * ceil(n_max / ATT_QTILE), <= ceil(cap / chunk)), block
//                 ATT_THREADS, dynamic shared memory (chunk * (2 d + 1) + ATT_QTILE * d +
//                 chunk * ATT_PQ + 2 ATT_QTILE) floats; a block takes ATT_QTILE queries of
//                 one head and the splits blockIdx.y, + gridDim.y, ... that hold keys for
//                 any of them. Stages the split's keys and values in shared memory once for
//                 all its queries, then each row's scaled scores (kept in `scores` [rows,
//                 cap] for the mass), their max m, sum l of exp(score - m) and the
//                 exp-weighted sum of values; a thread takes a key (then a value column) for
//                 a pair of queries, so that many warps share the work of few blocks.
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
//   attn_mass     grid ceil(cap / MASS_KEYS), block 32 w (w warps, MASS_KEYS <= w <= 32;
//                 a warp's lanes are MASS_KEYS keys x 32 / MASS_KEYS rows, each row lane
//                 summing the rows 4 w apart, then warp k adds up key k's row lanes in a
//                 fixed order): for key t < start + n, adds the probabilities of every row
//                 (layers x heads x queries, stride cap) to mass[t]; with `first` set and state[STATE_MASS_ACC] 0 (a call's first
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

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_partial(const int* __restrict__ state, const float* __restrict__ q,
             const kvt* __restrict__ k_cache, const kvt* __restrict__ v_cache,
             const float* __restrict__ k_scale, const float* __restrict__ v_scale,
             float* __restrict__ scores, float* __restrict__ part_ml, float* __restrict__ part_o,
             int n_max, int n_heads, int n_kv, int d, int cap, int n_splits, int chunk,
             float scale) {
  static_assert(ATT_QTILE % 2 == 0, "queries go in pairs");
  pdl_wait_then_release();
  extern __shared__ float4 smem4[];
  const int kp = d + 1;   // a key row's pitch: a warp's keys at one column sit in 32 banks
  float* ks = reinterpret_cast<float*>(smem4);   // [chunk][d + 1]
  float* vs = ks + chunk * kp;                    // [chunk][d] (chunk % 4 == 0: aligned)
  float* qs = vs + chunk * d;                     // [d][ATT_QTILE]: a column's queries
  float* p = qs + d * ATT_QTILE;                  // [chunk][ATT_PQ]: scores, then exps
  float* mls = p + chunk * ATT_PQ;                // [ATT_QTILE][2]: each query's m, l
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  const int qtiles = (n_max + ATT_QTILE - 1) / ATT_QTILE;
  const int h = blockIdx.x / qtiles, q0 = (blockIdx.x % qtiles) * ATT_QTILE;
  const int n = state[STATE_N], start = state[STATE_START];
  if (q0 >= n) return;
  const int nq = min(ATT_QTILE, n - q0), hk = h / (n_heads / n_kv), d4 = d / 4;
  for (int e = threadIdx.x; e < ATT_QTILE * d; e += blockDim.x) {
    const int qq = e / d, c = e % d;
    qs[c * ATT_QTILE + qq] = qq < nq ? q[(long long)(q0 + qq) * n_heads * d + h * d + c] : 0.f;
  }
  const int seen = start + q0 + nq;   // keys the block's last query sees
  // the splits s = blockIdx.y, + gridDim.y, ... (grid-stride: the grid's y may be smaller
  // than n_splits, so a prefill near the start of the cache launches few empty blocks)
  for (int s = blockIdx.y; s < n_splits; s += gridDim.y) {
    const int k0 = s * chunk;
    if (k0 >= seen) break;  // so are the later splits; attn_combine reads only those with keys
    const int count = min(chunk, seen - k0);
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
          float* kr = ks + (e / d4) * kp + 4 * (e % d4);
          kr[0] = tk[u].x; kr[1] = tk[u].y; kr[2] = tk[u].z; kr[3] = tk[u].w;
          smem4[(chunk * kp) / 4 + e] = tv[u];   // vs, row e / d4, column e % d4
        }
      }
    }
    __syncthreads();   // (the first split's also publishes qs)
    // scores: an item is a key and a pair of queries (a warp's items share the pair: its
    // reads of q are broadcasts); query qq sees keys up to start + q0 + qq
    for (int it = threadIdx.x; it < chunk * (ATT_QTILE / 2); it += blockDim.x) {
      const int j = it % chunk, qg = it / chunk;
      float acc[2] = {0.f, 0.f};
      if (j < count) {
        const float* kr = ks + j * kp;
        const float* qc = qs + 2 * qg;
#pragma unroll 8
        for (int c = 0; c < d; ++c) {
          const float kv = kr[c];
          const float2 qv = *reinterpret_cast<const float2*>(qc + c * ATT_QTILE);
          acc[0] = fmaf(kv, qv.x, acc[0]);
          acc[1] = fmaf(kv, qv.y, acc[1]);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int qq = 2 * qg + e;
        const bool visible = j < count && qq < nq && k0 + j <= start + q0 + qq;
        const float a = acc[e] * scale;
        p[j * ATT_PQ + qq] = visible ? a : NEG_INF;
        if (visible) scores[((long long)h * n_max + q0 + qq) * cap + k0 + j] = a;
      }
    }
    __syncthreads();
    // each query's max m and sum l of exp(score - m) over the split: a warp a query
    for (int qq = warp; qq < ATT_QTILE; qq += warps) {
      float m = NEG_INF;
      for (int j = lane; j < chunk; j += WARP) m = fmaxf(m, p[j * ATT_PQ + qq]);
      m = warp_max(m);
      float l = 0.f;
      for (int j = lane; j < chunk; j += WARP) {
        const float sc = p[j * ATT_PQ + qq];
        const float e = sc == NEG_INF ? 0.f : expf(sc - m);
        p[j * ATT_PQ + qq] = e;
        l += e;
      }
      l = warp_sum(l);
      if (lane == 0) { mls[2 * qq] = m; mls[2 * qq + 1] = l; }
    }
    __syncthreads();
    // values: an item is a column and a pair of queries, the keys in order
    for (int it = threadIdx.x; it < d * (ATT_QTILE / 2); it += blockDim.x) {
      const int i = it % d, qg = it / d;
      float o[2] = {0.f, 0.f};
#pragma unroll 8
      for (int j = 0; j < count; ++j) {
        const float v = vs[j * d + i];
        const float2 pv = *reinterpret_cast<const float2*>(p + j * ATT_PQ + 2 * qg);
        o[0] = fmaf(pv.x, v, o[0]);
        o[1] = fmaf(pv.y, v, o[1]);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int qq = 2 * qg + e;
        if (qq < nq && k0 <= start + q0 + qq)
          part_o[(((long long)h * n_max + q0 + qq) * n_splits + s) * d + i] = o[e];
      }
    }
    if (threadIdx.x < nq && k0 <= start + q0 + threadIdx.x) {
      float* ml = part_ml + (((long long)h * n_max + q0 + threadIdx.x) * n_splits + s) * 2;
      ml[0] = mls[2 * threadIdx.x];
      ml[1] = mls[2 * threadIdx.x + 1];
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

extern "C" __global__ void __launch_bounds__(1024)
attn_mass(const int* __restrict__ state, const float* __restrict__ probs,
          const float* __restrict__ row_ml, float* __restrict__ mass, int n_max, int n_rows,
          int cap, int first, int tok_stride) {
  pdl_wait_then_release();
  constexpr int ROW_LANES = WARP / MASS_KEYS;          // rows a warp reads at once
  __shared__ float part[WARP * ROW_LANES][MASS_KEYS + 1];   // [row lane][key], padded
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
  const int end = start + n, k0 = blockIdx.x * MASS_KEYS;
  if (k0 >= end) return;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  const int lanes = warps * ROW_LANES;                  // row lanes of the block
  const int rl = warp * ROW_LANES + lane / MASS_KEYS, key = lane % MASS_KEYS, t = k0 + key;
  float acc = 0.f;
  if (t < end) {
#pragma unroll 4
    for (int r = rl; r < n_rows; r += lanes) {
      const int qi = r % n_max;
      if (qi < n && t <= start + qi) {
        const float v = probs[(long long)r * cap + t];
        acc += row_ml ? expf(v - row_ml[2 * r]) / row_ml[2 * r + 1] : v;
      }
    }
  }
  part[rl][key] = acc;
  __syncthreads();
  if (warp < MASS_KEYS && k0 + warp < end) {   // warp w adds up key w's row lanes in order
    float sum = 0.f;
    for (int i = lane; i < lanes; i += WARP) sum += part[i][warp];
    sum = warp_sum(sum);
    if (lane == 0) {
      const int tk = k0 + warp;
      const bool keep_old = !first || (state[STATE_MASS_ACC] && tk < start);
      mass[tk] = keep_old ? mass[tk] + sum : sum;
    }
  }
}
