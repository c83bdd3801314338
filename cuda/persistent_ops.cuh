// persistent_ops.cuh: the bodies of a whole decode step's phases, for launches that run
// every phase in one kernel: decode_persistent.cu (phases separated by grid barriers) and
// decode_dataflow.cu (tasks that wait on the counters of what they read).
//
// DecodeArgs / DecodeLayer: the step's pointers and sizes (the backend packs them,
// CudaBackend._prepare_persistent). pd_stage: a block stages its input vector in shared
// memory (RMSNorm or a copy); pd_matvec: a warp per unit (row pair) in a fixed order of
// sums over a sequence of units (GridUnits: strided over the grid), the next batch of weights
// loaded while it sums the current one; pd_attend: one (head, PD_KEYS keys) item, and
// pd_merge_head a head's splits in order (pd_attention: both over the grid); pd_mass: the
// attention mass of each key. Every output element has one writer and a fixed order of sums.
// Dtypes: weights wt; activations, cache, scores, partials, logits, mass fp32.
#pragma once
#include "common.cuh"
#include "matvec.cuh"

// ---- shared by the one-launch decode steps --------------------------------------------
#define PD_WARPS (PD_THREADS / WARP)
#if defined(RT_WEIGHT_F32)  // chunks of 8 weights per lane and row in one batch of loads
#define PD_PB 2              // (64 bytes a lane and row either way)
#else
#define PD_PB 4
#endif

struct DecodeLayer {   // one layer's pointers (launch_args.DECODE_LAYER, the same order)
  const wt *attn_norm, *wqkv, *bqkv, *wo, *mlp_norm, *wgate_up, *wdown;
  float *k, *v, *scores, *ml;
};

struct DecodeArgs {    // packed by the backend (launch_args.DECODE_ARGS, the same order)
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

// The units a warp sums, in order: j = first(), first() + step(), ... < count, each mapped to
// matvec.cuh's unit numbering by unit(j). A phase of decode_persistent strides its units over
// every warp of the grid; a task of decode_dataflow has its own sequence (TaskUnits).
struct GridUnits {
  int count;
  __device__ __forceinline__ int first() const { return blockIdx.x * PD_WARPS + threadIdx.x / WARP; }
  __device__ __forceinline__ int step() const { return gridDim.x * PD_WARPS; }
  __device__ __forceinline__ int unit(int j) const { return j; }
};

// This warp's first unit, its rows and its first batch of weights (issued now).
template <int EPI, class Units>
__device__ __forceinline__ void pd_prefetch(PdBatch& w, const wt* W, int rows, int K,
                                            const Units& us, const QkvArgs& qa) {
  const int j = us.first();
  if (j >= us.count) return;
  int r0, r1, kind;
  unit_rows<EPI>(us.unit(j), rows, qa, &r0, &r1, &kind);
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

// y = W xs for this warp's units (``us``); EPI_RESIDUAL adds to out through L2, the others
// use matmul.cu's epilogue. w: the first batch, loaded.
template <int EPI, class Units>
__device__ void pd_matvec(PdBatch& w, const wt* W, int rows, int K, const float* xs,
                          const Units& us, float* out, int* state, int start, const QkvArgs& qa) {
  const int lane = threadIdx.x % WARP;
  const int nc = K >> 3, n_batches = (nc + PD_PB * WARP - 1) / (PD_PB * WARP);
  int j = us.first(), batch = 0;
  if (j >= us.count) return;
  int u = us.unit(j), r0, r1, kind;
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
    int nj = j, nu = u, nb = batch + 1, n0 = 0, n1 = 0, nkind = 0;
    if (nb == n_batches) { nj = j + us.step(); nb = 0; }
    const bool more = nj < us.count;
    if (more) {
      nu = us.unit(nj);
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
    j = nj; u = nu; batch = nb; r0 = n0; r1 = n1; kind = nkind;
  }
}

// One attention item, by one warp: head h over split s of PD_KEYS keys (< visible), lane j
// on key k0 + j for the scores and on dims lane + 32 t (t < DL = head_dim / 32) for the
// values; every load of a batch issued before its first use. Writes the raw scores (the mass
// normalizes them) and the split's partial softmax (max, sum) and weighted values.
template <int DL>
__device__ __forceinline__ void pd_attend(const DecodeArgs& a, const DecodeLayer& L, int visible,
                                          int h, int s, float* q_s) {
  constexpr int D = 32 * DL, KB = 32 / DL;   // KB: keys per batch of value loads
  const int lane = threadIdx.x % WARP;
  const int kv_size = a.n_kv * D, hk = h / (a.n_heads / a.n_kv);
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
    L.scores[(long long)h * a.cap + k0 + lane] = score;
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
}

// Head h's ``used`` splits merged in split order, by one warp: out[h * D + d] = the head's
// attention output; with ml, its softmax max and sum (for the mass) into ml[2h], ml[2h + 1].
template <int DL>
__device__ __forceinline__ void pd_merge_head(const DecodeArgs& a, int h, int used, float* out,
                                              float* ml_out) {
  constexpr int D = 32 * DL;
  const int lane = threadIdx.x % WARP;
  const float* ml = a.part_ml + 2LL * h * a.n_splits;
  float M = NEG_INF, Lsum = 0.f, o[DL];
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
  for (int t = 0; t < DL; ++t) out[h * D + lane + WARP * t] = o[t] / Lsum;
  if (ml_out && lane == 0) { ml_out[2 * h] = M; ml_out[2 * h + 1] = Lsum; }
}

// Phase B: a warp per (head, split) item over the grid; the head's last warp to finish
// (counter per head, reset by it) merges its splits into attn_out (as attn_decode).
template <int DL, int NW>   // NW: the warps of a block that take work items
__device__ void pd_attention(const DecodeArgs& a, const DecodeLayer& L, int start, float* qw) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int visible = start + 1, used = (visible + PD_KEYS - 1) / PD_KEYS;
  for (int item = blockIdx.x * NW + warp; item < a.n_heads * used; item += gridDim.x * NW) {
    const int h = item / used;
    pd_attend<DL>(a, L, visible, h, item % used, qw + warp * 32 * DL);
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(a.counters + h, 1) == used - 1;
    last = __shfl_sync(FULL_MASK, last, 0);
    if (last) {
      __threadfence();
      if (lane == 0) a.counters[h] = 0;
      pd_merge_head<DL>(a, h, used, a.attn_out, L.ml);
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
// key (this warp's keys: first, first + step, ...), its lanes over the (layer, head) rows, in
// a fixed order.
__device__ __forceinline__ void pd_mass(const DecodeArgs& a, int start, int first, int step) {
  const int visible = start + 1, n_rows = a.n_layers * a.n_heads;
  const int lane = threadIdx.x % WARP;
  for (int t = first; t < visible; t += step) {
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

