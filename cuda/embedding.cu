// embedding.cu: x[t, :] = float(table[ids[t], :]) for the n tokens of a call.
//
// Geometry: grid = n_max blocks (blocks t >= n exit), block = 256 threads over hidden.
// Dtypes: table wt [vocab, hidden]; ids int32 [n_max]; x fp32 [n_max, hidden].
// Token ids are range-checked on the host before they are uploaded.
#include "common.cuh"

extern "C" __global__ void embed_gather(const int* __restrict__ state, const int* __restrict__ ids,
                                        const wt* __restrict__ table, float* __restrict__ x,
                                        int hidden, int from_state) {
  pdl_wait_then_release();
  const int t = blockIdx.x;
  if (t >= state[STATE_N]) return;
  const int id = from_state ? state[STATE_TOKEN] : ids[t];
  const wt* row = table + (long long)id * hidden;
  for (int k = threadIdx.x; k < hidden; k += blockDim.x) x[(long long)t * hidden + k] = w2f(row[k]);
}
