// grid_sync.cuh: a grid-wide barrier for cooperative launches (decode_persistent.cu).
//
// grid_sync: every block of a launch arrives, then all leave. bar[0] counts arrivals up
// through the launch; the k-th barrier of a launch waits until it reaches k * gridDim.x.
// bar[1] counts blocks out at the launch's end (grid_sync_reset), and the last one zeroes
// both words for the next launch, which starts only after this one ends. The blocks must
// all be resident at once: launch cooperatively (the driver refuses a grid that cannot
// be). A barrier that waits past ~2^25 polls (seconds) traps, so a launch that could never
// complete fails instead of hanging. Data written by other blocks of the launch is read
// through L2 (__ldcg; never through the non-coherent path, so no activation pointer here
// is const __restrict__).
//
#pragma once
#include "common.cuh"

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// grid_sync in two halves, so that a block can issue loads that depend on nothing (the next
// phase's weights) between its arrival and its wait: the arrival's release waits for the
// block's earlier memory operations, which must not include those loads.
__device__ __forceinline__ void grid_arrive(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0)
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(bar) : "memory");
}

__device__ __forceinline__ void grid_wait(const unsigned* bar, unsigned* target) {
  *target += gridDim.x;
  if (threadIdx.x == 0) {
    unsigned polls = 0;
    while ((int)(ld_acquire_u32(bar) - *target) < 0) {
      if (++polls > (1u << 25)) asm volatile("trap;");
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned* target) {
  grid_arrive(bar);
  grid_wait(bar, target);
}

// The launch's end: after its last barrier every block counts itself out in bar[1]; the last
// one out zeroes both words for the next launch. (Zeroing bar[0] any earlier could strand
// a block still polling for the last barrier's count.)
__device__ __forceinline__ void grid_sync_reset(unsigned* bar, unsigned* target) {
  grid_sync(bar, target);
  if (threadIdx.x == 0) {
    unsigned out;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(out) : "l"(bar + 1) : "memory");
    if (out == gridDim.x - 1) {
      bar[0] = 0;
      bar[1] = 0;
    }
  }
}
