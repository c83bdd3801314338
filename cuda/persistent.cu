// persistent.cu: a whole decode step (one token through every layer, the LM head and the
// attention mass) in one cooperative launch, the phases separated by grid-wide barriers
// instead of kernel boundaries; and the barrier's probe.
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
// decode_persistent  grid = SMs (one block of 256 threads each), dynamic shared memory
//   4 * max(hidden, q_size, inter) bytes. Phases of layer l, each after a grid_sync:
//   A  x_hat = rmsnorm(x) * attn_norm in shared memory; q, k, v = Wqkv x_hat (+ bias),
//      RoPE at position start, k and v into cache slot start (matmul.cu's qkv epilogue)
//   B  attention: a warp per (head, 32 cached keys): raw scores kept for the mass, partial
//      softmax (max, sum, weighted values); the last warp of a head to finish (counter per
//      head, reset by it) merges the head's splits in split order into attn_out and writes
//      the head's softmax max and sum (as attn_decode in attention.cu)
//   C  x += Wo attn_out             D  act = silu(Wg x_hat) * (Wu x_hat), x_hat of mlp_norm
//   E  x += Wdown act
//   then the final norm and the LM head into logits (a non-finite logit sets bit 0 of
//   state[STATE_FLAGS]) and mass[t] = sum over layers and heads of the probability of key
//   t (< start + 1). Matrix phases: a warp per unit (row pair), units strided over every
//   warp of the grid, the weights of a warp's next batch loaded while it sums the current
//   one, and its first batch loaded while it waits at the phase's barrier (after its
//   arrival: weights depend on nothing).
//   Every output element has one writer and a fixed order of sums: results do not depend
//   on timing. Needs head_dim 32, 64 or 128 and hidden, q_size, inter multiples of 8 (the
//   backend checks; otherwise it runs the per-kernel forward).
//
// grid_sync_probe  grid = any co-resident size, block = any: `rounds` barriers; in each,
//   block b writes round r to slot[b] and after the barrier checks that block
//   (b + 1) % grid wrote r too; a miss adds to errors[0] (tools/probe_grid_sync.py).
// Dtypes: weights wt; activations, cache, scores, partials, logits, mass fp32.
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

// ---- layer_floor: the least a decode phase must do, for tools/probe_layer_floor.py -------
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

// Rows first, first + 1, ... (mod d) of w into ws with cp.async (matmul.cu), 16 bytes a copy;
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

// ---- decode_persistent --------------------------------------------------------------------
#define PD_THREADS 256
#define PD_WARPS (PD_THREADS / WARP)
#if defined(RT_WEIGHT_F32)  // chunks of 8 weights per lane and row in one batch of loads
#define PD_PB 2              // (64 bytes a lane and row either way)
#else
#define PD_PB 4
#endif
#define PD_KEYS 32     // cached keys per attention work item (a lane each)

struct DecodeLayer {   // one layer's pointers; the backend packs these 11 words per layer
  const wt *attn_norm, *wqkv, *bqkv, *wo, *mlp_norm, *wgate_up, *wdown;
  float *k, *v, *scores, *ml;
};

struct DecodeArgs {    // packed by the backend (CudaBackend._choose_persistent)
  const DecodeLayer* layers;
  const wt *embed, *final_norm, *lm_head;
  const float *cos_t, *sin_t;
  float *x, *q, *attn_out, *act, *part_ml, *part_o, *logits, *mass;
  int* counters;
  unsigned* bar;
  int hidden, inter, n_heads, n_kv, head_dim, cap, vocab, n_layers, n_splits;
  float eps, scale;
};

struct PdBatch { w8raw a[PD_PB], b[PD_PB]; };

__device__ __forceinline__ void pd_load(PdBatch& w, const wt* W, int r0, int r1, int K, int batch) {
  const int lane = threadIdx.x % WARP, nc = K >> 3;
#pragma unroll
  for (int i = 0; i < PD_PB; ++i) {
    const int c = (batch * PD_PB + i) * WARP + lane;
    if (c < nc) {
      w.a[i] = load_w8(W + (long long)r0 * K + 8 * c);
      w.b[i] = load_w8(W + (long long)r1 * K + 8 * c);
    }
  }
}

// This warp's first unit of a phase, its rows and its first batch of weights (issued now).
template <int EPI>
__device__ __forceinline__ void pd_prefetch(PdBatch& w, const wt* W, int rows, int K, int units,
                                            const QkvArgs& qa) {
  const int u = blockIdx.x * PD_WARPS + threadIdx.x / WARP;
  if (u >= units) return;
  int r0, r1, kind;
  unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
  pd_load(w, W, r0, r1, K, 0);
}

// The barrier of the NT threads that stage: BAR 0, __syncthreads (the whole block); else
// named barrier BAR, which the block's other warps never join (decode_ring's producer).
template <int NT, int BAR>
__device__ __forceinline__ void stage_sync() {
  if (BAR == 0) __syncthreads();
  else asm volatile("bar.sync %0, %1;" ::"n"(BAR), "n"(NT) : "memory");
}

