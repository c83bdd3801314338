// compact.cu: cache compaction with RoPE re-rotation (eviction).
//
// Slot keep[j] moves to slot j (keep ascending, j <= keep[j]); its keys are rotated by
// delta = j - keep[j] (RoPE composes: rope(p + delta) = rotate(rope(p), delta)) with the
// cos/sin table row cap + delta; values and the attention mass move as they are. Two
// passes through scratch buffers, since slot j may still be the source of a lower slot.
//   compact_gather  grid (m, layers), block 128: cache -> scratch (rotated), mass -> scratch
//   compact_store   grid (m, layers), block 128: scratch -> cache slots 0 .. m-1
// With an int8 cache (RT_KV_INT8) rotated keys are quantized again, per slot and kv head.
//   kv_quantize     grid (n_max), block 32 * min(n_kv, 8): the call's fp32 keys and values
//                   into the int8 cache (only with RT_KV_INT8)
// Dtypes: caches [layers, cap, n_kv, d] kvt (common.cuh) with scales [layers, cap, n_kv]
// (int8; null with fp32), tables [2 * cap, d / 2] fp32, keep int32.
#include "common.cuh"

// Store one head's d values (rotated keys, or values) of a slot: fp32 as they are, or int8
// codes with scale = max|x| / 127 (code = round-half-even(x / scale), fp32 division: the
// numpy backend's quantize_kv). A warp writes a head; lane l takes values l, l + 32, ...
__device__ __forceinline__ void kv_store_head(kvt* dst, float* dst_scale, const float* x, int d) {
#if defined(RT_KV_INT8)
  const int lane = threadIdx.x % WARP;
  float amax = 0.f;
  for (int i = lane; i < d; i += WARP) amax = fmaxf(amax, fabsf(x[i]));
  amax = warp_max(amax);
  const float scale = amax / 127.f;
  for (int i = lane; i < d; i += WARP)
    dst[i] = (kvt)(scale > 0.f ? fminf(fmaxf(rintf(x[i] / scale), -127.f), 127.f) : 0.f);
  if (lane == 0) *dst_scale = scale;
#else
  (void)dst_scale;
  for (int i = threadIdx.x % WARP; i < d; i += WARP) dst[i] = x[i];
#endif
}

// The call's fp32 keys and values (staging rows [n_max, n_kv, d], by token, written by the
// q/k/v matmul) into the int8 cache at slots start .. start + n - 1: a block a token, a warp
// a head (heads strided over the block's warps).
extern "C" __global__ void __launch_bounds__(256)
kv_quantize(const int* __restrict__ state, const float* __restrict__ k_stage,
            const float* __restrict__ v_stage, kvt* __restrict__ k, kvt* __restrict__ v,
            float* __restrict__ k_scale, float* __restrict__ v_scale, int n_kv, int d) {
  pdl_wait_then_release();
  const int t = blockIdx.x, n = state[STATE_N], start = state[STATE_START];
  if (t >= n) return;
  const long long slot = start + t;
  for (int h = threadIdx.x / WARP; h < n_kv; h += blockDim.x / WARP) {
    const long long src = ((long long)t * n_kv + h) * d, dst = (slot * n_kv + h) * d;
    kv_store_head(k + dst, k_scale + slot * n_kv + h, k_stage + src, d);
    kv_store_head(v + dst, v_scale + slot * n_kv + h, v_stage + src, d);
  }
}

