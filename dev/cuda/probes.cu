// probes.cu: measurement kernels for the decode step's floor (not part of the node).
//
// grid_sync_probe  grid = any co-resident size, block = any: `rounds` barriers; in each,
//   block b writes round r to slot[b] and after the barrier checks that block
//   (b + 1) % grid wrote r too; a miss adds to errors[0] (probe_grid_sync.py).
#include "common.cuh"
#include "grid_sync.cuh"
#include "pdl.cuh"

extern "C" __global__ void grid_sync_probe(unsigned* bar, int* slot, int* errors, int rounds) {
  unsigned target = 0;
  for (int r = 1; r <= rounds; ++r) {
    if (threadIdx.x == 0) slot[blockIdx.x] = r;
    grid_sync(bar, &target);
    if (threadIdx.x == 0) {
      int v;
      asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(slot + (blockIdx.x + 1) % gridDim.x));
      if (v < r) atomicAdd(errors, 1);
    }
  }
  grid_sync_reset(bar, &target);
}

// ---- layer_floor: the least a decode phase must do, for probe_layer_floor.py -------
// A phase of a decode step reads the whole activation vector another block wrote, reduces
// it (RMSNorm), multiplies it by its share of a matrix and writes its share of the next
// vector for every other block to read. These kernels do only that, with the block's
// matrix rows already in shared memory, so their time bounds from below what any
// multi-block decode step spends on one phase, whatever its weights cost.
//
// floor_phase: x_out[r] = inv_rms(x_in) * (W[r] . x_in) for the block's own rows r in
//   [first, first + own), own = ceil(d / grid) (rows = 0: x_out[r] = x_in[r] * inv_rms);
//   the block's `rows` staged rows (W rows first, first + 1, ... mod d; rows >= own, even)
//   are all multiplied, those past its own into a sink (so the work cannot be dropped).
//   inv_rms = 1 / sqrt(mean(x_in^2) + 1e-6). d % 8 == 0.
// layer_floor_probe  grid = SMs (cooperative), block 256, dynamic shared memory
//   4 * d + sizeof(wt) * rows * d: `phases` phases, a grid_sync before each; x ping-pongs
//   between xs[0:d] and xs[d:2d] (phase p reads half p % 2).
// layer_floor_step   grid = any, block 256, the same shared memory: one phase a launch,
//   under programmatic dependent launch, the rows copied in before the wait for the
//   previous launch; release_first: the next launch is let start before that wait (as the
//   staged matmuls do), else after it (as the other kernels do). A chain of these in a
//   graph is the kernel-per-phase design's floor.
// layer_floor_splitk grid = any, block 256, no dynamic shared memory: the hand-off of a
//   split-K phase (a fused SwiGLU + down, say), where every block adds a partial of the
//   whole next vector instead of writing its own rows: x_out[r] += x_in[r] * inv_rms / grid
//   for every r (red.global.add, four floats at a time on sm_90), after zeroing its own
//   rows of x_zero, the buffer the next launch adds into (a chain rotates three buffers,
//   so each one is zero before it is added into). Under programmatic dependent launch.
//   d <= 2048, d % 4 == 0.
// cluster_floor_probe grid = clusters x cluster size (launched with a cluster dimension;
//   sm_90, a trapping stub below), block 256, dynamic shared memory 8 * ceil(d / size):
//   the same phase kept inside one thread-block cluster: rank r holds its slice of x in
//   shared memory, every block reads the whole vector from its cluster's shared memories
//   (mapa + ld.shared::cluster), takes its RMS and writes its slice of the next one; a
//   cluster barrier a round (x ping-pongs between two slices). Every cluster runs the same
//   rounds from x0; each writes the result to out.
// cluster_push_probe the same rounds with the exchange pushed: every block keeps the whole
//   vector in its own shared memory (dynamic shared memory 8 * d, two copies), reads it
//   locally, and writes its slice of the next one into every block of the cluster
//   (st.shared::cluster), then the cluster barrier.
// Dtypes: x fp32, W wt.
__device__ __forceinline__ void floor_rows(int d, int* first, int* own) {
  const int per = (d + gridDim.x - 1) / gridDim.x;
  *first = blockIdx.x * per;
  *own = max(0, min(per, d - *first));
}

