// decode_dataflow.cu: a whole decode step in one launch, each block running its own list of
// tasks built on the host (rt_llm_node/backends/dataflow_plan.py) instead of phases separated
// by grid-wide barriers.
//
// decode_dataflow  grid = the plan's lists (one block of PD_THREADS each, all resident:
//   launched cooperatively), dynamic shared memory as decode_persistent. A task is
//   TASK_WORDS int32 words named by TASK_F_* (op, layer, unit0, units, two (counter, count)
//   waits, the counter it signals, arg). A block takes its tasks in order: it issues the
//   loads of the task's first weights (they depend on nothing), waits until each counter it
//   names has reached its count (ld.acquire polls by thread 0, then the block's barrier), runs
//   the task on its slice, and adds one to its own counter (the block's barrier, then a
//   release add by thread 0). The last block out zeroes every counter for the next launch
//   (graph replays need no memset). A wait past ~2^25 polls traps: a plan that could stall
//   fails instead of hanging the robot. Tasks (persistent_ops.cuh's bodies on a slice):
//   embed     x[unit0 : unit0 + units] = the token's embedding row
//   qkv       kv group arg's head units (its q heads, then its k head and v head)
//             [unit0, unit0 + units): RMSNorm of x into q, k, v with RoPE and the KV append
//   attn      kv group arg, cache chunk unit0 of TASK_CHUNK_KEYS keys: every q head of the
//             group, a warp per (head, PD_KEYS keys): raw scores, partial softmax and values
//   o         merges every head's partials in split order into shared memory (the first o
//             task also writes each head's softmax max and sum for the mass), then rows
//             [unit0, unit0 + units) of x += Wo attn
//   gate_up   act[unit0 : unit0 + units] = silu(Wg x_hat) * (Wu x_hat), x_hat of mlp_norm
//   down      rows [unit0, unit0 + units) of x += Wdown act
//   lm_head   the final norm, logits rows [unit0, unit0 + units), then the attention mass of
//             the keys t = arg * PD_WARPS + warp + k * (n_lm * PD_WARPS)
//   argmax    waits for every logit; the backend's argmax kernels run after the step
// Each unit is summed by one warp in persistent_ops.cuh's order: the results are bit for bit
// decode_persistent's, whatever the lists and their timing.
// Dtypes: weights wt; activations, cache, scores, partials, logits, mass fp32.
// TASK_* come from dataflow_plan.py's tables (cuda_kernels.compile_options).
#include "common.cuh"
#include "grid_sync.cuh"
#include "matvec.cuh"
#include "persistent_ops.cuh"

struct DataflowArgs {   // packed by the backend (launch_args.DATAFLOW_ARGS, the same order)
  const int* tasks;     // [lists, max_len, TASK_WORDS], each list nop-padded at its end
  unsigned* ready;      // [n_ready + 1]: the counters, then the blocks out
  int max_len, n_ready, n_lm;
};

