"""One layer's q/k/v, attention and o projection as one cluster kernel: correct, and how fast.

    PYTHONPATH=. python3 dev/cuda/probe_fused_layer.py [--positions 256,600] [--chain 32]

probe_fused_layer.cu's kernel (Llama-3.2-1B shape, u4/32 weights with fp16 scales and
offsets, fp32 cache) against a float64 numpy reference of the same quantized layer, then
the GPU time of one launch in a chain of launches captured in a graph under programmatic
dependent launch (as the decode step's kernels run). The node's decode step runs the same
work as three kernels (`qmatvec_qkv_rope_u4h`, `attn_decode`, `qmatvec_residual_u4h`);
`dev/cuda/profile_cuda.py --shape llama-3.2-1b --format u4/32+offset` times each of those
the same way, for the comparison. Needs sm_90 (thread-block clusters of 16).
"""

import argparse
import ctypes
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from devkit import CLUSTER_DIMENSION  # noqa: E402
from devkit import HERE  # noqa: E402
from devkit import NON_PORTABLE_CLUSTER_SIZE_ALLOWED  # noqa: E402
from devkit import ROOT  # noqa: E402

HID, NH, NKV, HD, CS = 2048, 32, 8, 64, 16
G = NH // NKV
MARKS = 10   # FL_MARKS: the kernel's trace slots a block
PHASES = ('loads, wait', 'x staged', 'q/k/v, cluster barrier', 'RoPE, position',
          'attention, cluster barrier', 'merge', 'o rows', 'exit barrier')
EPS, THETA = 1e-5, 500000.0


