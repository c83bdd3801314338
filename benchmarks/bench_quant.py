"""Quantized weights on the CUDA backend: decode time, bytes per token, the bandwidth floor.

In one run on one GPU: the measured read bandwidth, then per model shape (random weights)
and runtime weight format, side by side: bytes a decode step reads, the floor (those bytes /
bandwidth), our decode step at 256 cached tokens (GPU time of the graph replay, median and
p99), the fraction of the floor reached, a 48-token prefill, and what the same bytes would
take on a Jetson Orin Nano Super (102 GB/s read, at the floor).

    PYTHONPATH=. python3 benchmarks/bench_quant.py [--write] [--shapes smollm2-135m,...]

Runtime formats, and the GGUF types that convert into each exactly: bf16 (BF16); i8/32
with fp16-exact scales (Q8_0; weight_format int8); i8/32 with fp32 scales and offsets (Q5_K);
i8/16 with fp32 scales (Q6_K); u4/32 with fp16-exact scales and offsets (Q4_0, Q4_1;
weight_format int4); u4/32 with fp32 ones (Q4_K, whose scales are products of an fp16 and a
6-bit integer); fp16-exact scales are stored in fp16 on an integrated GPU only. The matrices
are quantized from the same random bf16 weights, round to nearest, their scales made
fp32-only where the GGUF type's are (what converts from a GGUF runs the same kernels).
"""

import argparse
import gc
import shlex
import sys
import tempfile

import numpy as np

from bench_cuda import bandwidth_kernels
from bench_cuda import gpu_machine
from bench_cuda import gpu_name
from bench_cuda import measure_ours
from bench_cuda import read_bandwidth
from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.quant import quantize
from rt_llm_node.model.quant import QuantTensor
from rt_llm_node.model.synthetic import write_random_checkpoint

SHAPES = ('smollm2-135m', 'qwen2.5-0.5b', 'llama-3.2-1b')
# name: (GGUF types, (runtime format, group, offsets, fp32 scales)); fp16 scales otherwise
FORMATS = {
    'bf16': ('BF16', None),
    'i8/32': ('Q8_0, int8', ('i8', 32, False, False)),
    'i8/32+offset': ('Q5_K', ('i8', 32, True, True)),
    'i8/16': ('Q6_K', ('i8', 16, False, True)),
    'u4/32+offset': ('Q4_0, Q4_1, int4', ('u4', 32, True, False)),
    'u4/32+offset/f32': ('Q4_K', ('u4', 32, True, True)),
}
KV_DTYPES = ('native', 'int8')
JETSON_BANDWIDTH = 102e9   # Orin Nano Super, bytes a second


def to_format(checkpoint, spec):
    """Quantize every float matrix of ``checkpoint`` into the runtime format ``spec``."""
    if spec is None:
        return checkpoint
    fmt, group, offsets, wide = spec
    for name, tensor in list(checkpoint.tensors.items()):
        if len(tensor.shape) != 2:
            continue
        q = quantize(tensor.to_float32(), fmt, group)   # fp16 scales and offsets
        scales, shifts = q.scales, q.offsets
        if offsets and shifts is None:   # the Q5_K layout: an offset beside every scale
            shifts = np.zeros_like(scales)
        if wide:   # one fp32 ulp off: no longer fp16 values, so kept in fp32 as a K-quant's
            scales = np.nextafter(scales, np.float32(np.inf))
            shifts = None if shifts is None else np.nextafter(shifts, np.float32(np.inf))
        checkpoint.tensors[name] = QuantTensor(q.fmt, q.shape, q.group, q.codes, scales,
                                               shifts, q.source)
    return checkpoint


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_quant.py', description=__doc__.split('\n')[0])
    parser.add_argument('--shapes', default=','.join(SHAPES))
    parser.add_argument('--formats', default=','.join(FORMATS))
    parser.add_argument('--kv-dtypes', default='native,int8',
                        help='KV caches to run each format with')
    parser.add_argument('--repeats', type=int, default=300)
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    from rt_llm_node.backends import cuda_available
    if not cuda_available():
        print('bench_quant.py: no CUDA device (CuPy sees none)', file=sys.stderr)
        return 2
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    bandwidth = read_bandwidth(bandwidth_kernels())
    print(f'read bandwidth: {bandwidth / 1e12:.2f} TB/s')
    header = ['shape', 'format', 'GGUF types', 'scales', 'KV cache', 'KV bytes a token',
              'MB read a token', 'floor us',
              'decode us @256 (p99)', 'of the floor', 'prefill 48 ms',
              'Orin Nano Super floor ms', 'fits 30 Hz x 6 tokens']
    rows = []
    capacity = 320
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(','):
            path = write_random_checkpoint(f'{tmp}/{shape}', shape, seed=0)
            for name, kv in ((f, k) for f in args.formats.split(',')
                             for k in args.kv_dtypes.split(',')):
                types, spec = FORMATS[name]
                checkpoint = to_format(load_checkpoint(path), spec)
                backend = CudaBackend(checkpoint, capacity,
                                      CudaOptions(decode_step='auto', kv_dtype=kv))
                vocab = checkpoint.config.vocab_size
                result = measure_ours(backend, vocab, args.repeats, contexts=(256,))
                nbytes = backend.bytes_per_token()
                floor_us = nbytes / bandwidth * 1e6
                median, p99 = result[256][0], result[256][1]
                jetson_ms = backend.bytes_per_token(half_scales=True) / JETSON_BANDWIDTH * 1e3
                rows.append([shape, name, types, backend.scale_storage(), kv,
                             backend.kv_bytes_per_token(),
                             f'{nbytes / 1e6:.0f}', f'{floor_us:.0f}',
                             f'{median:.0f} ({p99:.0f})', f'{floor_us / median:.0%}',
                             f"{result['prefill']:.2f}", f'{jetson_ms:.1f}',
                             'yes' if 6 * jetson_ms < 1000 / 30 else 'no'])
                print_table(header, [rows[-1]])
                sys.stdout.flush()
                del backend, checkpoint
                gc.collect()
    print()
    print_table(header, rows)
    body = (f'{gpu_name()}, read bandwidth {bandwidth / 1e12:.2f} TB/s (measured in the same '
            'run). KV bytes a token: keys, values and their scales over every layer. '
            "Decode: GPU time of one decode step's graph replay "
            'at 256 cached tokens, median (p99). Scales: how this GPU stores the scales and '
            'offsets (fp16 ones only on an integrated GPU: cuda_backend.HALF_SCALES). MB read '
            'a token: every weight a decode step reads here (codes, scales and offsets; the '
            'embedding by one row). Of the floor: floor / measured. Orin Nano Super floor: '
            'the bytes a step reads there (fp16 scales where the GGUF type has fp16 ones) at '
            '102 GB/s, the least a token can take; fits 30 Hz x 6 tokens: six such steps within '
            '33.3 ms (prefill and host time not counted).\n\n' + markdown_table(header, rows))
    if args.write:
        write_section('quantized', f'Quantized weights (CUDA decode, {gpu_name()})', body,
                      machine=gpu_machine(),
                      command=' '.join(['PYTHONPATH=. python3 benchmarks/bench_quant.py']
                                       + [shlex.quote(a) for a in sys.argv[1:]]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
