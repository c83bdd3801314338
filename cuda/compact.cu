// compact.cu: cache compaction with RoPE re-rotation (eviction).
//
// Slot keep[j] moves to slot j (keep ascending, j <= keep[j]); its keys are rotated by
// delta = j - keep[j] (RoPE composes: rope(p + delta) = rotate(rope(p), delta)) with the
// cos/sin table row cap + delta; values and the attention mass move as they are. Two
// passes through scratch buffers, since slot j may still be the source of a lower slot.
//   compact_gather  grid (m, layers), block 128: cache -> scratch (rotated), mass -> scratch
//   compact_store   grid (m, layers), block 128: scratch -> cache slots 0 .. m-1
// Dtypes: caches [layers, cap, n_kv, d] fp32, tables [2 * cap, d / 2] fp32, keep int32.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128)
compact_gather(const int* __restrict__ keep, const float* __restrict__ k, const float* __restrict__ v,
               const float* __restrict__ mass, float* __restrict__ k_tmp, float* __restrict__ v_tmp,
               float* __restrict__ mass_tmp, const float* __restrict__ cos_t,
               const float* __restrict__ sin_t, int cap, int n_kv, int d) {
  pdl_wait_then_release();
  const int j = blockIdx.x, layer = blockIdx.y, src = keep[j], half = d / 2;
  const long long stride = (long long)n_kv * d;
  const float* ks = k + ((long long)layer * cap + src) * stride;
  const float* vs = v + ((long long)layer * cap + src) * stride;
  float* kd = k_tmp + ((long long)layer * cap + j) * stride;
  float* vd = v_tmp + ((long long)layer * cap + j) * stride;
  const long long row = (long long)(cap + j - src) * half;
  for (int e = threadIdx.x; e < n_kv * half; e += blockDim.x) {
    const int hk = e / half, i = e % half;
    const float x1 = ks[hk * d + i], x2 = ks[hk * d + i + half];
    const float c = cos_t[row + i], s = sin_t[row + i];
    kd[hk * d + i] = x1 * c - x2 * s;
    kd[hk * d + i + half] = x2 * c + x1 * s;
  }
  for (int e = threadIdx.x; e < stride; e += blockDim.x) vd[e] = vs[e];
  if (layer == 0 && threadIdx.x == 0) mass_tmp[j] = mass[src];
}

extern "C" __global__ void __launch_bounds__(128)
compact_store(float* __restrict__ k, float* __restrict__ v, float* __restrict__ mass,
              const float* __restrict__ k_tmp, const float* __restrict__ v_tmp,
              const float* __restrict__ mass_tmp, int cap, int n_kv, int d) {
  pdl_wait_then_release();
  const int j = blockIdx.x, layer = blockIdx.y;
  const long long stride = (long long)n_kv * d, off = ((long long)layer * cap + j) * stride;
  for (int e = threadIdx.x; e < stride; e += blockDim.x) {
    k[off + e] = k_tmp[off + e];
    v[off + e] = v_tmp[off + e];
  }
  if (layer == 0 && threadIdx.x == 0) mass[j] = mass_tmp[j];
}
