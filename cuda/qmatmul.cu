// qmatmul.cu: matmuls on grouped integer weights (rt_llm_node/model/quant.py): a weight is
// q * scale + offset, with one scale and offset per group of 2^gshift columns (16 or 32) of
// a row; offsets may be null (all zero). Formats: _i8, a signed byte a code; _u4, two codes
// a byte (0..15, the even column in the low nibble). Scales and offsets are fp32, or fp16
// (kernel names ending in h: _i8h, _u4h) where every one of a matrix is an fp16 exactly
// (the loader checks; Q8_0, Q4_0 and Q4_1 store fp16 ones): 2 bytes a group, not 4, and the
// same fp32 values once converted.
//
// qmatvec_<epilogue>_<fmt>: one token (decode, and the LM head's last token), the epilogues
// of matvec.cuh. Geometry: block = up to QMV_MAX_THREADS threads; a unit (two output rows)
// goes to `split` warps (1, 2 or 4) of one block, each taking a contiguous share of K, their
// sums added in shared memory; the blocks stride over the units (grid = at most what is
// resident), every warp of a block running the same number of rounds. grid.y = one block
// row per token (last_only: one). A chunk is what one 16-byte load of a row holds (16
// columns of i8, 32 of u4, always inside one group: one scale and offset a chunk). A lane
// takes the chunks c_begin + lane, + 32, ... of both rows of its unit into register slots:
// a batch of qbatch chunks of one unit, or (the _d2 kernels) the chunks of two of its units
// where a unit has at most 2 a lane, each slot refilled with the next unit's chunk once it is
// summed. The
// first slots load before the wait for the previous kernel, the norm weights copied into
// shared memory then too. The block stages x * norm_w (or x) in shared memory with the sum
// of each 16 values of it, in one pass that also sums x^2 (few large blocks: x is read from
// L2 once an SM, not once a small block), so a chunk costs
//   y += scale * (q . xn) + offset * sum(xn),   then y *= 1 / rms(x)
// Dynamic shared memory: K + K / 16 floats, and K more with a norm. u4 groups are 32 columns.
//
// qdequant_<fmt>: w = q * scale + offset into an fp32 [rows, K] matrix (the prefill tiles
// read it); it waits for the previous kernel first, which may still read the buffer.
// qembed_gather_<fmt>: x[t, :] = the dequantized row ids[t] (embed_gather's twin).
// Needs K % 32 == 0 (the loader quantizes only such rows).
#include "common.cuh"
#include "matvec.cuh"
#include "pdl.cuh"

#define QFMT_I8 0
#define QFMT_U4 1
#define QSUB 16               // columns of x a chunk sum covers (xsum)
#define QMV_MAX_THREADS 512
#ifndef QMV_MIN_BLOCKS        // blocks of QMV_MAX_THREADS an SM must hold (caps registers)
#define QMV_MIN_BLOCKS 1
#endif

// A chunk: the columns one 16-byte load of a row holds (i8: 16, u4: 32), inside one group
// (i8 groups are 16 or 32 columns, u4 groups 32).
template <int FMT> struct qcols { static constexpr int value = FMT == QFMT_I8 ? 16 : 32; };

// Chunks a lane loads per row before it multiplies, one unit at a time. i8: 4 (64 bytes of
// codes a row; with 512 threads, 64 KiB an SM in flight, the next unit's batch loading during
// this one's last). u4: 2, since a u4 chunk holds twice the columns and takes twice the
// arithmetic of an i8 one; measured on the H200, two in flight beat four on all three
// benchmark shapes (fewer registers, more units in flight; benchmarks/RESULTS.md).
// QBATCH=N sets both (sweeps).
#ifdef QBATCH
#define QBATCH_I8 QBATCH
#define QBATCH_U4 QBATCH
#endif
#ifndef QBATCH_I8
#define QBATCH_I8 4
#endif
#ifndef QBATCH_U4
#define QBATCH_U4 2
#endif
template <int FMT> struct qbatch {
  static constexpr int value = FMT == QFMT_I8 ? QBATCH_I8 : QBATCH_U4;
};