// Rows first, first + 1, ... (mod d) of w into ws with cp.async (pdl.cuh), 16 bytes a copy;
// the caller waits for them (cp_async_wait_all) and then for the whole block.
__device__ __forceinline__ void floor_stage(const wt* w, wt* ws, int d, int rows, int first) {
  const int chunks = d * (int)sizeof(wt) / 16;   // per row
  for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
    const int j = i / chunks, c = i % chunks;
    cp_async16(reinterpret_cast<char*>(ws + (long long)j * d) + 16 * c,
               reinterpret_cast<const char*>(w + (long long)((first + j) % d) * d) + 16 * c);
  }
}

__device__ __forceinline__ void floor_phase(const float* x_in, float* x_out, float* xhat,
                                            const wt* ws, int d, int rows, int first, int own,
                                            float* scratch, float* sink) {
  float ss = 0.f;
  for (int k = threadIdx.x; k < d; k += blockDim.x) {
    const float v = ld_cg(x_in + k);
    xhat[k] = v;
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / d + 1e-6f);   // its barriers publish xhat
  if (rows == 0) {
    for (int r = threadIdx.x; r < own; r += blockDim.x) x_out[first + r] = xhat[first + r] * inv;
    return;
  }
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  for (int q = warp; 2 * q < rows; q += warps) {
    const wt* w0 = ws + (long long)(2 * q) * d;
    float a0 = 0.f, a1 = 0.f;
    for (int k = 8 * lane; k < d; k += 8 * WARP)
      fma_pair8(*reinterpret_cast<const w8raw*>(w0 + k),
                *reinterpret_cast<const w8raw*>(w0 + d + k), xhat + k, a0, a1);
    a0 = warp_sum(a0) * inv;
    a1 = warp_sum(a1) * inv;
    if (lane == 0) {
      if (2 * q < own) x_out[first + 2 * q] = a0; else *sink += a0;
      if (2 * q + 1 < own) x_out[first + 2 * q + 1] = a1; else *sink += a1;
    }
  }
}

extern "C" __global__ void __launch_bounds__(256)
layer_floor_probe(unsigned* bar, float* xs, const wt* w, int d, int rows, int phases,
                  float* sink) {
  extern __shared__ __align__(16) float floor_smem[];
  __shared__ float scratch[WARP];
  float* xhat = floor_smem;
  wt* ws = reinterpret_cast<wt*>(floor_smem + d);
  int first, own;
  floor_rows(d, &first, &own);
  floor_stage(w, ws, d, rows, first);
  cp_async_wait_all();
  float acc = 0.f;
  unsigned target = 0;
  for (int p = 0; p < phases; ++p) {
    grid_sync(bar, &target);   // its __syncthreads also publishes the staged rows
    floor_phase(xs + (p & 1) * d, xs + ((p + 1) & 1) * d, xhat, ws, d, rows, first, own,
                scratch, &acc);
  }
  grid_sync_reset(bar, &target);
  if (acc != 0.f) atomicAdd(sink, acc);
}

extern "C" __global__ void __launch_bounds__(256)
layer_floor_step(const float* x_in, float* x_out, const wt* w, int d, int rows, int release_first,
                 float* sink) {
  extern __shared__ __align__(16) float floor_smem[];
  __shared__ float scratch[WARP];
  float* xhat = floor_smem;
  wt* ws = reinterpret_cast<wt*>(floor_smem + d);
  int first, own;
  floor_rows(d, &first, &own);
  floor_stage(w, ws, d, rows, first);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (release_first) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  pdl_wait_then_release();
  cp_async_wait_all();
  __syncthreads();
  float acc = 0.f;
  floor_phase(x_in, x_out, xhat, ws, d, rows, first, own, scratch, &acc);
  if (acc != 0.f) atomicAdd(sink, acc);
}

