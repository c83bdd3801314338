"""Side by side: the one-token matmuls compiled with other register budgets and load batches.

    PYTHONPATH=. python3 dev/cuda/sweep_matvec.py [--shapes ...] [--variants 8:1,8:4,4:1,4:6]

A variant B:M compiles the kernels with MV_BATCH B (8-weight chunks a lane loads at once)
and MV_MIN_BLOCKS M (launch bounds: M blocks of 128 threads an SM, so at most
65536 / (128 M) registers a thread), then times one decode-graph replay (CUDA events,
median of --repeats) at --context cached tokens, with each variant's registers, local
memory (spills) and resident blocks of matmul_swiglu_t1.
"""

import argparse
import tempfile

import numpy as np

from devkit import time_decode_replay  # noqa: I100
from rt_llm_node.backends import cuda_kernels
from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.backends.cuda_backend import CudaOptions
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shapes', default='smollm2-135m,qwen2.5-0.5b,llama-3.2-1b')
    parser.add_argument('--variants', default='8:1,8:4,4:1,4:6')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=100)
    parser.add_argument('--baseline', help='a folder of other kernel sources, timed first '
                        'as variant 8:1')
    args = parser.parse_args()
    import os
    from cupy_backends.cuda.api import driver
    variants = [tuple(int(v) for v in item.split(':')) for item in args.variants.split(',')]
    rows = []
    for shape in args.shapes.split(','):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape))
        dtype = next(iter(checkpoint.tensors.values())).dtype
        ids = np.random.default_rng(0).integers(0, checkpoint.config.vocab_size, args.context)
        runs = [(8, 1, args.baseline)] if args.baseline else []
        runs += [(b, m, None) for b, m in variants]
        for batch, min_blocks, folder in runs:
            cuda_kernels.MV_BATCH[dtype] = batch
            cuda_kernels.MV_MIN_BLOCKS = min_blocks
            os.environ.pop('RT_LLM_CUDA_DIR', None)
            if folder:
                os.environ['RT_LLM_CUDA_DIR'] = folder
            backend = CudaBackend(checkpoint, args.context + 64, CudaOptions('kernels'))
            backend.prefill(ids)
            times = time_decode_replay(backend, args.context, args.repeats) * 1e3
            med, p99 = float(np.median(times)), float(np.percentile(times, 99))
            fn = backend.kernels.functions['matmul_swiglu_t1'].ptr
            regs = driver.funcGetAttribute(4, fn)    # CU_FUNC_ATTRIBUTE_NUM_REGS
            local = driver.funcGetAttribute(3, fn)   # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
            rows.append((shape + (' (baseline)' if folder else ''), batch, min_blocks, regs, local,
                         backend._resident_blocks('matmul_swiglu_t1'), med, p99))
            print('%-14s batch %d min blocks %d: %3d regs, %4d B local, %d resident: '
                  '%.1f us (p99 %.1f)' % rows[-1], flush=True)
            del backend


if __name__ == '__main__':
    main()