// The two-deep kernels (names ending in _d2) keep two units of a warp in flight, 2 chunks a
// lane each, in 4 register slots: the unit a round later loads while this one is summed,
// where one unit alone would leave a lane at most 2 chunks in flight between waits. The host
// calls them where a warp's share of a unit is at most 2 chunks a lane (K = 2048 in u4's
// 32-column chunks: gate/up, q/k/v and the LM head). QMV_DEEP 0 builds them one unit at a
// time, as the others (sweeps). QMV_DEEP_CPL (2) comes from the loader's table.
#ifndef QMV_DEEP
#define QMV_DEEP 1
#endif
// The staged x in shared memory, float4 slot p (columns 4p..4p+3) at xs_slot(p): swizzled
// within each 128-byte row (XOR of the slot's low three bits with the row's), since the
// lanes of a quarter warp read the same offset of consecutive chunks, 64 bytes apart (i8) or
// 128 (u4): unswizzled, the same four banks, a 4-way or 8-way conflict on every read of x.
#ifndef QXS_SWIZZLE
#define QXS_SWIZZLE 1
#endif
__device__ __forceinline__ int xs_slot(int p) {
  return QXS_SWIZZLE ? p ^ ((p >> 3) & 7) : p;
}

// The one-token kernels convert u4 codes in place (q_floats<U4, P>), against x staged
// times 16^-pos (pos of column % 8: 0, 1, 2, 3, 4, 2, 3, 4), exactly (powers of two), so the
// sums are those of the plain conversion, bit for bit. QU4_POSITIONAL 0: plain (a shift, a
// LOP3 and a subtraction a code); 1: the nibble masked under the exponent of 2^23 (one LOP3
// and one subtraction); 2: the nibble masked alone, read as the denormal c * 16^pos * 2^-149
// (one LOP3), x staged times 2^88 * 16^-pos (QU4_DN_SCALE) and each row's sums times
// 2^61 afterwards (QU4_DN_BACK) (fp32 FMA takes denormals at full rate; the kernels are
// compiled without flush-to-zero). The products c * x * 2^-61 stay normal for |x| >= 2^-65,
// and terms below that are far under an ulp of any sum. 2 is the default: on the H100 the
// Llama-3.2-1B shape's u4 step took 671 us against 747 (1) and 779 (0).
#ifndef QU4_POSITIONAL
#define QU4_POSITIONAL 2
#endif
#define QU4_DN_SCALE 0x1p88f   // |x * norm_w| up to 2^40 stays finite
#define QU4_DN_BACK 0x1p61f    // 2^(149 - 88): the products are c x 2^-61, far from underflow

// A scale or offset as fp32: stored as fp32 (float) or as fp16 bits (unsigned short).
__device__ __forceinline__ float load_sc(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_sc(const unsigned short* p) {
  return half_bits_to_float(__ldg(p));
}

// The 16-byte chunk c of a row.
__device__ __forceinline__ uint4 load_q(const unsigned char* row, int c) {
  return __ldg(reinterpret_cast<const uint4*>(row) + c);
}

// Sixteen codes of a chunk as floats, in column order, exactly: i8, the whole chunk (h = 0);
// u4, its half h (words x, y or z, w). No int-to-float conversion (a quarter-rate
// instruction, which set these kernels' pace): a code c in 0..255 placed in the low byte
// of 0x4B000000 is the float 2^23 + c, and one subtraction leaves c. A signed byte has its
// sign bit flipped first (c + 128), and 2^23 + 128 is subtracted. P > 0 (u4): each code
// times 16^pos (P 1) or 16^pos * 2^-149 (P 2), for an x staged to match (QU4_POSITIONAL).
template <int FMT, int P = 0>
__device__ __forceinline__ void q_floats(const uint4& r, int h, float* o) {
  if constexpr (FMT == QFMT_I8) {
    const unsigned u[4] = {r.x ^ 0x80808080u, r.y ^ 0x80808080u, r.z ^ 0x80808080u,
                           r.w ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)   // bytes: code j, 0x00, 0x00, 0x4B
        o[4 * i + j] = __uint_as_float(__byte_perm(u[i], 0x4B000000u, j | 0x7440)) -
                       8388736.f;
  } else if constexpr (P > 0) {
    // a nibble left where it is (bits 4 pos .. 4 pos + 3, inside the mantissa)
    const unsigned u[2] = {h ? r.z : r.x, h ? r.w : r.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const unsigned lo = u[i], hi = u[i] >> 12;   // nibbles 5..7 to positions 2..4
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const unsigned m = j < 5 ? lo & (0xfu << (4 * j)) : hi & (0xfu << (4 * (j - 3)));
        o[8 * i + j] = P == 2 ? __uint_as_float(m)
                              : __uint_as_float(m | 0x4B000000u) - 8388608.f;
      }
    }
  } else {
    const unsigned u[2] = {h ? r.z : r.x, h ? r.w : r.y};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        o[8 * i + j] = __uint_as_float(((u[i] >> (4 * j)) & 0xfu) | 0x4B000000u) - 8388608.f;
  }
}

