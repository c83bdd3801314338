// probe_fused_layer.cu: a decode step's q/k/v + RoPE, attention and o projection of one
// layer as ONE kernel, a thread-block cluster per KV group (sm_90), the Llama-3.2-1B shape
// with u4/32 weights and fp16 scales and offsets (the `_u4h` format of qmatmul.cu, whose
// device functions it uses: compiled after it in one program). A study of what a layer with
// fewer dependent phases gains; not part of the node's program.
//
// fused_qkv_attn_o_probe  grid = FL_NKV clusters of FL_CS blocks (launched with a cluster
//   dimension of FL_CS), FL_THREADS threads.
//   Cluster c (KV head c, query heads FL_G c .. FL_G c + FL_G - 1), rank r:
//   before the wait  its share of the group's q/k/v rows (FL_QKV_UNITS row pairs, a warp
//                    each, every chunk in registers), its 128 rows x 256 columns of o_proj
//                    (the group's columns), the norm weights and its cached keys and values
//                    (tokens [r tpb, (r + 1) tpb) below the position) into shared memory;
//   then             x staged as qmatmul.cu stages it, the rows' dot products;
//   cluster barrier  every block pulls the group's 384 q/k/v values (DSMEM), applies RoPE;
//                    the block holding the position writes its key and value to the cache;
//                    scores of its tokens for the group's query heads (written raw, as
//                    attn_decode writes them), its split's max, sum and weighted values;
//   cluster barrier  every block merges the FL_CS splits of the group's heads (DSMEM), rank
//                    0 writes each head's max and sum (row_ml);
//   arrive           (its shared memory stays until every block has read it), then its
//                    o_proj rows times the group's attention output: o_part[c, rows];
//   wait             then exit.
// The o projection's input is split by KV group, so the layer's output is x + sum over c of
// o_part[c]: the next kernel (the MLP's norm) would add the FL_NKV partials to x.
#include "common.cuh"
#include "pdl.cuh"

#define FL_HID 2048                    // hidden size = K of q/k/v, rows of o
#define FL_NH 32                       // query heads
#define FL_NKV 8                       // KV heads = clusters
#define FL_HD 64                       // head dim
#define FL_G (FL_NH / FL_NKV)          // query heads a group
#define FL_CS 16                       // blocks a cluster
#define FL_THREADS 512
#define FL_WARPS (FL_THREADS / WARP)
#define FL_ROWS ((FL_G + 2) * FL_HD)   // q/k/v rows of a group (384)
#define FL_QKV_UNITS (FL_ROWS / 2 / FL_CS)   // row pairs a block (12)
#define FL_OROWS (FL_HID / FL_CS)      // o rows a block (128)
#define FL_OCOLS (FL_G * FL_HD)        // o columns a group (256)
#define FL_TMAX 40                     // cached tokens a block at most
#define FL_KP (FL_HD + 1)              // a key row's pitch in shared memory

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned fl_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void fl_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float fl_remote(const float* local, unsigned rank) {
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(local)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

// u4 chunk ch (32 codes) of a row dotted with its 32 values of x (xs_slot order).
__device__ __forceinline__ float fl_chunk_dot(const uint4& w, const float4* xs, int ch) {
  float d = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float f[QSUB];
    q_floats<QFMT_U4, 0>(w, h, f);
    d = dot16(f, xs, (ch * 32 + h * QSUB) / 4, d);
  }
  return d;
}

extern "C" __global__ void __launch_bounds__(FL_THREADS, 1)
fused_qkv_attn_o_probe(const float* __restrict__ x, const float* __restrict__ norm_w,
                       float eps, const unsigned char* __restrict__ qkv_codes,
                       const unsigned short* __restrict__ qkv_scales,
                       const unsigned short* __restrict__ qkv_offsets,
                       const unsigned char* __restrict__ o_codes,
                       const unsigned short* __restrict__ o_scales,
                       const unsigned short* __restrict__ o_offsets,
                       const float* __restrict__ rope_cs,   // [FL_HD / 2][2]: cos, sin at pos
                       float* __restrict__ k_cache, float* __restrict__ v_cache, int pos,
                       int cap, float scale, float* __restrict__ scores,
                       float* __restrict__ row_ml, float* __restrict__ o_part,
                       unsigned long long* __restrict__ trace) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // trace (may be null): thread 0's %globaltimer at the phase marks, FL_MARKS a block