// xs[k] = x[k] * inv_rms * norm_w[k] (or x[k] without a norm), x read through L2, by the
// block's first NT threads; a thread's float4s (up to S4 of them, K <= 4 * S4 * NT) all in
// flight; the sum of squares reduced as block_sum does (every thread gets the same).
#define PD_STAGE4 8
template <int NT, int S4, int BAR>
__device__ __forceinline__ void pd_stage(float* xs, const float* x, int K, const wt* norm_w,
                                         float eps, float* scratch) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* xs4 = reinterpret_cast<float4*>(xs);
  const int K4 = K / 4;
  float4 v[S4];
#pragma unroll
  for (int i = 0; i < S4; ++i) {
    const int e = threadIdx.x + i * NT;
    if (e < K4) v[i] = __ldcg(x4 + e);
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < S4; ++i) {
    const int e = threadIdx.x + i * NT;
    if (e < K4) {
      ss = fmaf(v[i].x, v[i].x, fmaf(v[i].y, v[i].y, fmaf(v[i].z, v[i].z, fmaf(v[i].w, v[i].w, ss))));
      if (!norm_w) xs4[e] = v[i];
    }
  }
  if (norm_w) {
    const int lane = threadIdx.x % WARP;
    ss = warp_sum(ss);
    stage_sync<NT, BAR>();
    if (lane == 0) scratch[threadIdx.x / WARP] = ss;
    stage_sync<NT, BAR>();
    ss = warp_sum(lane < NT / WARP ? scratch[lane] : 0.f);
    const float inv_rms = 1.f / sqrtf(ss / K + eps);
#pragma unroll
    for (int i = 0; i < S4; ++i) {
      const int e = threadIdx.x + i * NT;
      if (e < K4) {
        float nw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) nw[j] = w2f(norm_w[4 * e + j]);
        xs4[e] = make_float4(v[i].x * inv_rms * nw[0], v[i].y * inv_rms * nw[1],
                             v[i].z * inv_rms * nw[2], v[i].w * inv_rms * nw[3]);
      }
    }
  }
  stage_sync<NT, BAR>();
}

// y = W xs for every unit of this phase (strided over the grid's warps); EPI_RESIDUAL adds
// to out through L2, the others use matmul.cu's epilogue. w: the first batch, loaded.
template <int EPI>
__device__ void pd_matvec(PdBatch& w, const wt* W, int rows, int K, const float* xs, int units,
                          float* out, int* state, int start, const QkvArgs& qa) {
  const int lane = threadIdx.x % WARP, n_warps = gridDim.x * PD_WARPS;
  const int nc = K >> 3, n_batches = (nc + PD_PB * WARP - 1) / (PD_PB * WARP);
  int u = blockIdx.x * PD_WARPS + threadIdx.x / WARP, batch = 0;
  if (u >= units) return;
  int r0, r1, kind;
  unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
  float a0 = 0.f, a1 = 0.f, res0 = 0.f, res1 = 0.f;   // res: residual, or cos and sin
  PdBatch next;
  while (true) {
    if (batch == 0 && lane == 0) {   // the epilogue's loads, in flight while the dot runs
      if (EPI == EPI_RESIDUAL) {
        res0 = __ldcg(out + r0);
        res1 = __ldcg(out + r1);
      } else if (EPI == EPI_QKV_ROPE && kind < 2) {   // the rotation of a q or k pair
        const int half = qa.head_dim / 2, q_size = qa.n_heads * qa.head_dim;
        const int i = (kind == 0 ? r0 : r0 - q_size) % qa.head_dim;
        res0 = __ldg(qa.cos_t + (long long)(qa.cap + start) * half + i);
        res1 = __ldg(qa.sin_t + (long long)(qa.cap + start) * half + i);
      }
    }
    int nu = u, nb = batch + 1, n0 = 0, n1 = 0, nkind = 0;
    if (nb == n_batches) { nu = u + n_warps; nb = 0; }
    const bool more = nu < units;
    if (more) {
      unit_rows<EPI>(nu, rows, qa, &n0, &n1, &nkind);
      pd_load(next, W, n0, n1, K, nb);
    }
#pragma unroll
    for (int i = 0; i < PD_PB; ++i) {
      const int c = (batch * PD_PB + i) * WARP + lane;
      if (c < nc) fma_pair8(w.a[i], w.b[i], xs + 8 * c, a0, a1);
    }
    if (batch == n_batches - 1) {
      a0 = warp_sum(a0);
      a1 = warp_sum(a1);
      if (lane == 0) {
        if (EPI == EPI_RESIDUAL) {
          out[r0] = res0 + a0;
          if (2 * u + 1 < rows) out[r1] = res1 + a1;
        } else {
          epilogue<EPI>(state, 0, u, rows, r0, r1, kind, a0, a1, out, 0, start, qa,
                        EPI == EPI_QKV_ROPE, res0, res1);
        }
      }
      a0 = a1 = 0.f;
    }
    if (!more) break;
    w = next;
    u = nu; batch = nb; r0 = n0; r1 = n1; kind = nkind;
  }
}