template <int FMT>
__device__ __forceinline__ long long q_row_bytes(int K) {
  return FMT == QFMT_I8 ? (long long)K : (long long)(K / 2);
}

// (q . x) over 16 codes and the 16 values of x from float4 slot p0 on (shared memory).
__device__ __forceinline__ float dot16(const float* f, const float4* xs4, int p0, float d) {
#pragma unroll
  for (int j = 0; j < 16; j += 4) {
    const float4 xv = xs4[xs_slot(p0 + j / 4)];
    d = fmaf(f[j + 3], xv.w, fmaf(f[j + 2], xv.z, fmaf(f[j + 1], xv.y, fmaf(f[j], xv.x, d))));
  }
  return d;
}

// Shared memory of a one-token kernel besides the staged x (dynamic): block_sum's scratch and
// the split warps' partial sums, two rounds' worth.
struct QmvShared {
  float scratch[WARP];
  float2 part_sums[2][QMV_MAX_THREADS / WARP];
};

// One token's matmul over this block's units: D = 1, one unit of a warp at a time, in
// batches of qbatch chunks a lane; D = 2, two units in flight, QMV_DEEP_CPL chunks a lane each.
template <int EPI, int FMT, typename ST, int D>
__device__ __forceinline__ void qmatvec_run(QmvShared& sh, int* __restrict__ state,
                                            const unsigned char* __restrict__ codes,
                                            const ST* __restrict__ scales,
                                            const ST* __restrict__ offsets, int gshift,
                                            int rows, int K, const float* __restrict__ x,
                                            const wt* __restrict__ norm_w, float eps,
                                            float* __restrict__ out, int units, int last_only,
                                            const QkvArgs& qa, int split, int tok) {
  constexpr int CPL = D == 1 ? qbatch<FMT>::value : QMV_DEEP_CPL, B = CPL * D;
  constexpr int COLS = qcols<FMT>::value, HALVES = COLS / QSUB;
  extern __shared__ __align__(16) float q_smem[];
  float4* xs4 = reinterpret_cast<float4*>(q_smem);   // [K] x * norm_w (or x), xs_slot order
  float* xsum = q_smem + K;          // [K / 16] sum of each 16 values of it
  float* nws = xsum + K / QSUB;      // [K] the norm weights (with a norm)
  const int start = state[STATE_START];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  const int n_chunks = K / COLS, n_sub = K / QSUB, groups = K >> gshift;
  const long long row_bytes = q_row_bytes<FMT>(K);
  const int per_group = warps / split, part = warp % split;
  const int stride = gridDim.x * per_group;   // units between a warp's rounds
  // this warp's chunks: [c_begin, c_end), a whole number of lanes' worth where possible
  const int per_part = (n_chunks / split + WARP - 1) / WARP * WARP;
  const int c_begin = min(n_chunks, part * per_part);
  const int c_end = part == split - 1 ? n_chunks : min(n_chunks, c_begin + per_part);
  const int u = blockIdx.x * per_group + warp / split;   // this warp's first unit
  // the norm weights of this thread's 16 values (c = threadIdx.x, + blockDim.x, ...) copied
  // into shared memory before the wait, the first chunks of codes loaded
  if (norm_w)
    for (int c = threadIdx.x; c < n_sub; c += blockDim.x)
#pragma unroll
      for (int j = 0; j < QSUB; j += 4) cp_async16(nws + c * QSUB + j, norm_w + c * QSUB + j);
  // slots: chunks of both rows, their scales and offsets, all in flight together
  uint4 wa[B], wb[B];
  float sa[B], sb[B], oa[B], ob[B];
  auto load_batch = [&](int b, int rr0, int rr1, int c) {
    const int g = (c * COLS) >> gshift;
    wa[b] = load_q(codes + rr0 * row_bytes, c);
    wb[b] = load_q(codes + rr1 * row_bytes, c);
    sa[b] = load_sc(scales + (long long)rr0 * groups + g);
    sb[b] = load_sc(scales + (long long)rr1 * groups + g);
    oa[b] = offsets ? load_sc(offsets + (long long)rr0 * groups + g) : 0.f;
    ob[b] = offsets ? load_sc(offsets + (long long)rr1 * groups + g) : 0.f;
  };
  // the rows of the unit whose chunks slots d * CPL .. d * CPL + CPL - 1 hold
  int r0[D], r1[D], kind[D];
#pragma unroll
  for (int d = 0; d < D; ++d) {
    r0[d] = r1[d] = kind[d] = 0;
    if (u + d * stride < units) {
      unit_rows<EPI>(u + d * stride, rows, qa, &r0[d], &r1[d], &kind[d]);
#pragma unroll
      for (int k = 0; k < CPL; ++k)
        if (c_begin + lane + k * WARP < c_end)
          load_batch(d * CPL + k, r0[d], r1[d], c_begin + lane + k * WARP);
    }
  }
  pdl_wait_then_release();   // the codes are in flight; x comes from the previous kernel
  // one pass over x: x * norm_w and its chunk sums into shared memory, the sum of squares
  // for 1 / rms, which multiplies the row's dot products at the end (rmsnorm is linear)
  const float* xt = x + (long long)tok * K;
  if (norm_w) cp_async_wait_all();   // this thread's own chunks: no barrier needed
  float ss = 0.f;
  for (int c = threadIdx.x; c < n_sub; c += blockDim.x) {
    float4 v[QSUB / 4];
#pragma unroll
    for (int j = 0; j < QSUB / 4; ++j)
      v[j] = ld_cg4(reinterpret_cast<const float4*>(xt + c * QSUB) + j);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < QSUB / 4; ++j) {
      ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
      if (norm_w) {
        const float4 w = *reinterpret_cast<const float4*>(nws + c * QSUB + 4 * j);
        v[j] = make_float4(v[j].x * w.x, v[j].y * w.y, v[j].z * w.z, v[j].w * w.w);
      }
      s += v[j].x + v[j].y + v[j].z + v[j].w;
      if constexpr (FMT == QFMT_U4 && QU4_POSITIONAL) {   // columns 0-3 or 4-7 of a word's eight
        constexpr float e = QU4_POSITIONAL == 2 ? QU4_DN_SCALE : 1.f;
        if (j % 2 == 0)
          v[j] = make_float4(v[j].x * e, v[j].y * (e * 0x1p-4f), v[j].z * (e * 0x1p-8f),
                             v[j].w * (e * 0x1p-12f));
        else
          v[j] = make_float4(v[j].x * (e * 0x1p-16f), v[j].y * (e * 0x1p-8f),
                             v[j].z * (e * 0x1p-12f), v[j].w * (e * 0x1p-16f));
      }
      xs4[xs_slot(c * (QSUB / 4) + j)] = v[j];
    }
    xsum[c] = s;
  }
  // block_sum's barriers also publish xs4 and xsum
  const float inv_rms = norm_w ? 1.f / sqrtf(block_sum(ss, sh.scratch) / K + eps) : 1.f;
  if (!norm_w) __syncthreads();

  // slot b's codes (chunk c) dotted with x: 16 codes of one row converted at a time
  auto dots = [&](int b, int c, float& d0, float& d1) {
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int p0 = (c * COLS + h * QSUB) / 4;
      float f[QSUB];
      q_floats<FMT, QU4_POSITIONAL>(wa[b], h, f);
      d0 = dot16(f, xs4, p0, d0);
      q_floats<FMT, QU4_POSITIONAL>(wb[b], h, f);
      d1 = dot16(f, xs4, p0, d1);
    }
  };
  // chunk c's dot products times its scales, plus its offsets times the sum of its x
  auto accumulate = [&](int c, float d0, float d1, float s0, float s1, float o0, float o1,
                        float& a0, float& a1) {
    if constexpr (FMT == QFMT_U4 && QU4_POSITIONAL == 2) {   // exact: a power of two
      s0 *= QU4_DN_BACK;
      s1 *= QU4_DN_BACK;
    }
    a0 = fmaf(s0, d0, a0);
    a1 = fmaf(s1, d1, a1);
    if (offsets) {
      const float sx = HALVES == 1 ? xsum[c] : xsum[2 * c] + xsum[2 * c + 1];
      a0 = fmaf(o0, sx, a0);
      a1 = fmaf(o1, sx, a1);
    }
  };
  // a unit's lane sums to its two outputs (the split warps' added in shared memory); every
  // warp of the block calls this the same number of times (the split's barrier needs it)
  auto finish = [&](int round, bool active, int uu, int rr0, int rr1, int kk, float a0,
                    float a1) {
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    bool mine = active && lane == 0;
    if (split > 1) {
      if (lane == 0) sh.part_sums[round & 1][warp] = make_float2(a0, a1);
      __syncthreads();
      mine = mine && part == 0;
      if (mine)
        for (int p = 1; p < split; ++p) {
          a0 += sh.part_sums[round & 1][warp + p].x;
          a1 += sh.part_sums[round & 1][warp + p].y;
        }
    }
    if (mine)
      epilogue<EPI>(state, tok, uu, rows, rr0, rr1, kk, a0 * inv_rms, a1 * inv_rms, out,
                    last_only, start, qa);
  };

  if constexpr (D == 1) {
    bool loaded = true;   // the first batch of the warp's unit is in the slots
    int uu = u;
    for (int round = 0, base_u = blockIdx.x * per_group; base_u < units;
         ++round, base_u += stride, uu += stride) {
      const bool active = uu < units;
      const int nu = uu + stride;   // this warp's next unit: its first batch loads during
      int n0 = 0, n1 = 0, nkind = 0;   // the last batch of this one
      if (nu < units) unit_rows<EPI>(nu, rows, qa, &n0, &n1, &nkind);
      float a0 = 0.f, a1 = 0.f;
      for (int base = c_begin; active && base < c_end; base += B * WARP) {
        if (!loaded) {
#pragma unroll
          for (int b = 0; b < B; ++b)
            if (base + lane + b * WARP < c_end)
              load_batch(b, r0[0], r1[0], base + lane + b * WARP);
        }
        loaded = false;
        const bool last = base + B * WARP >= c_end;
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int c = base + lane + b * WARP, cn = c_begin + lane + b * WARP;
          const bool have = c < c_end;
          float d0 = 0.f, d1 = 0.f;
          const float s0 = sa[b], s1 = sb[b], o0 = oa[b], o1 = ob[b];
          if (have) dots(b, c, d0, d1);
          if (last && nu < units && cn < c_end) {   // the registers are free: refill them
            load_batch(b, n0, n1, cn);
            loaded = true;
          }
          if (have) accumulate(c, d0, d1, s0, s1, o0, o1, a0, a1);
        }
      }
      finish(round, active, uu, r0[0], r1[0], kind[0], a0, a1);
      r0[0] = n0; r1[0] = n1; kind[0] = nkind;
    }
  } else {
    // rounds in groups of D: slot group d holds unit u + (round + d) * stride, refilled with
    // the unit D rounds later as soon as each chunk of it is summed
    for (int round = 0, base_u = blockIdx.x * per_group; base_u < units;
         round += D, base_u += D * stride) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if (base_u + d * stride < units) {   // the same for every warp of the block
          const int uu = u + (round + d) * stride, nu = uu + D * stride;
          const bool active = uu < units;
          int n0 = 0, n1 = 0, nkind = 0;
          if (nu < units) unit_rows<EPI>(nu, rows, qa, &n0, &n1, &nkind);
          float a0 = 0.f, a1 = 0.f;
#pragma unroll
          for (int k = 0; k < CPL; ++k) {
            const int b = d * CPL + k, c = c_begin + lane + k * WARP;
            const bool have = active && c < c_end;
            float d0 = 0.f, d1 = 0.f;
            const float s0 = sa[b], s1 = sb[b], o0 = oa[b], o1 = ob[b];
            if (have) dots(b, c, d0, d1);
            if (nu < units && c < c_end) load_batch(b, n0, n1, c);
            if (have) accumulate(c, d0, d1, s0, s1, o0, o1, a0, a1);
          }
          finish(round + d, active, uu, r0[d], r1[d], kind[d], a0, a1);
          r0[d] = n0; r1[d] = n1; kind[d] = nkind;
        }
      }
    }
  }
}