#if !defined(RT_KV_INT8)
extern "C" __global__ void __launch_bounds__(128)
compact_gather(const int* __restrict__ keep, const kvt* __restrict__ k, const kvt* __restrict__ v,
               const float* __restrict__ k_scale, const float* __restrict__ v_scale,
               const float* __restrict__ mass, kvt* __restrict__ k_tmp, kvt* __restrict__ v_tmp,
               float* __restrict__ k_scale_tmp, float* __restrict__ v_scale_tmp,
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
#else
// int8: a warp a head; a lane dequantizes and rotates the pairs (i, i + d/2), i = lane, lane
// + 32, ... (at most four: d <= 256), then the head is quantized again (kv_store_head's
// rule); values and their scales move as stored.
extern "C" __global__ void __launch_bounds__(128)
compact_gather(const int* __restrict__ keep, const kvt* __restrict__ k, const kvt* __restrict__ v,
               const float* __restrict__ k_scale, const float* __restrict__ v_scale,
               const float* __restrict__ mass, kvt* __restrict__ k_tmp, kvt* __restrict__ v_tmp,
               float* __restrict__ k_scale_tmp, float* __restrict__ v_scale_tmp,
               float* __restrict__ mass_tmp, const float* __restrict__ cos_t,
               const float* __restrict__ sin_t, int cap, int n_kv, int d) {
  pdl_wait_then_release();
  const int j = blockIdx.x, layer = blockIdx.y, src = keep[j], half = d / 2;
  const int lane = threadIdx.x % WARP;
  const long long src_slot = (long long)layer * cap + src, dst_slot = (long long)layer * cap + j;
  const long long row = (long long)(cap + j - src) * half;
  for (int h = threadIdx.x / WARP; h < n_kv; h += blockDim.x / WARP) {
    const kvt* ks = k + (src_slot * n_kv + h) * d;
    const float s_in = k_scale[src_slot * n_kv + h];
    float lo[4], hi[4], amax = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int i = lane + p * WARP;
      lo[p] = hi[p] = 0.f;
      if (i < half) {
        const float x1 = (float)ks[i] * s_in, x2 = (float)ks[i + half] * s_in;
        const float c = cos_t[row + i], s = sin_t[row + i];
        lo[p] = x1 * c - x2 * s;
        hi[p] = x2 * c + x1 * s;
        amax = fmaxf(amax, fmaxf(fabsf(lo[p]), fabsf(hi[p])));
      }
    }
    amax = warp_max(amax);
    const float scale = amax / 127.f;
    kvt* kd = k_tmp + (dst_slot * n_kv + h) * d;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int i = lane + p * WARP;
      if (i < half) {
        kd[i] = (kvt)(scale > 0.f ? fminf(fmaxf(rintf(lo[p] / scale), -127.f), 127.f) : 0.f);
        kd[i + half] = (kvt)(scale > 0.f ? fminf(fmaxf(rintf(hi[p] / scale), -127.f), 127.f)
                                         : 0.f);
      }
    }
    if (lane == 0) {
      k_scale_tmp[dst_slot * n_kv + h] = scale;
      v_scale_tmp[dst_slot * n_kv + h] = v_scale[src_slot * n_kv + h];
    }
    for (int i = lane; i < d; i += WARP)
      v_tmp[(dst_slot * n_kv + h) * d + i] = v[(src_slot * n_kv + h) * d + i];
  }
  if (layer == 0 && threadIdx.x == 0) mass_tmp[j] = mass[src];
}
#endif

extern "C" __global__ void __launch_bounds__(128)
compact_store(kvt* __restrict__ k, kvt* __restrict__ v, float* __restrict__ k_scale,
              float* __restrict__ v_scale, float* __restrict__ mass,
              const kvt* __restrict__ k_tmp, const kvt* __restrict__ v_tmp,
              const float* __restrict__ k_scale_tmp, const float* __restrict__ v_scale_tmp,
              const float* __restrict__ mass_tmp, int cap, int n_kv, int d) {
  pdl_wait_then_release();
  const int j = blockIdx.x, layer = blockIdx.y;
  const long long stride = (long long)n_kv * d, off = ((long long)layer * cap + j) * stride;
  for (int e = threadIdx.x; e < stride; e += blockDim.x) {
    k[off + e] = k_tmp[off + e];
    v[off + e] = v_tmp[off + e];
  }
#if defined(RT_KV_INT8)
  const long long soff = ((long long)layer * cap + j) * n_kv;
  for (int h = threadIdx.x; h < n_kv; h += blockDim.x) {
    k_scale[soff + h] = k_scale_tmp[soff + h];
    v_scale[soff + h] = v_scale_tmp[soff + h];
  }
#else
  (void)k_scale; (void)v_scale; (void)k_scale_tmp; (void)v_scale_tmp;
#endif
  if (layer == 0 && threadIdx.x == 0) mass[j] = mass_tmp[j];
}
