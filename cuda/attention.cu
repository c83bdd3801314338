// attention.cu: causal GQA attention of the call's n queries over the KV cache, split over
// the cache length (flash-decoding), plus each cached token's attention mass.
//
// Query qi of head h sits at position start + qi and sees keys 0 .. start + qi. Head h
// reads kv head h / (n_heads / n_kv). Rows are (h, qi) pairs, row = h * n_max + qi.
//   attn_partial  grid (n_heads * n_max, n_splits), block 128: the row's scores against
//                 keys [s * ATT_CHUNK, (s + 1) * ATT_CHUNK) (scaled, kept in `scores`
//                 [n_heads, n_max, cap] for the mass), their max m, sum l of exp(score - m)
//                 and the exp-weighted sum of values, per split.
//   attn_combine  grid (n_heads * n_max), block 128: merges the splits into out
//                 [n_max, n_heads * d] and keeps (M, L) per row in ml [n_heads * n_max, 2].
//   attn_mass     grid ceil(cap / 256), block 256: for key t < start + n, adds
//                 sum over layers, heads, queries of exp(score - M) / L to mass[t]; when
//                 state[STATE_MASS_ACC] is 0 (a call's first chunk), old values are dropped.
// Dtypes: q, cache, scores, partials, mass: fp32.
#include "common.cuh"

#define ATT_CHUNK 64

extern "C" __global__ void __launch_bounds__(128)
attn_partial(const int* __restrict__ state, const float* __restrict__ q,
             const float* __restrict__ k_cache, const float* __restrict__ v_cache,
             float* __restrict__ scores, float* __restrict__ part_ml, float* __restrict__ part_o,
             int n_max, int n_heads, int n_kv, int d, int cap, int n_splits, float scale) {
  __shared__ float qs[256];
  __shared__ float p[ATT_CHUNK];
  __shared__ float scratch[WARP];
  const int row = blockIdx.x, h = row / n_max, qi = row % n_max, s = blockIdx.y;
  const int n = state[STATE_N], start = state[STATE_START];
  if (qi >= n) return;
  const int k0 = s * ATT_CHUNK, k1 = min(k0 + ATT_CHUNK, start + qi + 1);
  if (k0 >= k1) return;  // attn_combine reads only the splits that hold keys
  const int hk = h / (n_heads / n_kv), stride = n_kv * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = q[(long long)qi * n_heads * d + h * d + i];
  __syncthreads();
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
  for (int j = k0 + warp; j < k1; j += n_warps) {
    const float* kr = k_cache + (long long)j * stride + hk * d;
    float acc = 0.f;
    for (int i = lane; i < d; i += WARP) acc = fmaf(qs[i], kr[i], acc);
    acc = warp_sum(acc) * scale;
    if (lane == 0) {
      p[j - k0] = acc;
      scores[((long long)h * n_max + qi) * cap + j] = acc;
    }
  }
  __syncthreads();
  const int count = k1 - k0;
  const float mine = threadIdx.x < count ? p[threadIdx.x] : NEG_INF;
  const float m = block_max(mine, scratch);
  const float e = threadIdx.x < count ? expf(mine - m) : 0.f;
  const float l = block_sum(e, scratch);
  if (threadIdx.x < count) p[threadIdx.x] = e;
  __syncthreads();
  float* po = part_o + ((long long)row * n_splits + s) * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float o = 0.f;
    for (int j = 0; j < count; ++j) o = fmaf(p[j], v_cache[(long long)(k0 + j) * stride + hk * d + i], o);
    po[i] = o;
  }
  if (threadIdx.x == 0) {
    part_ml[((long long)row * n_splits + s) * 2] = m;
    part_ml[((long long)row * n_splits + s) * 2 + 1] = l;
  }
}

extern "C" __global__ void __launch_bounds__(128)
attn_combine(const int* __restrict__ state, const float* __restrict__ part_ml,
             const float* __restrict__ part_o, float* __restrict__ out, float* __restrict__ ml,
             int n_max, int n_heads, int d, int n_splits) {
  const int row = blockIdx.x, h = row / n_max, qi = row % n_max;
  const int n = state[STATE_N], start = state[STATE_START];
  if (qi >= n) return;
  const int used = (start + qi + 1 + ATT_CHUNK - 1) / ATT_CHUNK;
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
  if (threadIdx.x == 0) {
    ml[2 * row] = M;
    ml[2 * row + 1] = L;
  }
}

extern "C" __global__ void __launch_bounds__(256)
attn_mass(const int* __restrict__ state, const float* __restrict__ scores,
          const float* __restrict__ ml, float* __restrict__ mass, int n_max, int n_heads, int cap,
          int n_layers, long long scores_layer_stride, long long ml_layer_stride, int first) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int n = state[STATE_N], start = state[STATE_START];
  if (t >= start + n) return;
  const int q_first = max(0, t - start);  // queries at positions >= t see key t
  float acc = 0.f;
  for (int l = 0; l < n_layers; ++l) {
    const float* sc = scores + l * scores_layer_stride;
    const float* m = ml + l * ml_layer_stride;
    for (int h = 0; h < n_heads; ++h) {
      for (int qi = q_first; qi < n; ++qi) {
        const long long row = (long long)h * n_max + qi;
        acc += expf(sc[row * cap + t] - m[2 * row]) / m[2 * row + 1];
      }
    }
  }
  const bool keep_old = !first || (state[STATE_MASS_ACC] && t < start);
  mass[t] = keep_old ? mass[t] + acc : acc;
}
