"""A steady run of decode steps for Nsight Compute to sample (nothing else on the GPU).

    ncu --clock-control none -k regex:'matmul_.*_t1|attn_decode' -s 400 -c 12 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/ncu_decode.py --shape llama-3.2-1b

Builds the backend on a random checkpoint of the shape, prefills --context tokens, then
replays --steps decode graphs (each rolled back to the same cache length). With --prefill N,
--steps prefills of N tokens instead (rolled back likewise), for the prefill kernels:

    ncu --clock-control none -k regex:'matmul_.*_(t16|mma)|attn_partial' -s 40 -c 12 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 tools/ncu_decode.py --prefill 48 [--prefill-mma]

(the prefill kernels are latency-bound at 0.04-0.13 TB/s: BENCHMARKS.md, stop 20).
"""

import argparse
import tempfile

import numpy as np

from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shape', default='smollm2-135m')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--grid-stride', default='on', choices=('on', 'off'))
    parser.add_argument('--prefill', type=int, default=0, metavar='N',
                        help='run prefills of N tokens instead of decode steps')
    parser.add_argument('--prefill-mma', action='store_true',
                        help='the tensor-core prefill kernels (bf16 weights)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, args.shape))
    backend = CudaBackend(checkpoint, args.context + max(64, args.prefill),
                          grid_stride=args.grid_stride == 'on', prefill_mma=args.prefill_mma)
    rng = np.random.default_rng(0)
    backend.prefill(rng.integers(0, checkpoint.config.vocab_size, args.context))
    tokens = rng.integers(0, checkpoint.config.vocab_size, max(1, args.prefill))
    for _ in range(args.steps):
        backend.rollback(args.context)
        if args.prefill:
            backend.prefill(tokens)
        else:
            backend.decode(7)
    backend.stream.synchronize()
    what = f'prefills of {args.prefill} tokens' if args.prefill else 'decode steps'
    print(f'{args.steps} {what} of {args.shape} at {args.context} cached tokens')


if __name__ == '__main__':
    main()
