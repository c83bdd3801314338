"""Side by side: the quantized one-token matmuls with other block sizes and K splits.

    PYTHONPATH=. python3 dev/cuda/sweep_qmatvec.py [--shapes llama-3.2-1b]
        [--formats i8/32,u4/32+offset] [--variants auto,512,256,512:1,512+QBATCH=4]

A variant T[:S][@R][+NAME=VALUE...] runs qmatmul.cu's qmatvec kernels in blocks of T threads
('auto' or 'auto/F': the backend's block size per matrix, cuda_backend.QMV_THREADS, the
smallest grid covering F of the SMs, default cuda_backend.QMV_FILL) with the backend's
split of K (cuda_backend.qmatvec_plan), or S warps a unit for every matrix (:S); @R plans
the grid as if R blocks fit an SM (fewer than fit leaves room for the next kernel's blocks to
start early); +NAME=VALUE compiles with -DNAME=VALUE (qmatmul.cu's QBATCH_I8, QBATCH_U4 or
QBATCH for both, QMV_DEEP, QMV_MIN_BLOCKS); +%NAME=N sets the constant cuda_backend.NAME to N.
Each row is one decode-graph replay (CUDA events, median of --repeats) at --context cached
tokens, with the registers of qmatvec_swiglu and its resident blocks an SM (of the first
block size).
"""

import argparse
import tempfile

import numpy as np

from devkit import time_decode_replay  # noqa: I100  (puts benchmarks/ on the path)
from bench_quant import FORMATS  # noqa: I100,I201
from bench_quant import to_format  # noqa: I100

from rt_llm_node.backends import cuda_backend
from rt_llm_node.backends import cuda_kernels
from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.backends.cuda_backend import CudaOptions
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shapes', default='llama-3.2-1b')
    parser.add_argument('--formats', default='i8/32,u4/32+offset')
    parser.add_argument('--variants', default='auto,512,256')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=100)
    args = parser.parse_args()
    from cupy_backends.cuda.api import driver
    plan, sizes = cuda_backend.qmatvec_plan, cuda_backend.QMV_THREADS
    default_fill = cuda_backend.QMV_FILL
    options = cuda_kernels.compile_options
    saved = {}
    print('| shape | format | variant | split | decode us (p90) | regs | resident |')
    print('|---|---|---|---|---|---|---|')
    for shape in args.shapes.split(','):
        for fmt in args.formats.split(','):
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = to_format(load_checkpoint(write_random_checkpoint(tmp, shape)),
                                       FORMATS[fmt][1])
            ids = np.random.default_rng(0).integers(0, checkpoint.config.vocab_size,
                                                    args.context)
            for variant in args.variants.split(','):
                geometry, *defines = variant.split('+')
                for host in [d for d in defines if d.startswith('%')]:   # cuda_backend's
                    key, _, value = host[1:].partition('=')
                    saved.setdefault(key, getattr(cuda_backend, key))
                    setattr(cuda_backend, key, type(saved[key])(int(value)))
                defines = [d for d in defines if not d.startswith('%')]
                geometry, _, cap = geometry.partition('@')
                threads, _, forced = geometry.partition(':')
                threads, _, fill = threads.partition('/')
                cuda_backend.QMV_THREADS = sizes if threads == 'auto' else (int(threads),)
                cuda_backend.QMV_FILL = float(fill or default_fill)
                cuda_kernels.compile_options = (
                    lambda *a, d=tuple(defines): options(*a) + [f'-D{x}' for x in d])

                def planned(units, chunks, n_sm, resident, threads, s=int(forced or 0),
                            cap=int(cap or 0)):
                    resident = min(resident, cap) if cap else resident
                    if not s:
                        return plan(units, chunks, n_sm, resident, threads)
                    blocks = -(-units * s // (threads // 32))
                    return min(blocks, max(1, resident) * n_sm), s
                cuda_backend.qmatvec_plan = planned
                backend = CudaBackend(checkpoint, 1088, CudaOptions('kernels'))
                backend.prefill(ids)
                times = time_decode_replay(backend, args.context, args.repeats) * 1e3
                name = 'qmatvec_swiglu_' + backend.layers[0].wgate_up.suffix
                regs = driver.funcGetAttribute(4, backend.kernels.functions[name].ptr)
                resident = {k[1]: v for k, v in backend._resident.items()
                            if k[0] == name}
                print(f'| {shape} | {fmt} | {variant} | {forced or "plan"} | '
                      f'{np.median(times):.0f} ({np.percentile(times, 90):.0f}) | {regs} | '
                      f'{resident} |', flush=True)
                del backend
                for key, value in saved.items():
                    setattr(cuda_backend, key, value)
    cuda_backend.qmatvec_plan, cuda_backend.QMV_THREADS = plan, sizes
    cuda_backend.QMV_FILL = default_fill
    cuda_kernels.compile_options = options


if __name__ == '__main__':
    main()
