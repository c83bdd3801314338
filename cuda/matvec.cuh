// matvec.cuh: what a matmul does with its output rows, shared by the per-kernel matmuls
// (matmul.cu) and the persistent decode step (decode_persistent.cu).
//
// A unit is a pair of output rows. EPI_* names the fused epilogue; QkvArgs carries what
// the q/k/v epilogue needs (bias, RoPE tables, q and the cache slot to write). unit_rows
// maps a unit to its two rows, epilogue<EPI> writes the two dot products of one token.
// Dtypes: W, bias: wt; everything else fp32.
#pragma once
#include "common.cuh"

#define EPI_RESIDUAL 0
#define EPI_STORE 1
#define EPI_SWIGLU 2
#define EPI_QKV_ROPE 3

// Where the q/k/v epilogue writes a token's key and value: straight into the fp32 cache at
// its position, or (int8 cache) into the call's fp32 staging rows, by token, which
// kv_quantize (compact.cu) then stores as codes and scales.
#if defined(RT_KV_INT8)
#define KV_WRITE_SLOT tok
#else
#define KV_WRITE_SLOT pos
#endif

struct QkvArgs {
  const wt* bias;        // [q + 2 kv] or null
  float* q_out;          // [n_max, q_size]
  float* k_cache;        // this layer: [cap, n_kv, d]
  float* v_cache;
  const float* cos_t;    // [2 * cap, d / 2]
  const float* sin_t;
  int n_heads, n_kv, head_dim, cap;
};

// Rows of unit u for the qkv layout: RoPE pairs of q heads, of k heads, then v row pairs.
__device__ __forceinline__ void qkv_rows(int u, const QkvArgs& a, int* r0, int* r1, int* kind) {
  const int half = a.head_dim / 2, q_size = a.n_heads * a.head_dim, kv_size = a.n_kv * a.head_dim;
  if (u < a.n_heads * half) {
    *kind = 0;
    *r0 = (u / half) * a.head_dim + u % half;
    *r1 = *r0 + half;
  } else if (u < (a.n_heads + a.n_kv) * half) {
    const int v = u - a.n_heads * half;
    *kind = 1;
    *r0 = q_size + (v / half) * a.head_dim + v % half;
    *r1 = *r0 + half;
  } else {
    const int v = u - (a.n_heads + a.n_kv) * half;
    *kind = 2;
    *r0 = q_size + kv_size + 2 * v;
    *r1 = *r0 + 1;
  }
}

// Row pair (r0, r1) of unit u for token tok: y0, y1 through the epilogue EPI;
// qkv: (c, s) are the rotation's cos and sin when have_cs, else read here.
template <int EPI>
__device__ __forceinline__ void epilogue(int* state, int tok, int u, int rows, int r0, int r1,
                                         int kind, float y0, float y1, float* out,
                                         int last_only, int start, const QkvArgs& qa,
                                         bool have_cs = false, float c = 0.f, float s = 0.f) {
  if (EPI == EPI_RESIDUAL) {   // the residual through L2: a staged kernel's block may share
    // its SM, and so L1, with an earlier kernel's blocks that read x before it was updated
    float* o0 = out + (long long)tok * rows + r0;
    *o0 = ld_cg(o0) + y0;
    if (2 * u + 1 < rows) {
      float* o1 = out + (long long)tok * rows + r1;
      *o1 = ld_cg(o1) + y1;
    }
  } else if (EPI == EPI_STORE) {
    const long long base = last_only ? 0 : (long long)tok * rows;
    out[base + r0] = y0;
    if (2 * u + 1 < rows) out[base + r1] = y1;
    if (!isfinite(y0) || !isfinite(y1)) atomicOr(state + STATE_FLAGS, 1);
  } else if (EPI == EPI_SWIGLU) {
    out[(long long)tok * (rows / 2) + u] = y0 / (1.f + expf(-y0)) * y1;
  } else {
    if (qa.bias) { y0 += w2f(qa.bias[r0]); y1 += w2f(qa.bias[r1]); }
    const int d = qa.head_dim, half = d / 2, pos = start + tok;
    const int q_size = qa.n_heads * d, kv_size = qa.n_kv * d;
    if (kind < 2) {
      if (!have_cs) {
        const int i = (kind == 0 ? r0 : r0 - q_size) % d;
        c = qa.cos_t[(long long)(qa.cap + pos) * half + i];
        s = qa.sin_t[(long long)(qa.cap + pos) * half + i];
      }
      const float o0 = y0 * c - y1 * s, o1 = y1 * c + y0 * s;
      if (kind == 0) {
        qa.q_out[(long long)tok * q_size + r0] = o0;
        qa.q_out[(long long)tok * q_size + r1] = o1;
      } else {
        float* slot = qa.k_cache + (long long)KV_WRITE_SLOT * kv_size;
        slot[r0 - q_size] = o0;
        slot[r1 - q_size] = o1;
      }
    } else {
      float* slot = qa.v_cache + (long long)KV_WRITE_SLOT * kv_size;
      slot[r0 - q_size - kv_size] = y0;
      slot[r1 - q_size - kv_size] = y1;
    }
  }
}

// The output rows of unit u for epilogue EPI.
template <int EPI>
__device__ __forceinline__ void unit_rows(int u, int rows, const QkvArgs& qa, int* r0, int* r1,
                                          int* kind) {
  *kind = 0;
  if (EPI == EPI_SWIGLU) {
    *r0 = u; *r1 = rows / 2 + u;
  } else if (EPI == EPI_QKV_ROPE) {
    qkv_rows(u, qa, r0, r1, kind);
  } else {
    *r0 = 2 * u; *r1 = min(2 * u + 1, rows - 1);
  }
}