// DEEP: two units of a warp in flight (the _d2 kernels; a warp's share of a unit at most
// QMV_DEEP_CPL chunks a lane), else one.
template <int EPI, int FMT, typename ST, int DEEP>
__device__ void qmatvec_body(int* __restrict__ state, const unsigned char* __restrict__ codes,
                             const ST* __restrict__ scales, const ST* __restrict__ offsets,
                             int gshift, int rows, int K, const float* __restrict__ x,
                             const wt* __restrict__ norm_w, float eps, float* __restrict__ out,
                             int units, int last_only, QkvArgs qa, int split) {
  __shared__ QmvShared sh;
  const int n = state[STATE_N];
  const int tok = last_only ? n - 1 : blockIdx.y;
  if (tok >= n) {  // the whole block leaves together
    pdl_wait_then_release();
    return;
  }
  qmatvec_run<EPI, FMT, ST, DEEP && QMV_DEEP ? 2 : 1>(sh, state, codes, scales, offsets, gshift,
                                                       rows, K, x, norm_w, eps, out, units,
                                                       last_only, qa, split, tok);
}

#define QBOUNDS __launch_bounds__(QMV_MAX_THREADS, QMV_MIN_BLOCKS)
#define QMATVEC_PLAIN(NAME, EPI, FMT, ST, DEEP)                                              \
  extern "C" __global__ void QBOUNDS                                                         \
  NAME(int* state, const unsigned char* codes, const ST* scales, const ST* offsets,          \
       int gshift, int rows, int K, const float* x, const wt* norm_w, float eps, float* out,  \
       int units, int last_only, int split) {                                                \
    QkvArgs none = {};                                                                       \
    qmatvec_body<EPI, FMT, ST, DEEP>(state, codes, scales, offsets, gshift, rows, K, x,      \
                                     norm_w, eps, out, units, last_only, none, split);       \
  }

