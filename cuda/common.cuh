// common.cuh: types and helpers shared by every kernel file.
//
// The loader (rt_llm_node/backends/cuda_kernels.py) compiles the .cu files as one NVRTC
// program per weight dtype (each file also compiles alone), with exactly one of RT_WEIGHT_BF16, RT_WEIGHT_F16 or
// RT_WEIGHT_F32 defined. Weights ("wt") stay in their stored dtype; every sum is fp32.
// No CUDA header is included: 16-bit conversions are bit operations or one PTX cvt, so
// NVRTC compiles these sources on a machine with no CUDA toolkit and no GPU.
#pragma once

#if defined(RT_WEIGHT_BF16) || defined(RT_WEIGHT_F16)
typedef unsigned short wt;           // raw bf16 or fp16 bits
#elif defined(RT_WEIGHT_F32)
typedef float wt;
#else
#error "define RT_WEIGHT_BF16, RT_WEIGHT_F16 or RT_WEIGHT_F32"
#endif

#define WARP 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// fp16 bits as a float (exact), whatever the weight dtype.
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float bits_to_float(unsigned short h) {
#if defined(RT_WEIGHT_BF16)
  return __uint_as_float(((unsigned)h) << 16);
#else
  return half_bits_to_float(h);
#endif
}

__device__ __forceinline__ float w2f(wt w) {
#if defined(RT_WEIGHT_F32)
  return w;
#else
  return bits_to_float(w);
#endif
}

// N (4 or 8) consecutive weights from p, raw: loaded now, converted later, so that a kernel
// can have many loads in flight before it needs the values. One vector load: 16 bytes for 8
// 16-bit weights (p 16-byte aligned) or 8 for 4 of them (8-byte aligned); fp32 weights take
// one float4 per 4 weights (16-byte aligned).
template <int N> struct wraw;
#if defined(RT_WEIGHT_F32)
template <> struct wraw<8> { float4 a, b; };
template <> struct wraw<4> { float4 a; };
#else
template <> struct wraw<8> { uint4 a; };
template <> struct wraw<4> { uint2 a; };
#endif
typedef wraw<8> w8raw;
typedef wraw<4> w4raw;

template <int N>
__device__ __forceinline__ wraw<N> load_w(const wt* p) {
  static_assert(N == 4 || N == 8, "4 or 8 weights");
  wraw<N> r;
#if defined(RT_WEIGHT_F32)
  r.a = __ldg(reinterpret_cast<const float4*>(p));
  if constexpr (N == 8) r.b = __ldg(reinterpret_cast<const float4*>(p) + 1);
#else
  if constexpr (N == 8) {
    r.a = __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    r.a = __ldg(reinterpret_cast<const uint2*>(p));
  }
#endif
  return r;
}

// The N weights of a raw load as fp32, in order.
template <int N>
__device__ __forceinline__ void w_floats(const wraw<N>& r, float* o) {
#if defined(RT_WEIGHT_F32)
  o[0] = r.a.x; o[1] = r.a.y; o[2] = r.a.z; o[3] = r.a.w;
  if constexpr (N == 8) { o[4] = r.b.x; o[5] = r.b.y; o[6] = r.b.z; o[7] = r.b.w; }
#else
  unsigned u[N / 2];
  if constexpr (N == 8) {
    u[0] = r.a.x; u[1] = r.a.y; u[2] = r.a.z; u[3] = r.a.w;
  } else {
    u[0] = r.a.x; u[1] = r.a.y;
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    o[2 * i] = bits_to_float((unsigned short)(u[i] & 0xffffu));
    o[2 * i + 1] = bits_to_float((unsigned short)(u[i] >> 16));
  }
#endif
}

__device__ __forceinline__ w8raw load_w8(const wt* p) { return load_w<8>(p); }
__device__ __forceinline__ void w8_floats(const w8raw& r, float* o) { w_floats<8>(r, o); }

// Eight consecutive weights from p (16-byte aligned) as fp32.
__device__ __forceinline__ void load8(const wt* p, float* o) { w8_floats(load_w8(p), o); }

// Eight RMSNorm weights from norm_w + k, or eight ones when the matmul has no norm.
__device__ __forceinline__ void load_norm8(const wt* norm_w, int k, float* o) {
  if (norm_w) {
    load8(norm_w + k, o);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = 1.f;
  }
}

// Eight consecutive fp32 activations from p (16-byte aligned).
__device__ __forceinline__ void load8f(const float* p, float* o) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *(reinterpret_cast<const float4*>(p) + 1);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

