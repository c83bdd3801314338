// bandwidth.cu: read_sum reads n float4 once (grid-stride) and writes one sum per block,
// so the benchmark can measure the device's read bandwidth with our own code.
// Geometry: any grid, block 256. Dtypes: fp32.
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