#define QMATVEC_QKV(NAME, FMT, ST, DEEP)                                                     \
  extern "C" __global__ void QBOUNDS                                                         \
  NAME(int* state, const unsigned char* codes, const ST* scales, const ST* offsets,          \
       int gshift, int rows, int K, const float* x, const wt* norm_w, float eps, int units,   \
       const wt* bias, float* q_out, float* k_cache, float* v_cache, const float* cos_t,      \
       const float* sin_t, int n_heads, int n_kv, int head_dim, int cap, int split) {        \
    QkvArgs qa = {bias, q_out, k_cache, v_cache, cos_t, sin_t, n_heads, n_kv, head_dim,      \
                  cap};                                                                      \
    qmatvec_body<EPI_QKV_ROPE, FMT, ST, DEEP>(state, codes, scales, offsets, gshift, rows, K, \
                                              x, norm_w, eps, nullptr, units, 0, qa, split);  \
  }

// The one-token kernels: fp32 scales and offsets, then fp16 ones (names ending in h); one
// unit of a warp in flight, then two (_d2).
QMATVEC_PLAIN(qmatvec_residual_i8, EPI_RESIDUAL, QFMT_I8, float, 0)
QMATVEC_PLAIN(qmatvec_store_i8, EPI_STORE, QFMT_I8, float, 0)
QMATVEC_PLAIN(qmatvec_swiglu_i8, EPI_SWIGLU, QFMT_I8, float, 0)
QMATVEC_QKV(qmatvec_qkv_rope_i8, QFMT_I8, float, 0)
QMATVEC_PLAIN(qmatvec_residual_i8_d2, EPI_RESIDUAL, QFMT_I8, float, 1)
QMATVEC_PLAIN(qmatvec_store_i8_d2, EPI_STORE, QFMT_I8, float, 1)
QMATVEC_PLAIN(qmatvec_swiglu_i8_d2, EPI_SWIGLU, QFMT_I8, float, 1)
QMATVEC_QKV(qmatvec_qkv_rope_i8_d2, QFMT_I8, float, 1)
QMATVEC_PLAIN(qmatvec_residual_u4, EPI_RESIDUAL, QFMT_U4, float, 0)
QMATVEC_PLAIN(qmatvec_store_u4, EPI_STORE, QFMT_U4, float, 0)
QMATVEC_PLAIN(qmatvec_swiglu_u4, EPI_SWIGLU, QFMT_U4, float, 0)
QMATVEC_QKV(qmatvec_qkv_rope_u4, QFMT_U4, float, 0)
QMATVEC_PLAIN(qmatvec_residual_u4_d2, EPI_RESIDUAL, QFMT_U4, float, 1)
QMATVEC_PLAIN(qmatvec_store_u4_d2, EPI_STORE, QFMT_U4, float, 1)
QMATVEC_PLAIN(qmatvec_swiglu_u4_d2, EPI_SWIGLU, QFMT_U4, float, 1)
QMATVEC_QKV(qmatvec_qkv_rope_u4_d2, QFMT_U4, float, 1)
QMATVEC_PLAIN(qmatvec_residual_i8h, EPI_RESIDUAL, QFMT_I8, unsigned short, 0)
QMATVEC_PLAIN(qmatvec_store_i8h, EPI_STORE, QFMT_I8, unsigned short, 0)
QMATVEC_PLAIN(qmatvec_swiglu_i8h, EPI_SWIGLU, QFMT_I8, unsigned short, 0)
QMATVEC_QKV(qmatvec_qkv_rope_i8h, QFMT_I8, unsigned short, 0)
QMATVEC_PLAIN(qmatvec_residual_i8h_d2, EPI_RESIDUAL, QFMT_I8, unsigned short, 1)
QMATVEC_PLAIN(qmatvec_store_i8h_d2, EPI_STORE, QFMT_I8, unsigned short, 1)
QMATVEC_PLAIN(qmatvec_swiglu_i8h_d2, EPI_SWIGLU, QFMT_I8, unsigned short, 1)
QMATVEC_QKV(qmatvec_qkv_rope_i8h_d2, QFMT_I8, unsigned short, 1)
QMATVEC_PLAIN(qmatvec_residual_u4h, EPI_RESIDUAL, QFMT_U4, unsigned short, 0)
QMATVEC_PLAIN(qmatvec_store_u4h, EPI_STORE, QFMT_U4, unsigned short, 0)
QMATVEC_PLAIN(qmatvec_swiglu_u4h, EPI_SWIGLU, QFMT_U4, unsigned short, 0)
QMATVEC_QKV(qmatvec_qkv_rope_u4h, QFMT_U4, unsigned short, 0)
QMATVEC_PLAIN(qmatvec_residual_u4h_d2, EPI_RESIDUAL, QFMT_U4, unsigned short, 1)
QMATVEC_PLAIN(qmatvec_store_u4h_d2, EPI_STORE, QFMT_U4, unsigned short, 1)
QMATVEC_PLAIN(qmatvec_swiglu_u4h_d2, EPI_SWIGLU, QFMT_U4, unsigned short, 1)
QMATVEC_QKV(qmatvec_qkv_rope_u4h_d2, QFMT_U4, unsigned short, 1)

