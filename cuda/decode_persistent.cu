// decode_persistent.cu: a whole decode step (one token through every layer, the LM head
// and the attention mass) in one cooperative launch, the phases separated by grid-wide
// barriers (grid_sync.cuh) instead of kernel boundaries.
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
// Dtypes: weights wt; activations, cache, scores, partials, logits, mass fp32.
// PD_THREADS and PD_KEYS come from the loader's geometry table (cuda_kernels.py).
#include "common.cuh"
#include "grid_sync.cuh"
#include "matvec.cuh"
#include "pdl.cuh"
#include "persistent_ops.cuh"


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
    pd_prefetch<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, GridUnits{qkv_rows / 2}, qa);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.attn_norm, a.eps, scratch);
    pd_matvec<EPI_QKV_ROPE>(w, L.wqkv, qkv_rows, hid, xs, GridUnits{qkv_rows / 2}, nullptr, state, start, qa);
    // B: attention
    grid_sync(a.bar, &target);
    pd_attention_any<PD_WARPS>(a, L, start, qw);
    // C: o projection into the residual
    grid_arrive(a.bar);
    pd_prefetch<EPI_RESIDUAL>(w, L.wo, hid, q_size, GridUnits{hid_units}, none);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.attn_out, q_size, nullptr, a.eps, scratch);
    pd_matvec<EPI_RESIDUAL>(w, L.wo, hid, q_size, xs, GridUnits{hid_units}, a.x, state, start, none);
    // D: gate, up
    grid_arrive(a.bar);
    pd_prefetch<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, GridUnits{a.inter}, none);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, L.mlp_norm, a.eps, scratch);
    pd_matvec<EPI_SWIGLU>(w, L.wgate_up, 2 * a.inter, hid, xs, GridUnits{a.inter}, a.act, state, start, none);
    // E: down into the residual
    grid_arrive(a.bar);
    pd_prefetch<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, GridUnits{hid_units}, none);
    grid_wait(a.bar, &target);
    pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.act, a.inter, nullptr, a.eps, scratch);
    pd_matvec<EPI_RESIDUAL>(w, L.wdown, hid, a.inter, xs, GridUnits{hid_units}, a.x, state, start, none);
  }
  // LM head and the attention mass
  const int vocab_units = (a.vocab + 1) / 2;
  grid_arrive(a.bar);
  pd_prefetch<EPI_STORE>(w, a.lm_head, a.vocab, hid, GridUnits{vocab_units}, none);
  grid_wait(a.bar, &target);
  pd_stage<PD_THREADS, PD_STAGE4, 0>(xs, a.x, hid, a.final_norm, a.eps, scratch);
  pd_matvec<EPI_STORE>(w, a.lm_head, a.vocab, hid, xs, GridUnits{vocab_units}, a.logits, state, start, none);
  pd_mass(a, start, blockIdx.x * PD_WARPS + threadIdx.x / WARP, gridDim.x * PD_WARPS);
  grid_sync_reset(a.bar, &target);
}