class ClusterDependentLauncher:
    """cuLaunchKernelEx with a cluster dimension and programmatic dependent launch."""

    def __init__(self, size):
        from rt_llm_node.backends.cuda_kernels import _launch_structs
        from rt_llm_node.backends.cuda_kernels import PROGRAMMATIC_STREAM_SERIALIZATION
        attribute, self._config = _launch_structs()
        self._attrs = (attribute * 2)()
        self._attrs[0].id = CLUSTER_DIMENSION
        dims = (ctypes.c_uint * 3)(size, 1, 1)
        ctypes.memmove(ctypes.addressof(self._attrs[0].value), dims, ctypes.sizeof(dims))
        self._attrs[1].id = PROGRAMMATIC_STREAM_SERIALIZATION
        self._attrs[1].value.i = 1
        self._launch = ctypes.CDLL('libcuda.so.1').cuLaunchKernelEx
        self._launch.restype = ctypes.c_int

    def max_active_clusters(self, function, grid, block):
        """cuOccupancyMaxActiveClusters: clusters of this launch the device holds at once."""
        config = self._config((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(block, 1, 1),
                              0, None, self._attrs, 1)
        n = ctypes.c_int(0)
        query = ctypes.CDLL('libcuda.so.1').cuOccupancyMaxActiveClusters
        status = query(ctypes.byref(n), ctypes.c_void_p(function.ptr), ctypes.byref(config))
        return n.value if status == 0 else f'error {status}'

    def __call__(self, function, grid, block, args, stream):
        from rt_llm_node.backends.cuda_kernels import _kernel_argument
        values = [_kernel_argument(a) for a in args]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        config = self._config((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(block, 1, 1),
                              0, ctypes.c_void_p(stream.ptr), self._attrs, 2)
        status = self._launch(ctypes.byref(config), ctypes.c_void_p(function.ptr), params, None)
        if status:
            from cupy_backends.cuda.api.driver import CUDADriverError
            raise CUDADriverError(status)


def quantized(rng, rows):
    """u4/32 codes [rows, HID / 2] (even column in the low nibble), fp16 scales and offsets."""
    codes = rng.integers(0, 256, (rows, HID // 2), dtype=np.uint8)
    scales = (0.02 * rng.uniform(0.5, 1.5, (rows, HID // 32))).astype(np.float16)
    offsets = (-8 * scales.astype(np.float32) * rng.uniform(0.9, 1.1, scales.shape)).astype(
        np.float16)
    return codes, scales, offsets


def dequantize(codes, scales, offsets):
    q = np.empty((codes.shape[0], HID), np.float64)
    q[:, 0::2], q[:, 1::2] = codes & 15, codes >> 4
    s = np.repeat(scales.astype(np.float64), 32, axis=1)
    o = np.repeat(offsets.astype(np.float64), 32, axis=1)
    return q * s + o


def rope(v, cs):
    half = HD // 2
    c, s = cs[:, 0].astype(np.float64), cs[:, 1].astype(np.float64)
    return np.concatenate([v[..., :half] * c - v[..., half:] * s,
                           v[..., half:] * c + v[..., :half] * s], axis=-1)


def reference(x, norm_w, wqkv, wo, k_cache, v_cache, pos, cs):
    xn = x.astype(np.float64) * norm_w / np.sqrt(np.mean(x.astype(np.float64) ** 2) + EPS)
    qkv = wqkv @ xn
    q = rope(qkv[:NH * HD].reshape(NH, HD), cs)
    k = rope(qkv[NH * HD:(NH + NKV) * HD].reshape(NKV, HD), cs)
    v = qkv[(NH + NKV) * HD:].reshape(NKV, HD)
    keys = k_cache[:pos + 1].astype(np.float64)
    vals = v_cache[:pos + 1].astype(np.float64)
    keys[pos], vals[pos] = k, v
    scores = np.einsum('hd,thd->ht', q, keys[:, np.arange(NH) // G]) / np.sqrt(HD)
    m = scores.max(axis=1, keepdims=True)
    e = np.exp(scores - m)
    att = np.einsum('ht,thd->hd', e / e.sum(axis=1, keepdims=True), vals[:, np.arange(NH) // G])
    o_part = np.stack([wo[:, c * G * HD:(c + 1) * G * HD] @ att[c * G:(c + 1) * G].ravel()
                       for c in range(NKV)])
    return o_part, k, v, scores, m[:, 0], e.sum(axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--positions', default='256,600')
    parser.add_argument('--chain', type=int, default=32)
    parser.add_argument('--repeats', type=int, default=50)
    args = parser.parse_args()
    import cupy as cp
    from cupy_backends.cuda.api import driver
    from rt_llm_node.backends.cuda_kernels import KernelSet
    files = [ROOT / 'cuda' / 'qmatmul.cu', HERE / 'probe_fused_layer.cu']
    kernels = KernelSet('BF16', files=files, names=('fused_qkv_attn_o_probe',))
    fn = kernels.functions['fused_qkv_attn_o_probe']
    driver.funcSetAttribute(fn.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    launch = ClusterDependentLauncher(CS)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(HID).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(HID)).astype(np.float32)
    qkv_q, o_q = quantized(rng, (NH + 2 * NKV) * HD), quantized(rng, HID)
    wqkv, wo = dequantize(*qkv_q), dequantize(*o_q)
    dev = [cp.asarray(a) for a in (x, norm_w)]
    qkv_d = [cp.asarray(a if a.dtype != np.float16 else a.view(np.uint16)) for a in qkv_q]
    o_d = [cp.asarray(a if a.dtype != np.float16 else a.view(np.uint16)) for a in o_q]
    print(f'{cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}; Llama-3.2-1B layer, '
          f'u4/32 fp16 scales, one cluster of {CS} blocks a KV head; the device holds '
          f'{launch.max_active_clusters(fn, NKV * CS, 512)} such clusters at once')
    for pos in [int(p) for p in args.positions.split(',') if p]:
        cap = pos + 1
        if (cap + CS - 1) // CS > 40:
            raise SystemExit(f'position {pos}: more than 40 tokens a block (FL_TMAX)')
        k_cache = rng.standard_normal((cap, NKV, HD)).astype(np.float32)
        v_cache = rng.standard_normal((cap, NKV, HD)).astype(np.float32)
        inv_freq = THETA ** (-np.arange(0, HD, 2) / HD)
        cs = np.stack([np.cos(pos * inv_freq), np.sin(pos * inv_freq)], axis=1).astype(np.float32)
        kc, vc, cs_d = cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(cs)
        scores = cp.zeros((NH, cap), np.float32)
        row_ml, o_part = cp.zeros((NH, 2), np.float32), cp.zeros((NKV, HID), np.float32)
        trace = cp.zeros((NKV * CS, MARKS), np.uint64)
        call = (dev[0], dev[1], np.float32(EPS), *qkv_d, *o_d, cs_d, kc, vc, np.int32(pos),
                np.int32(cap), np.float32(1 / np.sqrt(HD)), scores, row_ml, o_part, trace)
        launch(fn, NKV * CS, 512, call, stream)
        stream.synchronize()
        ref_o, ref_k, ref_v, ref_s, ref_m, ref_l = reference(x, norm_w, wqkv, wo, k_cache, v_cache,
                                                             pos, cs)
        errors = {
            'o_part': np.abs(o_part.get() - ref_o).max() / np.abs(ref_o).max(),
            'key': np.abs(kc.get()[pos] - ref_k).max() / np.abs(ref_k).max(),
            'value': np.abs(vc.get()[pos] - ref_v).max() / np.abs(ref_v).max(),
            'scores': np.abs(scores.get() - ref_s).max() / np.abs(ref_s).max(),
            'max': np.abs(row_ml.get()[:, 0] - ref_m).max() / np.abs(ref_m).max(),
            'sum': np.abs(row_ml.get()[:, 1] / ref_l - 1).max(),
        }
        bad = {k: v for k, v in errors.items() if not v < 2e-4}
        print(f'position {pos}: largest relative error ' +
              ', '.join(f'{k} {v:.1e}' for k, v in errors.items()))
        if bad:
            raise SystemExit(f'position {pos}: off from the reference: {bad}')
        with stream:
            stream.begin_capture()
            for _ in range(args.chain):
                launch(fn, NKV * CS, 512, call, stream)
            graph = stream.end_capture()
        graph.upload(stream)
        start, stop, times = cp.cuda.Event(), cp.cuda.Event(), []
        for _ in range(args.repeats):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / args.chain)
        # the chain's last launch, traced: when each block passed each mark
        t = trace.get().astype(np.int64)
        t = t[:, :9] - t[:, 0].min()
        steps = np.diff(t, axis=1)
        print(f'position {pos}, last launch of a chain: blocks started over '
              f'{(t[:, 0].max()) / 1e3:.2f} us, ended {t[:, 8].max() / 1e3:.2f} us after the '
              'first started; per phase, median (max) over blocks, us: ' + ', '.join(
                  f'{name} {np.median(steps[:, i]) / 1e3:.2f} ({steps[:, i].max() / 1e3:.2f})'
                  for i, name in enumerate(PHASES)))
        mb = sum(a.nbytes for a in (*qkv_q, *o_q)) / 1e6
        print(f'position {pos}: fused q/k/v + attention + o {np.median(times):.2f} us a launch '
              f'(median of {args.repeats} chains of {args.chain}), weights {mb:.2f} MB')


if __name__ == '__main__':
    main()