#define FL_MARKS 10
#define FL_MARK(k)                                                                  \
  if (trace && threadIdx.x == 0) {                                                  \
    unsigned long long t;                                                           \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));                           \
    trace[blockIdx.x * FL_MARKS + (k)] = t;                                         \
  }
  FL_MARK(0);
  __shared__ __align__(16) float4 xs4[FL_HID / 4];     // x * norm_w, xs_slot order
  __shared__ __align__(16) float nws[FL_HID];
  __shared__ float xsum[FL_HID / QSUB];
  __shared__ __align__(16) float ks[FL_TMAX * FL_KP];  // cached keys (pitch FL_KP)
  __shared__ __align__(16) float vs[FL_TMAX * FL_HD];  // cached values
  __shared__ float mine[2 * FL_QKV_UNITS];             // this block's q/k/v rows
  __shared__ float qkv[FL_ROWS];                       // the group's, RoPE applied to q, k
  __shared__ float p[FL_G][FL_TMAX];
  __shared__ float part[FL_G][FL_HD + 2];              // m, l, weighted values of a head
  __shared__ __align__(16) float4 a4[FL_OCOLS / 4];    // merged attention, xs_slot order
  __shared__ float asum[FL_OCOLS / 32];
  __shared__ float scratch[WARP];
  const unsigned rank = fl_rank();
  const int c = blockIdx.x / FL_CS;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int visible = pos + 1, tpb = (visible + FL_CS - 1) / FL_CS;
  const int k0 = rank * tpb, cnt = max(0, min(tpb, visible - k0));
  const long long row_bytes = FL_HID / 2, groups = FL_HID / 32;

  // ---- before the wait: norm weights, cached keys and values, every weight chunk ----
  for (int s = threadIdx.x; s < FL_HID / QSUB; s += FL_THREADS)   // the values it stages