extern "C" __global__ void __launch_bounds__(256)
layer_floor_splitk(const float* x_in, float* x_out, float* x_zero, int d) {
  __shared__ float xhat[2048];
  __shared__ float scratch[WARP];
  pdl_wait_then_release();
  int first, own;
  floor_rows(d, &first, &own);
  float ss = 0.f;
  for (int k = threadIdx.x; k < d; k += blockDim.x) {
    const float v = ld_cg(x_in + k);
    xhat[k] = v;
    ss += v * v;
  }
  const float scale = rsqrtf(block_sum(ss, scratch) / d + 1e-6f) / gridDim.x;
  for (int r = threadIdx.x; r < own; r += blockDim.x) x_zero[first + r] = 0.f;
  for (int k = 4 * threadIdx.x; k < d; k += 4 * blockDim.x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(x_out + k),
                 "f"(xhat[k] * scale), "f"(xhat[k + 1] * scale), "f"(xhat[k + 2] * scale),
                 "f"(xhat[k + 3] * scale) : "memory");
#else
    for (int j = 0; j < 4; ++j) atomicAdd(x_out + k + j, xhat[k + j] * scale);
#endif
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The block's place in its cluster and its slice [first, first + own) of a d-vector spread
// over the cluster in slices of per.
struct ClusterSlice {
  unsigned rank, size;
  int per, first, own;
};

__device__ __forceinline__ ClusterSlice cluster_slice(int d) {
  ClusterSlice c;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(c.rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(c.size));
  c.per = (d + c.size - 1) / c.size;
  c.first = c.rank * c.per;
  c.own = max(0, min(c.per, d - c.first));
  return c;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

extern "C" __global__ void __launch_bounds__(256)
cluster_floor_probe(const float* x0, float* out, int d, int rounds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) float floor_smem[];   // [2][per]
  __shared__ float scratch[WARP];
  const ClusterSlice c = cluster_slice(d);
  const int per = c.per, first = c.first, own = c.own;
  for (int j = threadIdx.x; j < own; j += blockDim.x) floor_smem[j] = x0[first + j];
  cluster_sync();
  for (int p = 0; p < rounds; ++p) {
    const unsigned cur = __cvta_generic_to_shared(floor_smem + (p & 1) * per);
    float ss = 0.f;
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
      const unsigned owner = k / per;
      unsigned remote;
      float v;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                   : "=r"(remote) : "r"(cur + 4u * (k - owner * per)), "r"(owner));
      asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
      ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / d + 1e-6f);
    float* mine = floor_smem + (p & 1) * per;
    float* next = floor_smem + ((p + 1) & 1) * per;
    for (int j = threadIdx.x; j < own; j += blockDim.x) next[j] = mine[j] * inv;
    cluster_sync();
  }
  for (int j = threadIdx.x; j < own; j += blockDim.x)
    out[first + j] = floor_smem[(rounds & 1) * per + j];
#else
  asm volatile("trap;");   // clusters need sm_90
#endif
}

extern "C" __global__ void __launch_bounds__(256)
cluster_push_probe(const float* x0, float* out, int d, int rounds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) float push_smem[];   // [2][d]
  __shared__ float scratch[WARP];
  const ClusterSlice c = cluster_slice(d);
  const int first = c.first, own = c.own;
  for (int k = threadIdx.x; k < d; k += blockDim.x) push_smem[k] = x0[k];
  cluster_sync();
  for (int p = 0; p < rounds; ++p) {
    const float* cur = push_smem + (p & 1) * d;
    float ss = 0.f;
    for (int k = threadIdx.x; k < d; k += blockDim.x) ss += cur[k] * cur[k];
    const float inv = rsqrtf(block_sum(ss, scratch) / d + 1e-6f);
    const unsigned next = __cvta_generic_to_shared(push_smem + ((p + 1) & 1) * d + first);
    for (int i = threadIdx.x; i < own * (int)c.size; i += blockDim.x) {
      const int dst = i / own, j = i - dst * own;
      unsigned remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                   : "=r"(remote) : "r"(next + 4u * j), "r"(dst));
      asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(cur[first + j] * inv)
                   : "memory");
    }
    cluster_sync();
  }
  for (int j = threadIdx.x; j < own; j += blockDim.x)
    out[first + j] = push_smem[(rounds & 1) * d + first + j];
#else
  asm volatile("trap;");   // clusters need sm_90
#endif
}