// Phase B: a warp per (head, split of PD_KEYS keys), lane j on key k0 + j for the scores
// and on dims lane + 32 t (t < DL = head_dim / 32) for the values; every load of a batch
// issued before its first use. The head's last warp merges its splits in split order.
template <int DL, int NW>   // NW: the warps of a block that take work items
__device__ void pd_attention(const DecodeArgs& a, const DecodeLayer& L, int start, float* qw) {
  constexpr int D = 32 * DL, KB = 32 / DL;   // KB: keys per batch of value loads
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int visible = start + 1, used = (visible + PD_KEYS - 1) / PD_KEYS;
  const int group = a.n_heads / a.n_kv, kv_size = a.n_kv * D;
  float* q_s = qw + warp * D;
  for (int item = blockIdx.x * NW + warp; item < a.n_heads * used; item += gridDim.x * NW) {
    const int h = item / used, s = item % used, hk = h / group;
    const int k0 = s * PD_KEYS, count = min(PD_KEYS, visible - k0);
#pragma unroll
    for (int t = 0; t < DL; ++t) q_s[lane + WARP * t] = __ldcg(a.q + h * D + lane + WARP * t);
    __syncwarp();
    float score = NEG_INF;
    if (lane < count) {
      const float4* kr = reinterpret_cast<const float4*>(L.k + (long long)(k0 + lane) * kv_size + hk * D);
      float acc = 0.f;
#pragma unroll
      for (int e0 = 0; e0 < D / 4; e0 += 16) {
        float4 kv[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) if (e0 + e < D / 4) kv[e] = __ldcg(kr + e0 + e);
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          if (e0 + e < D / 4) {
            const float* qe = q_s + 4 * (e0 + e);
            acc = fmaf(kv[e].x, qe[0], acc);
            acc = fmaf(kv[e].y, qe[1], acc);
            acc = fmaf(kv[e].z, qe[2], acc);
            acc = fmaf(kv[e].w, qe[3], acc);
          }
        }
      }
      score = acc * a.scale;
      L.scores[(long long)h * a.cap + k0 + lane] = score;   // raw: the mass normalizes it
    }
    const float m = warp_max(score);
    const float p = lane < count ? expf(score - m) : 0.f;
    const float l = warp_sum(p);
    float o[DL];
#pragma unroll
    for (int t = 0; t < DL; ++t) o[t] = 0.f;
    const float* vbase = L.v + (long long)k0 * kv_size + hk * D + lane;
#pragma unroll
    for (int j0 = 0; j0 < PD_KEYS; j0 += KB) {
      float vv[KB][DL];
#pragma unroll
      for (int j = 0; j < KB; ++j)
#pragma unroll
        for (int t = 0; t < DL; ++t)
          if (j0 + j < count) vv[j][t] = __ldcg(vbase + (long long)(j0 + j) * kv_size + WARP * t);
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const float pj = __shfl_sync(FULL_MASK, p, j0 + j);   // 0 past count
        if (j0 + j < count)
#pragma unroll
          for (int t = 0; t < DL; ++t) o[t] = fmaf(pj, vv[j][t], o[t]);
      }
    }
    const long long slot = (long long)h * a.n_splits + s;
#pragma unroll
    for (int t = 0; t < DL; ++t) a.part_o[slot * D + lane + WARP * t] = o[t];
    if (lane == 0) { a.part_ml[2 * slot] = m; a.part_ml[2 * slot + 1] = l; }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(a.counters + h, 1) == used - 1;
    last = __shfl_sync(FULL_MASK, last, 0);
    if (last) {   // merge the head's splits in split order
      __threadfence();
      if (lane == 0) a.counters[h] = 0;
      const float* ml = a.part_ml + 2LL * h * a.n_splits;
      float M = NEG_INF, Lsum = 0.f;
      for (int t = lane; t < used; t += WARP) M = fmaxf(M, __ldcg(ml + 2 * t));
      M = warp_max(M);
#pragma unroll
      for (int t = 0; t < DL; ++t) o[t] = 0.f;
      for (int t0 = 0; t0 < used; t0 += WARP) {   // lane t0 + i holds split t0 + i's weight
        float wm = 0.f, wl = 0.f;
        if (t0 + lane < used) {
          wm = __ldcg(ml + 2 * (t0 + lane));
          wl = __ldcg(ml + 2 * (t0 + lane) + 1);
        }
        const float e = t0 + lane < used ? expf(wm - M) : 0.f;
        Lsum += warp_sum(wl * e);
        const int n = min(WARP, used - t0);
        const float* po = a.part_o + ((long long)h * a.n_splits + t0) * D + lane;
#pragma unroll 8
        for (int i = 0; i < n; ++i) {
          const float ei = __shfl_sync(FULL_MASK, e, i);
#pragma unroll
          for (int t = 0; t < DL; ++t) o[t] = fmaf(__ldcg(po + (long long)i * D + WARP * t), ei, o[t]);
        }
      }
#pragma unroll
      for (int t = 0; t < DL; ++t) a.attn_out[h * D + lane + WARP * t] = o[t] / Lsum;
      if (lane == 0) { L.ml[2 * h] = M; L.ml[2 * h + 1] = Lsum; }
    }
    __syncwarp();
  }
}