// Chunk c of a row, dequantized into o[qcols<FMT>].
template <int FMT, typename ST>
__device__ __forceinline__ void dequant_chunk(const unsigned char* row, const ST* s,
                                              const ST* off, int gshift, int c, float* o) {
  const uint4 r = load_q(row, c);
  const int g = (c * qcols<FMT>::value) >> gshift;
  const float scale = load_sc(s + g), offset = off ? load_sc(off + g) : 0.f;
#pragma unroll
  for (int h = 0; h < qcols<FMT>::value / QSUB; ++h) {
    q_floats<FMT>(r, h, o + h * QSUB);
#pragma unroll
    for (int j = 0; j < QSUB; ++j) o[h * QSUB + j] = fmaf(o[h * QSUB + j], scale, offset);
  }
}

template <int FMT, typename ST>
__device__ void qdequant_body(const unsigned char* __restrict__ codes,
                              const ST* __restrict__ scales, const ST* __restrict__ offsets, int gshift, int rows, int K,
                              float* __restrict__ out) {
  pdl_wait_then_release();   // the previous kernel may still read `out`
  constexpr int COLS = qcols<FMT>::value;
  const int n_chunks = K / COLS, groups = K >> gshift;
  const long long total = (long long)rows * n_chunks;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int r = (int)(i / n_chunks), c = (int)(i % n_chunks);
    float o[COLS];
    dequant_chunk<FMT, ST>(codes + r * q_row_bytes<FMT>(K), scales + (long long)r * groups,
                       offsets ? offsets + (long long)r * groups : nullptr, gshift, c, o);
    float4* dst = reinterpret_cast<float4*>(out + (long long)r * K + c * COLS);
#pragma unroll
    for (int j = 0; j < COLS / 4; ++j)
      dst[j] = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
  }
}