// a0 += wa . x and a1 += wb . x over eight weights of two rows (raw, converted here) and the
// eight fp32 activations at xs (16-byte aligned), multiply-adds in element order.
__device__ __forceinline__ void fma_pair8(const w8raw& wa, const w8raw& wb, const float* xs,
                                          float& a0, float& a1) {
  float fa[8], fb[8], xv[8];
  w8_floats(wa, fa);
  w8_floats(wb, fb);
  load8f(xs, xv);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    a0 = fmaf(fa[j], xv[j], a0);
    a1 = fmaf(fb[j], xv[j], a1);
  }
}

// A load that bypasses L1: for data other blocks of the same launch wrote.
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Four floats through L2 only: data the previous kernel wrote, read after the wait for it
// (a line of it may sit stale in L1 from a load issued before the wait).
__device__ __forceinline__ float4 ld_cg4(const float4* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// The KV cache: fp32, or with RT_KV_INT8 int8 codes with an fp32 scale per (slot, kv head)
// (value = code * scale), written by kv_quantize from the call's fp32 keys and values.
#if defined(RT_KV_INT8)
typedef signed char kvt;
#else
typedef float kvt;
#endif

// Four consecutive cache values (float4 index i4 of a [slots, n_kv, d] cache; d4 = d / 4)
// as fp32. cg: through L2 only, for a slot the previous kernel wrote (see ld_cg4).
__device__ __forceinline__ float4 kv_load4(const kvt* c, const float* scales, long long i4,
                                           int d4, bool cg) {
#if defined(RT_KV_INT8)
  unsigned u;
  float s;
  if (cg) {
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(u) : "l"(c + 4 * i4));
    s = ld_cg(scales + i4 / d4);
  } else {
    u = *reinterpret_cast<const unsigned*>(c + 4 * i4);
    s = scales[i4 / d4];
  }
  return make_float4((float)(signed char)(u & 0xffu) * s,
                     (float)(signed char)((u >> 8) & 0xffu) * s,
                     (float)(signed char)((u >> 16) & 0xffu) * s,
                     (float)(signed char)(u >> 24) * s);
#else
  (void)scales;
  (void)d4;
  const float4* p = reinterpret_cast<const float4*>(c) + i4;
  return cg ? ld_cg4(p) : *p;
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// Reduce over the block with a warp reduction (warp_sum or warp_max) and its identity;
// every thread gets the result. scratch: >= 32 floats of shared memory.
template <float (*WarpReduce)(float)>
__device__ __forceinline__ float block_reduce(float v, float identity, float* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int n_warps = (blockDim.x + WARP - 1) / WARP;
  v = WarpReduce(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : identity;
  return WarpReduce(v);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce<warp_sum>(v, 0.f, scratch);
}

// block_sum of N values at once (each thread's v[0 .. N-1]), one pair of barriers for all:
// each value's sum is block_sum's, term for term. scratch: >= 32 * N floats.
template <int N>
__device__ __forceinline__ void block_sums(float* v, float* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int n_warps = (blockDim.x + WARP - 1) / WARP;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[i * WARP + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(lane < n_warps ? scratch[i * WARP + lane] : 0.f);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<warp_max>(v, NEG_INF, scratch);
}

// Programmatic dependent launch (sm_90 and later; a no-op elsewhere and for a kernel
// launched without it): wait until the previous kernel of the stream has finished and its
// writes are visible, then let the next kernel's blocks start. Every block of every kernel
// calls it before it reads another kernel's output or returns, so a kernel's completion
// implies its predecessors'; only weights, the host-written run state and other
// inputs no kernel of the forward writes may be read before it.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The run state lives in device memory so that captured graphs replay unchanged:
// state[STATE_TOKEN] token of a decode step, state[STATE_START] cache length before the
// call (position of its first token), state[STATE_N] tokens in the call,
// state[STATE_MASS_ACC] 1 when the call continues an earlier chunk (attention mass adds up),
// state[STATE_FLAGS] bit 0 set when a logit was not finite, state[STATE_RESULT] arg-max,
// state[STATE_COUNTER] blocks done in argmax_masked. The host writes the first five.
// The slot numbers come from the loader's geometry table (cuda_kernels.GEOMETRY), as -D
// options, so that the backend and the kernels cannot disagree.
#if !defined(STATE_TOKEN) || !defined(STATE_COUNTER) || !defined(PD_THREADS)
#error "build through rt_llm_node/backends/cuda_kernels.py: the geometry comes from its table"
#endif