template <int NW>
__device__ __forceinline__ void pd_attention_any(const DecodeArgs& a, const DecodeLayer& L,
                                                 int start, float* qw) {
  switch (a.head_dim / WARP) {
    case 1: pd_attention<1, NW>(a, L, start, qw); break;
    case 2: pd_attention<2, NW>(a, L, start, qw); break;
    default: pd_attention<4, NW>(a, L, start, qw); break;   // head_dim 128 (the backend checks)
  }
}

// mass[t] = sum over layers and heads of the probability of key t (< start + 1): a warp per
// key (NW warps a block take keys), its lanes over the (layer, head) rows, in a fixed order.
template <int NW>
__device__ __forceinline__ void pd_mass(const DecodeArgs& a, int start) {
  const int visible = start + 1, n_rows = a.n_layers * a.n_heads;
  const int lane = threadIdx.x % WARP;
  for (int t = blockIdx.x * NW + threadIdx.x / WARP; t < visible; t += gridDim.x * NW) {
    float sum = 0.f;
#pragma unroll 4
    for (int r = lane; r < n_rows; r += WARP) {
      const DecodeLayer& L = a.layers[r / a.n_heads];
      const int h = r % a.n_heads;
      sum += expf(__ldcg(L.scores + (long long)h * a.cap + t) - __ldcg(L.ml + 2 * h)) /
             __ldcg(L.ml + 2 * h + 1);
    }
    sum = warp_sum(sum);
    if (lane == 0) a.mass[t] = sum;
  }
}

extern "C" __global__ void __launch_bounds__(PD_THREADS, 1)
decode_persistent(int* state, const DecodeArgs* args) {
  extern __shared__ float4 pd_smem4[];
  float* xs = reinterpret_cast<float*>(pd_smem4);     // the phase's input vector
  __shared__ float scratch[WARP];
  __shared__ float qw[PD_WARPS * 128];                 // attention: a warp's query
  const DecodeArgs a = *args;
  const int start = state[STATE_START], token = state[STATE_TOKEN];
  const int hid = a.hidden, d = a.head_dim, q_size = a.n_heads * d, kv_size = a.n_kv * d;
  const int qkv_rows = q_size + 2 * kv_size, hid_units = (hid + 1) / 2;
  unsigned target = 0;
  // the embedding row into x
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < hid; k += gridDim.x * blockDim.x)
    a.x[k] = w2f(a.embed[(long long)token * hid + k]);
  const QkvArgs none = {};
  PdBatch w;
  for (int l = 0; l < a.n_layers; ++l) {
    const DecodeLayer L = a.layers[l];
    const QkvArgs qa = {L.bqkv, a.q, L.k, L.v, a.cos_t, a.sin_t, a.n_heads, a.n_kv, d, a.cap};
    // A: q, k, v (each phase: arrive, load the next weights, wait for every block)
    grid_arrive(a.bar);
    pd_prefetch<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, qkv_rows / 2, qa);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.attn_norm, a.eps, scratch);
    pd_matvec<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, xs, qkv_rows / 2, nullptr, state, start, qa);
    // B: attention
    grid_sync(a.bar, &target);
    pd_attention_any<PD_WARPS>(a, L, start, qw);
    // C: o projection into the residual
    grid_arrive(a.bar);
    pd_prefetch<EPI_RESIDUAL>(w, L.wo, hid, q_size, hid_units, none);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.attn_out, q_size, nullptr, a.eps, scratch);
    pd_matvec<EPI_RESIDUAL>(w, L.wo, hid, q_size, xs, hid_units, a.x, state, start, none);
    // D: gate, up
    grid_arrive(a.bar);
    pd_prefetch<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, a.inter, none);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.mlp_norm, a.eps, scratch);
    pd_matvec<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, xs, a.inter, a.act, state, start, none);
    // E: down into the residual
    grid_arrive(a.bar);
    pd_prefetch<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, hid_units, none);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.act, a.inter, nullptr, a.eps, scratch);
    pd_matvec<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, xs, hid_units, a.x, state, start, none);
  }
  // LM head and the attention mass
  const int vocab_units = (a.vocab + 1) / 2;
  grid_arrive(a.bar);
  pd_prefetch<EPI_STORE>(w, a.lm_head, a.vocab, hid, vocab_units, none);
  grid_wait(a.bar, &target);
  pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, a.final_norm, a.eps, scratch);
  pd_matvec<EPI_STORE>(w, a.lm_head, a.vocab, hid, xs, vocab_units, a.logits, state, start, none);
  pd_mass<PD_WARPS>(a, start);
  grid_sync_reset(a.bar, &target);
}

