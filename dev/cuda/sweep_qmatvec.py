"""Side by side: the quantized one-token matmuls with other block sizes and K splits.

    PYTHONPATH=. python3 dev/cuda/sweep_qmatvec.py [--shapes llama-3.2-1b]
        [--formats i8/32,u4/32+offset] [--variants 512,256,512:1]

A variant T runs qmatmul.cu's qmatvec kernels in blocks of T threads with the backend's split
of K (cuda_backend.qmatvec_plan); T:S with S warps a unit for every matrix; each
row is one decode-graph replay (CUDA events, median of --repeats) at --context cached
tokens, with the registers of qmatvec_swiglu and its resident blocks an SM.
"""

import argparse
import tempfile

import numpy as np

from devkit import time_decode_replay  # noqa: I100  (puts benchmarks/ on the path)
from bench_quant import FORMATS  # noqa: I100,I201
from bench_quant import to_format  # noqa: I100

from rt_llm_node.backends import cuda_backend
from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.backends.cuda_backend import CudaOptions
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shapes', default='llama-3.2-1b')
    parser.add_argument('--formats', default='i8/32,u4/32+offset')
    parser.add_argument('--variants', default='512,256,512:1')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=100)
    args = parser.parse_args()
    from cupy_backends.cuda.api import driver
    plan = cuda_backend.qmatvec_plan
    print('| shape | format | threads | split | decode us (p90) | regs | resident |')
    print('|---|---|---|---|---|---|---|')
    for shape in args.shapes.split(','):
        for fmt in args.formats.split(','):
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = to_format(load_checkpoint(write_random_checkpoint(tmp, shape)),
                                       FORMATS[fmt][1])
            ids = np.random.default_rng(0).integers(0, checkpoint.config.vocab_size,
                                                    args.context)
            for variant in args.variants.split(','):
                threads, _, forced = variant.partition(':')
                cuda_backend.QMV_THREADS = int(threads)
                if forced:
                    def fixed(units, chunks, n_sm, resident, threads, s=int(forced)):
                        blocks = -(-units * s // (threads // 32))
                        return min(blocks, max(1, resident) * n_sm), s
                    cuda_backend.qmatvec_plan = fixed
                else:
                    cuda_backend.qmatvec_plan = plan
                backend = CudaBackend(checkpoint, 1088, CudaOptions('kernels'))
                backend.prefill(ids)
                times = time_decode_replay(backend, args.context, args.repeats) * 1e3
                name = 'qmatvec_swiglu_' + FORMATS[fmt][1][0]
                regs = driver.funcGetAttribute(4, backend.kernels.functions[name].ptr)
                resident = {k[1]: v for k, v in backend._resident.items()
                            if k[0] == name}
                print(f'| {shape} | {fmt} | {threads} | {forced or "plan"} | '
                      f'{np.median(times):.0f} ({np.percentile(times, 90):.0f}) | {regs} | '
                      f'{resident} |', flush=True)
                del backend
    cuda_backend.qmatvec_plan = plan


if __name__ == '__main__':
    main()
