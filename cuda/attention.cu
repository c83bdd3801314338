// attention.cu: causal GQA attention of the call's n queries over the KV cache, split over
// the cache length (flash-decoding), plus each cached token's attention mass.
//
// Query qi of head h sits at position start + qi and sees keys 0 .. start + qi. Head h
// reads kv head h / (n_heads / n_kv). Rows are (h, qi) pairs, row = h * n_max + qi.
//   attn_partial  grid (n_heads * n_max, ceil(cap / chunk)), block 128, dynamic shared
//                 memory (2 * chunk * d + chunk + d) floats: stages the split's keys and
//                 values in shared memory, then the row's scaled scores (kept in `scores`
//                 [rows, cap] for the mass), their max m, sum l of exp(score - m) and the
//                 exp-weighted sum of values.
//   attn_combine  grid (n_heads * n_max), block 128: merges the splits into out
//                 [n_max, n_heads * d] and turns the row's scores into probabilities.
//   attn_mass     grid ceil(cap / 32), block 256: for key t < start + n, adds the
//                 probabilities of every row (layers x heads x queries, stride cap) to
//                 mass[t]; with `first` set and state[STATE_MASS_ACC] 0 (a call's first
//                 chunk), old values are dropped.
// Dtypes: q, cache, scores, partials, mass: fp32. head_dim d: a multiple of 4, <= 256.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128)
attn_partial(const int* __restrict__ state, const float* __restrict__ q,
             const float* __restrict__ k_cache, const float* __restrict__ v_cache,
             float* __restrict__ scores, float* __restrict__ part_ml, float* __restrict__ part_o,
             int n_max, int n_heads, int n_kv, int d, int cap, int n_splits, int chunk,
             float scale) {
  extern __shared__ float4 smem4[];
  float* ks = reinterpret_cast<float*>(smem4);   // [chunk, d]
  float* vs = ks + chunk * d;                     // [chunk, d]
  float* p = vs + chunk * d;                      // [chunk]
  float* qs = p + chunk;                          // [d]
  __shared__ float scratch[WARP];
  const int row = blockIdx.x, h = row / n_max, qi = row % n_max, s = blockIdx.y;
  const int n = state[STATE_N], start = state[STATE_START];
  if (qi >= n) return;
  const int k0 = s * chunk, k1 = min(k0 + chunk, start + qi + 1);
  if (k0 >= k1) return;  // attn_combine reads only the splits that hold keys
  const int hk = h / (n_heads / n_kv), count = k1 - k0, d4 = d / 4;
  for (int e = threadIdx.x; e < count * d4; e += blockDim.x) {
    const int j = e / d4, c = e % d4;
    const long long src = ((long long)(k0 + j) * n_kv + hk) * d4 + c;
    smem4[j * d4 + c] = reinterpret_cast<const float4*>(k_cache)[src];
    smem4[chunk * d4 + j * d4 + c] = reinterpret_cast<const float4*>(v_cache)[src];
  }
  for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = q[(long long)qi * n_heads * d + h * d + i];
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
}

extern "C" __global__ void __launch_bounds__(128)
attn_combine(const int* __restrict__ state, const float* __restrict__ part_ml,
             const float* __restrict__ part_o, float* __restrict__ out,
             float* __restrict__ scores, int n_max, int n_heads, int d, int cap, int n_splits,
             int chunk) {
  const int row = blockIdx.x, h = row / n_max, qi = row % n_max;
  const int n = state[STATE_N], start = state[STATE_START];
  if (qi >= n) return;
  const int visible = start + qi + 1, used = (visible + chunk - 1) / chunk;
  const float* pml = part_ml + (long long)row * n_splits * 2;
  float M = NEG_INF;
  for (int s = 0; s < used; ++s) M = fmaxf(M, pml[2 * s]);
  float L = 0.f;
  for (int s = 0; s < used; ++s) L += pml[2 * s + 1] * expf(pml[2 * s] - M);
  const float* po = part_o + (long long)row * n_splits * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < used; ++s) o = fmaf(po[(long long)s * d + i], expf(pml[2 * s] - M), o);
    out[(long long)qi * n_heads * d + h * d + i] = o / L;
  }
  float* sc = scores + (long long)row * cap;
  for (int t = threadIdx.x; t < visible; t += blockDim.x) sc[t] = expf(sc[t] - M) / L;
}

extern "C" __global__ void __launch_bounds__(256)
attn_mass(const int* __restrict__ state, const float* __restrict__ probs,
          float* __restrict__ mass, int n_max, int n_rows, int cap, int first) {
  __shared__ float part[8][WARP];
  const int n = state[STATE_N], start = state[STATE_START], end = start + n;
  if (blockIdx.x * WARP >= end) return;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int t = blockIdx.x * WARP + lane;
  float acc = 0.f;
  if (t < end) {
#pragma unroll 4
    for (int r = warp; r < n_rows; r += 8) {
      const int qi = r % n_max;
      if (qi < n && t <= start + qi) acc += probs[(long long)r * cap + t];
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