// ---- decode_ring --------------------------------------------------------------------------
// decode_ring  grid = SMs (one block of RG_THREADS each, all resident: cooperative launch),
//   dynamic shared memory = the input vector (4 * max(hidden, q_size, inter) bytes, in
//   16-byte lines) + a ring of `ring_bytes` (sm_90: bulk copies and mbarriers; a stub that
//   traps elsewhere). The same step as decode_persistent, phase for phase, but a block owns
//   a fixed contiguous share of every matrix's units (units * b / grid ..) and does not
//   wait for its weights: a producer warp (the block's last) streams the block's shares of
//   every matrix of the step, in the order the phases use them, into the ring as chunks
//   (up to RG_CHUNK bytes of whole units, one bulk copy per run of rows contiguous in
//   memory, completing on the chunk's `full` mbarrier), running ahead of the phases across
//   grid barriers and layers as far as the ring allows; the RG_WARPS compute warps take a
//   chunk from shared memory once it has landed (a unit per warp, or per RG_WARPS / n
//   warps that split its K when the chunk has n < RG_WARPS units, their sums added in warp
//   order) and release its space (`empty` mbarrier, one arrival a warp). A chunk holds its
//   units' rows as [2][n][K] ([n][2][K] for row-pair units, whose rows 2u, 2u + 1 are then
//   one copy). Every output has one writer and a fixed order of sums: repeatable bit for
//   bit. Grid barriers, `flag_barrier` 1: block b stores its count of barriers passed in
//   flags[b] (release) and its threads poll one flag each (acquire): no two blocks write one
//   word and no reset is needed (every flag holds the same count after a launch); 0:
//   grid_sync's counter. `prof` (null: off): clock64 accounting of compute thread 0's time.
#define RG_WARPS 7                       // compute warps (8 warps in all keep 255 registers)
#define RG_THREADS (32 * (RG_WARPS + 1))  // and the producer warp
#define RG_NB 32        // chunks in flight at most (an mbarrier pair each)
#define RG_CHUNK 57344  // a chunk's size in bytes at most, unless one unit is larger
#define RG_STAGE4 12    // float4s a compute thread stages: inputs up to 4 * 12 * 224 = 10752 wide

struct RgPhase {
  const wt* W;
  int rows, K, units, epi, u0, u1, per_chunk;
  QkvArgs qa;
};

// Phase p of the step's weight sequence: 4 per layer (q/k/v, o, gate/up, down), then the
// LM head (p == 4 * n_layers); this block's units [u0, u1), whole units per chunk.
__device__ __forceinline__ RgPhase rg_phase(const DecodeArgs& a, int p, int ring_bytes) {
  RgPhase ph;
  const int l = p >> 2, d = a.head_dim, q_size = a.n_heads * d, kv_size = a.n_kv * d;
  ph.qa = QkvArgs{};
  if (l >= a.n_layers) {
    ph.W = a.lm_head; ph.rows = a.vocab; ph.K = a.hidden; ph.units = (a.vocab + 1) / 2;
    ph.epi = EPI_STORE;
  } else {
    const DecodeLayer& L = a.layers[l];
    switch (p & 3) {
      case 0:
        ph.W = L.wqkv; ph.rows = q_size + 2 * kv_size; ph.K = a.hidden; ph.units = ph.rows / 2;
        ph.epi = EPI_QKV_ROPE;
        ph.qa = QkvArgs{L.bqkv, a.q, L.k, L.v, a.cos_t, a.sin_t, a.n_heads, a.n_kv, d, a.cap};
        break;
      case 1:
        ph.W = L.wo; ph.rows = a.hidden; ph.K = q_size; ph.units = (a.hidden + 1) / 2;
        ph.epi = EPI_RESIDUAL;
        break;
      case 2:
        ph.W = L.wgate_up; ph.rows = 2 * a.inter; ph.K = a.hidden; ph.units = a.inter;
        ph.epi = EPI_SWIGLU;
        break;
      default:
        ph.W = L.wdown; ph.rows = a.hidden; ph.K = a.inter; ph.units = (a.hidden + 1) / 2;
        ph.epi = EPI_RESIDUAL;
        break;
    }
  }
  ph.u0 = ph.units * (int)blockIdx.x / (int)gridDim.x;   // units * grid < 2^31 (backend)
  ph.u1 = ph.units * ((int)blockIdx.x + 1) / (int)gridDim.x;
  const int unit_bytes = 2 * ph.K * (int)sizeof(wt);
  ph.per_chunk = max(1, min(RG_CHUNK, ring_bytes / 3) / unit_bytes);
  if (ph.per_chunk > RG_WARPS) ph.per_chunk -= ph.per_chunk % RG_WARPS;   // every warp busy
  return ph;
}

__device__ __forceinline__ void rg_rows(const RgPhase& ph, int u, int* r0, int* r1, int* kind) {
  switch (ph.epi) {
    case EPI_QKV_ROPE: unit_rows<EPI_QKV_ROPE>(u, ph.rows, ph.qa, r0, r1, kind); break;
    case EPI_SWIGLU: unit_rows<EPI_SWIGLU>(u, ph.rows, ph.qa, r0, r1, kind); break;
    default: unit_rows<EPI_RESIDUAL>(u, ph.rows, ph.qa, r0, r1, kind); break;
  }
}

// Shared-memory row of unit j's row `which` (0: r0, 1: r1) in a chunk of n units.
__device__ __forceinline__ int rg_slot(const RgPhase& ph, int j, int which, int n) {
  return (ph.epi == EPI_RESIDUAL || ph.epi == EPI_STORE) ? 2 * j + which : which * n + j;
}

// A cursor over this block's chunks of the step, in order: phase, first unit, units.
struct RgCursor { int p, u, n; };