#pragma unroll
    for (int j = 0; j < QSUB; j += 4) cp_async16(nws + s * QSUB + j, norm_w + s * QSUB + j);
  asm volatile("cp.async.commit_group;" ::: "memory");
  const int old = max(0, min(cnt, pos - k0));   // tokens below the position
  for (int e = threadIdx.x; e < old * (FL_HD / 4); e += FL_THREADS) {
    const int j = e / (FL_HD / 4), q4 = e % (FL_HD / 4);
    const long long src = ((long long)(k0 + j) * FL_NKV + c) * FL_HD + 4 * q4;
    cp_async16(vs + j * FL_HD + 4 * q4, v_cache + src);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  float4 kreg[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
#pragma unroll
  for (int b = 0; b < 2; ++b) {   // keys: pitch FL_KP is not 16-byte aligned; via registers
    const int e = threadIdx.x + b * FL_THREADS;
    if (e < old * (FL_HD / 4)) {
      const int j = e / (FL_HD / 4), q4 = e % (FL_HD / 4);
      kreg[b] = __ldg(reinterpret_cast<const float4*>(
          k_cache + ((long long)(k0 + j) * FL_NKV + c) * FL_HD + 4 * q4));
    }
  }
  // q/k/v: warp w < FL_QKV_UNITS takes the group's local rows 2u, 2u + 1, u = rank * 12 + w
  auto qkv_row = [&](int lr) {
    return lr < FL_G * FL_HD ? c * FL_G * FL_HD + lr
         : lr < (FL_G + 1) * FL_HD ? FL_NH * FL_HD + c * FL_HD + (lr - FL_G * FL_HD)
                                   : (FL_NH + FL_NKV) * FL_HD + c * FL_HD + (lr - (FL_G + 1) * FL_HD);
  };
  uint4 wq[2][2];
  float sq[2][2], oq[2][2];
  int qr[2] = {0, 0};
  if (warp < FL_QKV_UNITS) {
    const int u = rank * FL_QKV_UNITS + warp;
    qr[0] = qkv_row(2 * u);
    qr[1] = qkv_row(2 * u + 1);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int k = 0; k < 2; ++k) {   // chunks lane, lane + 32 of 64
        const int ch = lane + k * WARP;
        wq[r][k] = load_q(qkv_codes + qr[r] * row_bytes, ch);
        sq[r][k] = load_sc(qkv_scales + qr[r] * groups + ch);
        oq[r][k] = load_sc(qkv_offsets + qr[r] * groups + ch);
      }
  }
  // o: lane = (unit of four, chunk of eight): rows or0, or0 + 1, the group's chunk 8c + ch
  const int ounit = lane / 8, och = lane % 8;
  const int or0 = rank * FL_OROWS + warp * 8 + 2 * ounit;
  uint4 wo[2];
  float so[2], oo[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    wo[r] = load_q(o_codes + (or0 + r) * row_bytes, 8 * c + och);
    so[r] = load_sc(o_scales + (or0 + r) * groups + 8 * c + och);
    oo[r] = load_sc(o_offsets + (or0 + r) * groups + 8 * c + och);
  }
  pdl_wait_then_release();   // x comes from the previous kernel
  FL_MARK(1);

  // ---- x * norm_w staged, its 16-column sums, 1 / rms ----
  asm volatile("cp.async.wait_group 1;" ::: "memory");   // this thread's norm weights
  float ss = 0.f;
  for (int s = threadIdx.x; s < FL_HID / QSUB; s += FL_THREADS) {
    float4 v[QSUB / 4];
#pragma unroll
    for (int j = 0; j < QSUB / 4; ++j) v[j] = ld_cg4(reinterpret_cast<const float4*>(x + s * QSUB) + j);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < QSUB / 4; ++j) {
      ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
      const float4 w = *reinterpret_cast<const float4*>(nws + s * QSUB + 4 * j);
      v[j] = make_float4(v[j].x * w.x, v[j].y * w.y, v[j].z * w.z, v[j].w * w.w);
      sum += v[j].x + v[j].y + v[j].z + v[j].w;
      xs4[xs_slot(s * (QSUB / 4) + j)] = v[j];
    }
    xsum[s] = sum;
  }
  const float inv_rms = 1.f / sqrtf(block_sum(ss, scratch) / FL_HID + eps);   // publishes xs4
  FL_MARK(2);
  if (warp < FL_QKV_UNITS) {
    float a[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int ch = lane + k * WARP;
      const float sx = xsum[2 * ch] + xsum[2 * ch + 1];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        a[r] = fmaf(oq[r][k], sx, fmaf(sq[r][k], fl_chunk_dot(wq[r][k], xs4, ch), a[r]));
      }
    }
    a[0] = warp_sum(a[0]);
    a[1] = warp_sum(a[1]);
    if (lane == 0) {
      mine[2 * warp] = a[0] * inv_rms;
      mine[2 * warp + 1] = a[1] * inv_rms;
    }
  }
  fl_cluster_sync();   // (1) every block's q/k/v rows are in its `mine`
  FL_MARK(3);

  // ---- the group's q, k, v; RoPE; the position's key and value to the cache ----
  if (threadIdx.x < FL_ROWS) {
    const int src = threadIdx.x / (2 * FL_QKV_UNITS), idx = threadIdx.x % (2 * FL_QKV_UNITS);
    qkv[threadIdx.x] = fl_remote(mine + idx, src);
  }
  __syncthreads();
  float rot = 0.f;
  const int rh = threadIdx.x / FL_HD, ri = threadIdx.x % FL_HD;   // head rh < FL_G: q, FL_G: k
  if (rh <= FL_G) {
    const float* hv = qkv + rh * FL_HD;
    const int i = ri % (FL_HD / 2);
    const float cs = rope_cs[2 * i], sn = rope_cs[2 * i + 1];
    rot = ri < FL_HD / 2 ? hv[ri] * cs - hv[ri + FL_HD / 2] * sn
                         : hv[ri] * cs + hv[ri - FL_HD / 2] * sn;
  }
  // keys from registers into shared memory (pitch FL_KP), the values' copies complete
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int e = threadIdx.x + b * FL_THREADS;
    if (e < old * (FL_HD / 4)) {
      float* kr = ks + (e / (FL_HD / 4)) * FL_KP + 4 * (e % (FL_HD / 4));
      kr[0] = kreg[b].x; kr[1] = kreg[b].y; kr[2] = kreg[b].z; kr[3] = kreg[b].w;
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();   // everyone has read qkv before it is rotated in place
  if (rh <= FL_G) qkv[threadIdx.x] = rot;
  __syncthreads();
  if (pos >= k0 && pos < k0 + cnt && threadIdx.x < 2 * FL_HD) {   // the position's key, value
    const int j = pos - k0, i = threadIdx.x % FL_HD, kv = threadIdx.x / FL_HD;
    const float v = qkv[(FL_G + kv) * FL_HD + i];
    const long long dst = ((long long)pos * FL_NKV + c) * FL_HD + i;
    if (kv == 0) {
      ks[j * FL_KP + i] = v;
      k_cache[dst] = v;
    } else {
      vs[j * FL_HD + i] = v;
      v_cache[dst] = v;
    }
  }
  __syncthreads();

  // ---- scores of this block's tokens, its split's max, sum and weighted values ----
  FL_MARK(4);
  for (int it = threadIdx.x; it < FL_G * cnt; it += FL_THREADS) {
    const int hh = it / cnt, j = it % cnt;
    const float* kr = ks + j * FL_KP;
    const float* qh = qkv + hh * FL_HD;
    float acc = 0.f;
#pragma unroll 8
    for (int i = 0; i < FL_HD; ++i) acc = fmaf(kr[i], qh[i], acc);
    const float sc = acc * scale;
    p[hh][j] = sc;
    scores[(long long)(c * FL_G + hh) * cap + k0 + j] = sc;
  }
  __syncthreads();
  if (warp < FL_G) {
    float m = NEG_INF;
    for (int j = lane; j < cnt; j += WARP) m = fmaxf(m, p[warp][j]);
    m = warp_max(m);
    float l = 0.f;
    for (int j = lane; j < cnt; j += WARP) {
      const float e = expf(p[warp][j] - m);
      p[warp][j] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      part[warp][FL_HD] = m;
      part[warp][FL_HD + 1] = l;
    }
  }
  __syncthreads();
  if (threadIdx.x < FL_G * FL_HD) {
    const int hh = threadIdx.x / FL_HD, i = threadIdx.x % FL_HD;
    float o = 0.f;
    for (int j = 0; j < cnt; ++j) o = fmaf(p[hh][j], vs[j * FL_HD + i], o);
    part[hh][i] = o;
  }
  fl_cluster_sync();   // (2) every split's partials are in its `part`
  FL_MARK(5);

  // ---- merge the splits: the group's attention output, in xs_slot order ----
  if (threadIdx.x < FL_OCOLS) {
    const int hh = threadIdx.x / FL_HD, i = threadIdx.x % FL_HD;
    float ms[FL_CS], M = NEG_INF;
#pragma unroll
    for (int s = 0; s < FL_CS; ++s) {
      const bool has = s * tpb < visible;
      ms[s] = has ? fl_remote(&part[hh][FL_HD], s) : NEG_INF;
      M = fmaxf(M, ms[s]);
    }
    float L = 0.f, o = 0.f;
#pragma unroll
    for (int s = 0; s < FL_CS; ++s) {
      if (s * tpb < visible) {
        const float w = expf(ms[s] - M);
        L = fmaf(fl_remote(&part[hh][FL_HD + 1], s), w, L);
        o = fmaf(fl_remote(&part[hh][i], s), w, o);
      }
    }
    o /= L;
    reinterpret_cast<float*>(a4)[4 * xs_slot(threadIdx.x / 4) + threadIdx.x % 4] = o;
    const float cs = warp_sum(o);   // a warp is one 32-column chunk of the o rows' input
    if (lane == 0) asum[warp] = cs;
    if (rank == 0 && i == 0) {
      row_ml[2 * (c * FL_G + hh)] = M;
      row_ml[2 * (c * FL_G + hh) + 1] = L;
    }
  }
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");   // done reading
  FL_MARK(6);
  __syncthreads();

  // ---- o_proj rows times the group's attention output ----
  float a[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    a[r] = fmaf(oo[r], asum[och], so[r] * fl_chunk_dot(wo[r], a4, och));
  }
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) {
    a[0] += __shfl_xor_sync(FULL_MASK, a[0], o);
    a[1] += __shfl_xor_sync(FULL_MASK, a[1], o);
  }
  if (och == 0) {
    o_part[(long long)c * FL_HID + or0] = a[0];
    o_part[(long long)c * FL_HID + or0 + 1] = a[1];
  }
  FL_MARK(7);
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  FL_MARK(8);
#else
  asm volatile("trap;");   // clusters need sm_90
#endif
}
