// argmax.cu: greedy next token under an allowed-token mask (constrained decoding).
//
// Candidates are allowed[0 .. count) (ascending ids) or, when count < 0, every id below
// vocab. Ties go to the smallest id, as numpy's argmax does.
// Geometry: grid = ARGMAX_BLOCKS, block = 256. Each block reduces a grid-stride share to one
// (value, id) in part_v / part_i; the last block to finish (counter in state) reduces
// those, writes state[STATE_RESULT] and resets the counter for the next launch.
// argmax_rows does the same for each row of a verify pass (grid.y = rows).
// Dtypes: logits, part_v fp32; allowed, part_i, state int32.
#include "common.cuh"

__device__ __forceinline__ void better(float v, int i, float* bv, int* bi) {
  if (v > *bv || (v == *bv && i < *bi)) { *bv = v; *bi = i; }
}

__device__ void block_argmax(float* v, int* i) {
  __shared__ float sv[WARP];
  __shared__ int si[WARP];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  for (int o = WARP / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, *v, o);
    const int oi = __shfl_xor_sync(FULL_MASK, *i, o);
    better(ov, oi, v, i);
  }
  __syncthreads();
  if (lane == 0) { sv[warp] = *v; si[warp] = *i; }
  __syncthreads();
  if (warp == 0) {
    *v = lane < blockDim.x / WARP ? sv[lane] : NEG_INF;
    *i = lane < blockDim.x / WARP ? si[lane] : 0x7fffffff;
    for (int o = WARP / 2; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(FULL_MASK, *v, o);
      const int oi = __shfl_xor_sync(FULL_MASK, *i, o);
      better(ov, oi, v, i);
    }
  }
}

// One block's share of the candidates, then (the last block of the row to finish, by
// *counter) the row's result; the counter is reset for the next launch.
__device__ __forceinline__ void argmax_body(const float* __restrict__ logits,
                                            const int* __restrict__ allowed, int count,
                                            int vocab, float* __restrict__ part_v,
                                            int* __restrict__ part_i, int* counter,
                                            int* result) {
  __shared__ bool last;
  const int total = count < 0 ? vocab : count;
  float v = NEG_INF;
  int id = 0x7fffffff;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < total; c += gridDim.x * blockDim.x) {
    const int tok = count < 0 ? c : allowed[c];
    better(logits[tok], tok, &v, &id);
  }
  block_argmax(&v, &id);
  if (threadIdx.x == 0) {
    part_v[blockIdx.x] = v;
    part_i[blockIdx.x] = id;
    __threadfence();
    last = atomicAdd(counter, 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  v = NEG_INF;
  id = 0x7fffffff;
  for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    better(((volatile float*)part_v)[b], ((volatile int*)part_i)[b], &v, &id);
  }
  block_argmax(&v, &id);
  if (threadIdx.x == 0) {
    *result = id;
    *counter = 0;
  }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_masked(int* __restrict__ state, const float* __restrict__ logits,
              const int* __restrict__ allowed, int count, int vocab, float* __restrict__ part_v,
              int* __restrict__ part_i) {
  pdl_wait_then_release();
  argmax_body(logits, allowed, count, vocab, part_v, part_i, state + STATE_COUNTER,
              state + STATE_RESULT);
}

// The rows of a verify pass: grid (ARGMAX_BLOCKS, rows), row r = blockIdx.y over logits
// [rows, vocab], its candidates allowed[offsets[r] .. + counts[r]) (counts[r] < 0: every
// id); rows at or past state[STATE_N] exit. Each row's result goes to results[r], its
// partials to part_v/part_i[r * gridDim.x ..], its counter is counters[r].
extern "C" __global__ void __launch_bounds__(256)
argmax_rows(const int* __restrict__ state, const float* __restrict__ logits,
            const int* __restrict__ allowed, const int* __restrict__ offsets,
            const int* __restrict__ counts, int vocab, float* __restrict__ part_v,
            int* __restrict__ part_i, int* counters, int* results) {
  pdl_wait_then_release();
  const int r = blockIdx.y;
  if (r >= state[STATE_N]) return;
  argmax_body(logits + (long long)r * vocab, allowed + offsets[r], counts[r], vocab,
              part_v + r * gridDim.x, part_i + r * gridDim.x, counters + r, results + r);
}