__device__ __forceinline__ void rg_settle(const DecodeArgs& a, RgCursor& c, RgPhase& ph,
                                          int ring_bytes) {
  const int last = 4 * a.n_layers;   // the LM head
  while (c.p <= last) {
    ph = rg_phase(a, c.p, ring_bytes);
    if (c.u < 0) c.u = ph.u0;
    if (c.u < ph.u1) { c.n = min(ph.per_chunk, ph.u1 - c.u); return; }
    ++c.p;
    c.u = -1;
  }
  c.n = 0;   // past the end
}

__device__ __forceinline__ void rg_next(const DecodeArgs& a, RgCursor& c, RgPhase& ph,
                                        int ring_bytes) {
  c.u += c.n;
  if (c.u < ph.u1) {   // the same phase: no need to look its matrix up again
    c.n = min(ph.per_chunk, ph.u1 - c.u);
    return;
  }
  rg_settle(a, c, ph, ring_bytes);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Block until the phase of parity `parity` of the mbarrier has completed (a wait that
// never ends traps: a launch that could not complete fails instead of hanging).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned ok, polls = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    if (++polls > (1u << 22)) asm volatile("trap;");   // try_wait may sleep a while a poll
  } while (!ok);
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// The compute warps' own barrier (named barrier 1; the producer warp never joins it).
__device__ __forceinline__ void rg_sync() { stage_sync<RG_WARPS * WARP, 1>(); }

// The producer (one thread): every chunk of the step in order, each where the ring has
// room once the compute warps have released the chunks before it.
__device__ void rg_produce_all(const DecodeArgs& a, unsigned char* ring, int ring_bytes,
                               int* offs, unsigned long long* full, unsigned long long* empty) {
  RgCursor cur = {0, -1, 0};
  RgPhase ph;
  rg_settle(a, cur, ph, ring_bytes);
  int issued = 0, freed = 0, head = 0;
  while (cur.n > 0) {
    const int row_bytes = ph.K * (int)sizeof(wt), n = cur.n, bytes = 2 * n * row_bytes;
    int off;
    while (true) {
      off = -1;
      if (issued - freed < RG_NB) {
        if (freed == issued) {
          off = 0;
        } else {
          const int tail = offs[freed % RG_NB];
          if (head > tail) {   // in flight: [tail, head)
            if (head + bytes <= ring_bytes) off = head;
            else if (bytes <= tail) off = 0;
          } else if (head + bytes <= tail) {   // in flight: [tail, end) and [0, head)
            off = head;
          }
        }
      }
      if (off >= 0) break;
      mbar_wait(empty + freed % RG_NB, (freed / RG_NB) & 1);   // the oldest's release
      ++freed;
    }
    const int slot = issued % RG_NB;
    offs[slot] = off;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    mbar_expect_tx(full + slot, (unsigned)bytes);
    // runs of rows contiguous both in memory and in the chunk: one bulk copy each
    const bool pairs = ph.epi == EPI_RESIDUAL || ph.epi == EPI_STORE;
    int run_row = -1, run_slot = 0, run_len = 0;
    for (int s = 0; s < 2 * n; ++s) {
      const int j = pairs ? s / 2 : s % n, which = pairs ? s % 2 : s / n;
      int r0, r1, kind;
      rg_rows(ph, cur.u + j, &r0, &r1, &kind);
      const int r = which ? r1 : r0;
      if (run_len > 0 && r == run_row + run_len) {
        ++run_len;
        continue;
      }
      if (run_len > 0)
        bulk_copy(ring + off + (long long)run_slot * row_bytes,
                  ph.W + (long long)run_row * ph.K, (unsigned)(run_len * row_bytes),
                  full + slot);
      run_row = r; run_slot = s; run_len = 1;
    }
    bulk_copy(ring + off + (long long)run_slot * row_bytes, ph.W + (long long)run_row * ph.K,
              (unsigned)(run_len * row_bytes), full + slot);
    head = off + bytes;
    ++issued;
    rg_next(a, cur, ph, ring_bytes);
  }
}

__device__ __forceinline__ void st_release_u32(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The grid barrier of the compute warps: arrive (after every compute thread's writes),
// then wait for every block's arrival.
__device__ __forceinline__ void rg_grid_sync(unsigned* bar, unsigned* flags, int flag_barrier,
                                             unsigned* count, unsigned* target) {
  rg_sync();
  ++*count;
  if (flag_barrier) {
    if (threadIdx.x == 0) st_release_u32(flags + blockIdx.x, *count);
    for (int b = threadIdx.x; b < gridDim.x; b += RG_WARPS * WARP) {
      unsigned polls = 0;
      while ((int)(ld_acquire_u32(flags + b) - *count) < 0)
        if (++polls > (1u << 25)) asm volatile("trap;");
    }
  } else {
    *target += gridDim.x;
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
      unsigned polls = 0;
      while ((int)(ld_acquire_u32(bar) - *target) < 0)
        if (++polls > (1u << 25)) asm volatile("trap;");
    }
  }
  rg_sync();
}

// Optional clock64 accounting of compute thread 0's time (`prof`, null: off): [0] grid
// barriers, [1] staging inputs, [2] waiting for a chunk to land, [3] computing chunks,
// [4] attention, [5] the rest.
struct RgProf {
  long long* out;   // [grid, 8]
  long long mark;
  __device__ __forceinline__ void lap(int i) {
    if (out && threadIdx.x == 0) {
      const long long now = clock64();
      out[blockIdx.x * 8 + i] += now - mark;
      mark = now;
    }
  }
};

// The epilogue's inputs of unit u, loaded before its dot product so that their latency
// hides behind it: the residual pair (EPI_RESIDUAL) or the rotation's cos and sin.
template <int EPI>
__device__ __forceinline__ void rg_epilogue_inputs(const RgPhase& ph, int u, const float* out,
                                                   int start, float* e0, float* e1) {
  int r0, r1, kind;
  unit_rows<EPI>(u, ph.rows, ph.qa, &r0, &r1, &kind);
  if (EPI == EPI_RESIDUAL) {
    *e0 = ld_cg(out + r0);
    *e1 = ld_cg(out + r1);
  } else if (EPI == EPI_QKV_ROPE && kind < 2) {
    const int half = ph.qa.head_dim / 2, q_size = ph.qa.n_heads * ph.qa.head_dim;
    const int i = (kind == 0 ? r0 : r0 - q_size) % ph.qa.head_dim;
    *e0 = __ldg(ph.qa.cos_t + (long long)(ph.qa.cap + start) * half + i);
    *e1 = __ldg(ph.qa.sin_t + (long long)(ph.qa.cap + start) * half + i);
  }
}

template <int EPI>
__device__ __forceinline__ void rg_epilogue(int* state, const RgPhase& ph, int u, float a0,
                                            float a1, float* out, int start, float e0,
                                            float e1) {
  int r0, r1, kind;
  unit_rows<EPI>(u, ph.rows, ph.qa, &r0, &r1, &kind);
  if (EPI == EPI_RESIDUAL) {   // one writer an element: x += W y with the residual read early
    out[r0] = e0 + a0;
    if (2 * u + 1 < ph.rows) out[r1] = e1 + a1;
  } else {
    epilogue<EPI>(state, 0, u, ph.rows, r0, r1, kind, a0, a1, out, 0, start, ph.qa,
                  EPI == EPI_QKV_ROPE, e0, e1);
  }
}

// One phase's matrix: every chunk of this block's units, each computed from the ring once
// landed, through the phase's epilogue.
template <int EPI>
__device__ __forceinline__ void rg_matrix(const DecodeArgs& a, int p, RgCursor& cc,
                                          RgPhase& ph, const float* xs, float* out,
                                          int* state, int start, unsigned char* ring,
                                          int ring_bytes, const int* offs,
                                          unsigned long long* full,
                                          unsigned long long* empty, int* consumed,
                                          float2* part, RgProf& prof) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  while (cc.n > 0 && cc.p == p) {   // none when this block has no units in phase p
    const int c = *consumed, slot = c % RG_NB, n = cc.n, K = ph.K, nc = K >> 3;
    // warps a unit: 1 with at least RG_WARPS units, else RG_WARPS / n splitting K
    const int split = max(1, RG_WARPS / n);
    const int at_once = RG_WARPS / split, per_part = (nc + split - 1) / split;
    const int q = warp % split, g0 = q * per_part, g1 = min(nc, g0 + per_part);
    const bool active = warp < at_once * split;   // all of them unless RG_WARPS is odd
    mbar_wait(full + slot, (c / RG_NB) & 1);
    prof.lap(2);
    const wt* chunk = reinterpret_cast<const wt*>(ring + offs[slot]);
    for (int j0 = 0; j0 < n; j0 += at_once) {   // the same count for every warp
      const int j = active ? j0 + warp / split : n;
      float a0 = 0.f, a1 = 0.f, e0 = 0.f, e1 = 0.f;
      if (j < n && lane == 0 && q == 0)   // the epilogue's loads, in flight during the dot
        rg_epilogue_inputs<EPI>(ph, cc.u + j, out, start, &e0, &e1);
      if (j < n) {
        const wt* w0 = chunk + (long long)rg_slot(ph, j, 0, n) * K;
        const wt* w1 = chunk + (long long)rg_slot(ph, j, 1, n) * K;
#pragma unroll 2
        for (int g = g0 + lane; g < g1; g += WARP)
          fma_pair8(*reinterpret_cast<const w8raw*>(w0 + 8 * g),
                    *reinterpret_cast<const w8raw*>(w1 + 8 * g), xs + 8 * g, a0, a1);
      }
      a0 = warp_sum(a0);
      a1 = warp_sum(a1);
      if (split == 1) {
        if (lane == 0 && j < n) rg_epilogue<EPI>(state, ph, cc.u + j, a0, a1, out, start, e0, e1);
      } else {
        if (lane == 0) part[warp] = make_float2(a0, a1);
        rg_sync();
        if (lane == 0 && q == 0 && j < n) {
          float s0 = 0.f, s1 = 0.f;
          for (int i = 0; i < split; ++i) { s0 += part[warp + i].x; s1 += part[warp + i].y; }
          rg_epilogue<EPI>(state, ph, cc.u + j, s0, s1, out, start, e0, e1);
        }
        rg_sync();
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + slot);
    ++*consumed;
    rg_next(a, cc, ph, ring_bytes);
    prof.lap(3);
  }
}
#endif  // sm_90

extern "C" __global__ void __launch_bounds__(RG_THREADS, 1)
decode_ring(int* state, const DecodeArgs* args, unsigned* flags, int ring_bytes,
            int flag_barrier, long long* prof_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 rg_smem4[];
  __shared__ unsigned long long full[RG_NB], empty[RG_NB];
  __shared__ int offs[RG_NB];
  __shared__ float scratch[WARP];
  __shared__ float2 part[RG_WARPS];
  __shared__ float qw[RG_WARPS * 128];   // attention: a warp's query
  const DecodeArgs& a = *args;   // read as needed (L1), not held in registers
  float* xs = reinterpret_cast<float*>(rg_smem4);
  const int xs_bytes = 16 * ((4 * max(max(a.hidden, a.n_heads * a.head_dim), a.inter) + 15) / 16);
  unsigned char* ring = reinterpret_cast<unsigned char*>(rg_smem4) + xs_bytes;
  if (threadIdx.x == 0) {
    for (int i = 0; i < RG_NB; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, RG_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();   // the last barrier of the whole block: the producer leaves below
  if (threadIdx.x / WARP == RG_WARPS) {
    if (threadIdx.x % WARP == 0) rg_produce_all(a, ring, ring_bytes, offs, full, empty);
    return;
  }
  const int start = state[STATE_START], token = state[STATE_TOKEN];
  const int hid = a.hidden, q_size = a.n_heads * a.head_dim;
  unsigned* bar = a.bar;
  unsigned count = 0, target = 0;
  if (flag_barrier) count = __ldcg(flags + blockIdx.x);   // this block's own, from the last launch
  RgCursor cc = {0, -1, 0};
  RgPhase ph;
  rg_settle(a, cc, ph, ring_bytes);
  int consumed = 0;
  RgProf prof;
  prof.out = prof_out;
  prof.mark = clock64();
  const int nt = RG_WARPS * WARP;
  for (int k = blockIdx.x * nt + threadIdx.x; k < hid; k += gridDim.x * nt)
    a.x[k] = w2f(a.embed[(long long)token * hid + k]);
  prof.lap(5);
#define RG_SYNC()                                                    \
  do {                                                               \
    rg_grid_sync(bar, flags, flag_barrier, &count, &target);         \
    prof.lap(0);                                                     \
  } while (0)
#define RG_MATRIX(EPI, P, OUT)                                                             \
  rg_matrix<EPI>(a, P, cc, ph, xs, OUT, state, start, ring, ring_bytes, offs, full, empty, \
                 &consumed, part, prof)
  for (int l = 0; l < a.n_layers; ++l) {
    const DecodeLayer L = a.layers[l];
    RG_SYNC();   // x complete
    pd_stage<RG_WARPS * WARP, RG_STAGE4, 1>(xs, a.x, hid, L.attn_norm, a.eps, scratch);
    prof.lap(1);
    RG_MATRIX(EPI_QKV_ROPE, 4 * l, nullptr);
    RG_SYNC();   // q, k, v complete
    pd_attention_any<RG_WARPS>(a, L, start, qw);
    prof.lap(4);
    RG_SYNC();   // attention complete
    pd_stage<RG_WARPS * WARP, RG_STAGE4, 1>(xs, a.attn_out, q_size, nullptr, a.eps, scratch);
    prof.lap(1);
    RG_MATRIX(EPI_RESIDUAL, 4 * l + 1, a.x);
    RG_SYNC();
    pd_stage<RG_WARPS * WARP, RG_STAGE4, 1>(xs, a.x, hid, L.mlp_norm, a.eps, scratch);
    prof.lap(1);
    RG_MATRIX(EPI_SWIGLU, 4 * l + 2, a.act);
    RG_SYNC();
    pd_stage<RG_WARPS * WARP, RG_STAGE4, 1>(xs, a.act, a.inter, nullptr, a.eps, scratch);
    prof.lap(1);
    RG_MATRIX(EPI_RESIDUAL, 4 * l + 3, a.x);
  }
  RG_SYNC();
  pd_stage<RG_WARPS * WARP, RG_STAGE4, 1>(xs, a.x, hid, a.final_norm, a.eps, scratch);
  prof.lap(1);
  RG_MATRIX(EPI_STORE, 4 * a.n_layers, a.logits);
  pd_mass<RG_WARPS>(a, start);   // after every attention phase: the barrier above suffices
  if (!flag_barrier) {   // the counter's reset, as grid_sync_reset
    rg_grid_sync(bar, flags, 0, &count, &target);
    if (threadIdx.x == 0) {
      unsigned out;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(out) : "l"(bar + 1) : "memory");
      if (out == gridDim.x - 1) { bar[0] = 0; bar[1] = 0; }
    }
  }
  prof.lap(5);
#undef RG_SYNC
#undef RG_MATRIX
#else
  asm volatile("trap;");   // needs sm_90 (bulk copies); the backend never launches it below
#endif
}