__device__ __forceinline__ void ready_wait(const unsigned* ready, int counter, int need) {
  if (counter < 0) return;
  if (threadIdx.x == 0) {
    unsigned polls = 0;
    while ((int)ld_acquire_u32(ready + counter) < need) {
      if (++polls > (1u << 25)) asm volatile("trap;");
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void ready_signal(unsigned* ready, int counter) {
  __syncthreads();
  if (threadIdx.x == 0 && counter >= 0)
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(ready + counter) : "memory");
}

// The persistent step's unit of the task's j-th row pair (its numbering of q/k/v pairs,
// SwiGLU units and plain row pairs, matvec.cuh's unit_rows).
struct TaskUnits {
  int op, unit0, units, arg, half, group_q, n_heads, n_kv;
  __device__ __forceinline__ int count() const {
    if (op == TASK_OP_QKV) return units * half;
    if (op == TASK_OP_GATE_UP) return units;
    return (units + 1) / 2;
  }
  __device__ __forceinline__ int unit(int j) const {
    if (op == TASK_OP_QKV) {
      const int hu = unit0 + j / half, i = j % half;
      if (hu < group_q) return (arg * group_q + hu) * half + i;                 // a q head
      if (hu == group_q) return (n_heads + arg) * half + i;                     // the k head
      return (n_heads + n_kv + arg) * half + i;                                 // the v head
    }
    if (op == TASK_OP_GATE_UP) return unit0 + j;
    return unit0 / 2 + j;
  }
};

// pd_matvec on the task's units, a warp per unit (j = warp, warp + PD_WARPS, ...).
template <int EPI>
__device__ __forceinline__ void df_prefetch(PdBatch& w, const wt* W, int rows, int K,
                                            const TaskUnits& tu, const QkvArgs& qa) {
  const int j = threadIdx.x / WARP;
  if (j >= tu.count()) return;
  int r0, r1, kind;
  unit_rows<EPI>(tu.unit(j), rows, qa, &r0, &r1, &kind);
  pd_load(w, W, r0, r1, K, 0);
}

template <int EPI>
__device__ void df_matvec(PdBatch& w, const wt* W, int rows, int K, const float* xs,
                          const TaskUnits& tu, float* out, int* state, int start,
                          const QkvArgs& qa) {
  const int lane = threadIdx.x % WARP, n = tu.count();
  const int nc = K >> 3, n_batches = (nc + PD_PB * WARP - 1) / (PD_PB * WARP);
  int j = threadIdx.x / WARP, batch = 0;
  if (j >= n) return;
  int u = tu.unit(j), r0, r1, kind;
  unit_rows<EPI>(u, rows, qa, &r0, &r1, &kind);
  float a0 = 0.f, a1 = 0.f, res0 = 0.f, res1 = 0.f;   // res: residual, or cos and sin
  PdBatch next;
  while (true) {
    if (batch == 0 && lane == 0) {
      if (EPI == EPI_RESIDUAL) {
        res0 = __ldcg(out + r0);
        res1 = __ldcg(out + r1);
      } else if (EPI == EPI_QKV_ROPE && kind < 2) {
        const int half = qa.head_dim / 2, q_size = qa.n_heads * qa.head_dim;
        const int i = (kind == 0 ? r0 : r0 - q_size) % qa.head_dim;
        res0 = __ldg(qa.cos_t + (long long)(qa.cap + start) * half + i);
        res1 = __ldg(qa.sin_t + (long long)(qa.cap + start) * half + i);
      }
    }
    int nj = j, nb = batch + 1, nu = u, n0 = 0, n1 = 0, nkind = 0;
    if (nb == n_batches) { nj = j + PD_WARPS; nb = 0; }
    const bool more = nj < n;
    if (more) {
      nu = tu.unit(nj);
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

// Attention of kv group g over the splits [s0, s0 + n_s) of PD_KEYS keys: pd_attention's
// per-item body without its merge (the o tasks merge).
template <int DL>
__device__ void df_attention(const DecodeArgs& a, const DecodeLayer& L, int start, int g,
                             int s0, int n_s, float* qw) {
  constexpr int D = 32 * DL, KB = 32 / DL;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int visible = start + 1, used = (visible + PD_KEYS - 1) / PD_KEYS;
  const int group = a.n_heads / a.n_kv, kv_size = a.n_kv * D;
  float* q_s = qw + warp * D;
  for (int item = warp; item < group * n_s; item += PD_WARPS) {
    const int h = g * group + item / n_s, s = s0 + item % n_s;
    if (s >= used) continue;   // past the step's length: nothing to do
    const int k0 = s * PD_KEYS, count = min(PD_KEYS, visible - k0);
#pragma unroll
    for (int t = 0; t < DL; ++t) q_s[lane + WARP * t] = __ldcg(a.q + h * D + lane + WARP * t);
    __syncwarp();
    float score = NEG_INF;
    if (lane < count) {
      const float4* kr = reinterpret_cast<const float4*>(L.k + (long long)(k0 + lane) * kv_size + (h / group) * D);
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
    const float* vbase = L.v + (long long)k0 * kv_size + (h / group) * D + lane;
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
        const float pj = __shfl_sync(FULL_MASK, p, j0 + j);
        if (j0 + j < count)
#pragma unroll
          for (int t = 0; t < DL; ++t) o[t] = fmaf(pj, vv[j][t], o[t]);
      }
    }
    const long long slot = (long long)h * a.n_splits + s;
#pragma unroll
    for (int t = 0; t < DL; ++t) a.part_o[slot * D + lane + WARP * t] = o[t];
    if (lane == 0) { a.part_ml[2 * slot] = m; a.part_ml[2 * slot + 1] = l; }
    __syncwarp();
  }
}

// Every head's splits merged in split order into xs (pd_attention's merge, bit for bit), a
// warp a head; with write_ml the head's max and sum go to L.ml for the mass.
template <int DL>
__device__ void df_merge(const DecodeArgs& a, const DecodeLayer& L, int start, float* xs,
                         bool write_ml) {
  constexpr int D = 32 * DL;
  const int lane = threadIdx.x % WARP;
  const int used = (start + 1 + PD_KEYS - 1) / PD_KEYS;
  for (int h = threadIdx.x / WARP; h < a.n_heads; h += PD_WARPS) {
    const float* ml = a.part_ml + 2LL * h * a.n_splits;
    float M = NEG_INF, Lsum = 0.f, o[DL];
    for (int t = lane; t < used; t += WARP) M = fmaxf(M, __ldcg(ml + 2 * t));
    M = warp_max(M);
#pragma unroll
    for (int t = 0; t < DL; ++t) o[t] = 0.f;
    for (int t0 = 0; t0 < used; t0 += WARP) {
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
    for (int t = 0; t < DL; ++t) xs[h * D + lane + WARP * t] = o[t] / Lsum;
    if (write_ml && lane == 0) { L.ml[2 * h] = M; L.ml[2 * h + 1] = Lsum; }
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(PD_THREADS, 1)
decode_dataflow(int* state, const DecodeArgs* args, const DataflowArgs* plan) {
  extern __shared__ float4 df_smem4[];
  float* xs = reinterpret_cast<float*>(df_smem4);     // the task's input vector
  __shared__ float scratch[WARP];
  __shared__ float qw[PD_WARPS * 128];                 // attention: a warp's query
  const DecodeArgs a = *args;
  const DataflowArgs p = *plan;
  const int start = state[STATE_START], token = state[STATE_TOKEN];
  const int hid = a.hidden, d = a.head_dim, q_size = a.n_heads * d, kv_size = a.n_kv * d;
  const int qkv_rows = q_size + 2 * kv_size, group = a.n_heads / a.n_kv;
  const int* list = p.tasks + (long long)blockIdx.x * p.max_len * TASK_WORDS;
  const QkvArgs none = {};
  PdBatch w;
  for (int i = 0; i < p.max_len; ++i) {
    const int* t = list + i * TASK_WORDS;
    const int op = __ldg(t + TASK_F_OP);
    if (op == TASK_OP_NOP) break;
    const int layer = __ldg(t + TASK_F_LAYER);
    const TaskUnits tu = {op, __ldg(t + TASK_F_UNIT0), __ldg(t + TASK_F_UNITS),
                          __ldg(t + TASK_F_ARG), d / 2, group, a.n_heads, a.n_kv};
    const DecodeLayer L = a.layers[min(layer, a.n_layers - 1)];
    const QkvArgs qa = {L.bqkv, a.q, L.k, L.v, a.cos_t, a.sin_t, a.n_heads, a.n_kv, d, a.cap};
    // the task's first weights depend on nothing: in flight while it waits
    if (op == TASK_OP_QKV) df_prefetch<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, tu, qa);
    else if (op == TASK_OP_O) df_prefetch<EPI_RESIDUAL>(w, L.wo, hid, q_size, tu, none);
    else if (op == TASK_OP_GATE_UP) df_prefetch<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, tu, none);
    else if (op == TASK_OP_DOWN) df_prefetch<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, tu, none);
    else if (op == TASK_OP_LM_HEAD) df_prefetch<EPI_STORE>(w, a.lm_head, a.vocab, hid, tu, none);
    ready_wait(p.ready, __ldg(t + TASK_F_WAIT0), __ldg(t + TASK_F_NEED0));
    ready_wait(p.ready, __ldg(t + TASK_F_WAIT1), __ldg(t + TASK_F_NEED1));
    switch (op) {
      case TASK_OP_EMBED:
        for (int k = tu.unit0 + threadIdx.x; k < tu.unit0 + tu.units; k += blockDim.x)
          a.x[k] = w2f(a.embed[(long long)token * hid + k]);
        break;
      case TASK_OP_QKV:
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.attn_norm, a.eps, scratch);
        df_matvec<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, xs, tu, nullptr, state, start, qa);
        break;
      case TASK_OP_ATTN: {
        const int per = TASK_CHUNK_KEYS / PD_KEYS;
        switch (d / WARP) {
          case 1: df_attention<1>(a, L, start, tu.arg, tu.unit0 * per, per, qw); break;
          case 2: df_attention<2>(a, L, start, tu.arg, tu.unit0 * per, per, qw); break;
          default: df_attention<4>(a, L, start, tu.arg, tu.unit0 * per, per, qw); break;
        }
        break;
      }
      case TASK_OP_O:
        switch (d / WARP) {
          case 1: df_merge<1>(a, L, start, xs, tu.unit0 == 0); break;
          case 2: df_merge<2>(a, L, start, xs, tu.unit0 == 0); break;
          default: df_merge<4>(a, L, start, xs, tu.unit0 == 0); break;
        }
        df_matvec<EPI_RESIDUAL>(w, L.wo, hid, q_size, xs, tu, a.x, state, start, none);
        break;
      case TASK_OP_GATE_UP:
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.mlp_norm, a.eps, scratch);
        df_matvec<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, xs, tu, a.act, state, start, none);
        break;
      case TASK_OP_DOWN:
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.act, a.inter, nullptr, a.eps, scratch);
        df_matvec<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, xs, tu, a.x, state, start, none);
        break;
      case TASK_OP_LM_HEAD: {
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, a.final_norm, a.eps, scratch);
        df_matvec<EPI_STORE>(w, a.lm_head, a.vocab, hid, xs, tu, a.logits, state, start, none);
        // the attention mass of this task's keys (pd_mass's sum, bit for bit)
        const int visible = start + 1, n_rows = a.n_layers * a.n_heads, lane = threadIdx.x % WARP;
        for (int k = tu.arg * PD_WARPS + threadIdx.x / WARP; k < visible; k += p.n_lm * PD_WARPS) {
          float sum = 0.f;
#pragma unroll 4
          for (int r = lane; r < n_rows; r += WARP) {
            const DecodeLayer& M = a.layers[r / a.n_heads];
            const int h = r % a.n_heads;
            sum += expf(__ldcg(M.scores + (long long)h * a.cap + k) - __ldcg(M.ml + 2 * h)) /
                   __ldcg(M.ml + 2 * h + 1);
          }
          sum = warp_sum(sum);
          if (lane == 0) a.mass[k] = sum;
        }
        break;
      }
      default:   // argmax: the backend's argmax kernels run after the step
        break;
    }
    ready_signal(p.ready, __ldg(t + TASK_F_SIGNAL));
  }
  // the last block out zeroes the counters for the next launch
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned out;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(out) : "l"(p.ready + p.n_ready) : "memory");
    if (out == gridDim.x - 1)
      for (int c = 0; c <= p.n_ready; ++c) p.ready[c] = 0;
  }
}