template <int FMT, typename ST>
__device__ void qembed_body(const int* __restrict__ state, const int* __restrict__ ids,
                            const unsigned char* __restrict__ codes,
                            const ST* __restrict__ scales, const ST* __restrict__ offsets,
                            int gshift, int hidden, float* __restrict__ x, int from_state) {
  pdl_wait_then_release();
  const int t = blockIdx.x;
  if (t >= state[STATE_N]) return;
  const int id = from_state ? state[STATE_TOKEN] : ids[t];
  constexpr int COLS = qcols<FMT>::value;
  const int groups = hidden >> gshift;
  for (int c = threadIdx.x; c < hidden / COLS; c += blockDim.x) {
    float o[COLS];
    dequant_chunk<FMT, ST>(codes + id * q_row_bytes<FMT>(hidden), scales + (long long)id * groups,
                       offsets ? offsets + (long long)id * groups : nullptr, gshift, c, o);
#pragma unroll
    for (int j = 0; j < COLS; ++j) x[(long long)t * hidden + c * COLS + j] = o[j];
  }
}

#define QDQ_BOUNDS __launch_bounds__(256)
#define QDEQUANT_KERNEL(NAME, FMT, ST)                                                       \
  extern "C" __global__ void QDQ_BOUNDS                                                      \
  NAME(const unsigned char* codes, const ST* scales, const ST* offsets, int gshift, int rows, \
       int K, float* out) {                                                                  \
    qdequant_body<FMT, ST>(codes, scales, offsets, gshift, rows, K, out);                    \
  }

#define QEMBED_KERNEL(NAME, FMT, ST)                                                         \
  extern "C" __global__ void QDQ_BOUNDS                                                      \
  NAME(const int* state, const int* ids, const unsigned char* codes, const ST* scales,       \
       const ST* offsets, int gshift, int hidden, float* x, int from_state) {                \
    qembed_body<FMT, ST>(state, ids, codes, scales, offsets, gshift, hidden, x, from_state); \
  }

QDEQUANT_KERNEL(qdequant_i8, QFMT_I8, float)
QDEQUANT_KERNEL(qdequant_u4, QFMT_U4, float)
QDEQUANT_KERNEL(qdequant_i8h, QFMT_I8, unsigned short)
QDEQUANT_KERNEL(qdequant_u4h, QFMT_U4, unsigned short)
QEMBED_KERNEL(qembed_gather_i8, QFMT_I8, float)
QEMBED_KERNEL(qembed_gather_u4, QFMT_U4, float)
QEMBED_KERNEL(qembed_gather_i8h, QFMT_I8, unsigned short)
QEMBED_KERNEL(qembed_gather_u4h, QFMT_U4, unsigned short)
