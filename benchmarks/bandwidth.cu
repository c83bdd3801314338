// bandwidth.cu: read_sum reads n float4 once (grid-stride) and writes one sum per block,
// so the benchmark can measure the device's read bandwidth with our own code.
// Geometry: any grid, block 256. Dtypes: fp32.
// read_sum_wide: the same with a block of 1024 threads and 8 loads in flight a thread
// (128 KB a block), so a grid of a block an SM measures what that many SMs can read
// (dev/cuda/probe_layer_floor.py). n % (8 * grid * 1024) == 0.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
read_sum(const float4* __restrict__ data, long long n, float* __restrict__ out) {
  __shared__ float scratch[WARP];
  float acc = 0.f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float4 v = __ldg(data + i);
    acc += (v.x + v.y) + (v.z + v.w);
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(1024)
read_sum_wide(const float4* __restrict__ data, long long n, float* __restrict__ out) {
  __shared__ float scratch[WARP];
  float acc = 0.f;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 8 * stride) {
    float4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldg(data + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += (v[j].x + v[j].y) + (v[j].z + v[j].w);
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}
