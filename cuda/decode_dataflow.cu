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

// A task's units for pd_matvec (as GridUnits): the block's warps take its row pairs j =
// warp, warp + PD_WARPS, ..., each mapped to the persistent step's numbering of q/k/v pairs,
// SwiGLU units and plain row pairs (matvec.cuh's unit_rows).
struct TaskUnits {
  int op, unit0, units, arg, half, group_q, n_heads, n_kv, count;
  __device__ TaskUnits(int op_, int unit0_, int units_, int arg_, int half_, int group_q_,
                       int n_heads_, int n_kv_)
      : op(op_), unit0(unit0_), units(units_), arg(arg_), half(half_), group_q(group_q_),
        n_heads(n_heads_), n_kv(n_kv_),
        count(op_ == TASK_OP_QKV ? units_ * half_
              : op_ == TASK_OP_GATE_UP ? units_ : (units_ + 1) / 2) {}
  __device__ __forceinline__ int first() const { return threadIdx.x / WARP; }
  __device__ __forceinline__ int step() const { return PD_WARPS; }
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
    const TaskUnits tu(op, __ldg(t + TASK_F_UNIT0), __ldg(t + TASK_F_UNITS),
                       __ldg(t + TASK_F_ARG), d / 2, group, a.n_heads, a.n_kv);
    const DecodeLayer L = a.layers[min(layer, a.n_layers - 1)];
    const QkvArgs qa = {L.bqkv, a.q, L.k, L.v, a.cos_t, a.sin_t, a.n_heads, a.n_kv, d, a.cap};
    // the task's first weights depend on nothing: in flight while it waits
    if (op == TASK_OP_QKV) pd_prefetch<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, tu, qa);
    else if (op == TASK_OP_O) pd_prefetch<EPI_RESIDUAL>(w, L.wo, hid, q_size, tu, none);
    else if (op == TASK_OP_GATE_UP) pd_prefetch<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, tu, none);
    else if (op == TASK_OP_DOWN) pd_prefetch<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, tu, none);
    else if (op == TASK_OP_LM_HEAD) pd_prefetch<EPI_STORE>(w, a.lm_head, a.vocab, hid, tu, none);
    ready_wait(p.ready, __ldg(t + TASK_F_WAIT0), __ldg(t + TASK_F_NEED0));
    ready_wait(p.ready, __ldg(t + TASK_F_WAIT1), __ldg(t + TASK_F_NEED1));
    switch (op) {
      case TASK_OP_EMBED:
        for (int k = tu.unit0 + threadIdx.x; k < tu.unit0 + tu.units; k += blockDim.x)
          a.x[k] = w2f(a.embed[(long long)token * hid + k]);
        break;
      case TASK_OP_QKV:
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.attn_norm, a.eps, scratch);
        pd_matvec<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, xs, tu, nullptr, state, start, qa);
        break;
      case TASK_OP_ATTN: {   // every q head of kv group arg over the chunk's splits
        const int per = TASK_CHUNK_KEYS / PD_KEYS, visible = start + 1;
        const int used = (visible + PD_KEYS - 1) / PD_KEYS;
        for (int item = threadIdx.x / WARP; item < group * per; item += PD_WARPS) {
          const int h = tu.arg * group + item / per, s = tu.unit0 * per + item % per;
          if (s >= used) continue;   // past the step's length: nothing to do
          float* q_s = qw + (threadIdx.x / WARP) * d;
          switch (d / WARP) {
            case 1: pd_attend<1>(a, L, visible, h, s, q_s); break;
            case 2: pd_attend<2>(a, L, visible, h, s, q_s); break;
            default: pd_attend<4>(a, L, visible, h, s, q_s); break;
          }
          __syncwarp();
        }
        break;
      }
      case TASK_OP_O: {   // every head merged into shared memory, then x += Wo attn
        const int used = (start + 1 + PD_KEYS - 1) / PD_KEYS;
        float* ml = tu.unit0 == 0 ? L.ml : nullptr;   // the first o task keeps them for the mass
        for (int h = threadIdx.x / WARP; h < a.n_heads; h += PD_WARPS) {
          switch (d / WARP) {
            case 1: pd_merge_head<1>(a, h, used, xs, ml); break;
            case 2: pd_merge_head<2>(a, h, used, xs, ml); break;
            default: pd_merge_head<4>(a, h, used, xs, ml); break;
          }
        }
        __syncthreads();
        pd_matvec<EPI_RESIDUAL>(w, L.wo, hid, q_size, xs, tu, a.x, state, start, none);
        break;
      }
      case TASK_OP_GATE_UP:
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.mlp_norm, a.eps, scratch);
        pd_matvec<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, xs, tu, a.act, state, start, none);
        break;
      case TASK_OP_DOWN:
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.act, a.inter, nullptr, a.eps, scratch);
        pd_matvec<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, xs, tu, a.x, state, start, none);
        break;
      case TASK_OP_LM_HEAD: {
        pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, a.final_norm, a.eps, scratch);
        pd_matvec<EPI_STORE>(w, a.lm_head, a.vocab, hid, xs, tu, a.logits, state, start, none);
        pd_mass(a, start, tu.arg * PD_WARPS + threadIdx.x / WARP, p.n_lm * PD_WARPS);
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
