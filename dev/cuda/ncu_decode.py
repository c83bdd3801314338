r"""A steady run of decode steps for Nsight Compute to sample (nothing else on the GPU).

    ncu --clock-control none -k regex:'matmul_.*_t1|attn_decode' -s 400 -c 12 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 dev/cuda/ncu_decode.py --shape llama-3.2-1b

Builds the backend on a random checkpoint of the shape, prefills --context tokens, then
replays --steps decode graphs (each rolled back to the same cache length). With --prefill N,
--steps prefills of N tokens instead (rolled back likewise), for the prefill kernels:

    ncu --clock-control none -k regex:'matmul_.*_t16|attn_partial' -s 40 -c 12 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 dev/cuda/ncu_decode.py --prefill 48

(the prefill kernels are latency-bound at 0.04-0.13 TB/s: docs/architecture.md).
"""

import argparse
import tempfile

import numpy as np

from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.backends.cuda_backend import CudaOptions
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shape', default='smollm2-135m')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--decode-step', default='kernels', choices=('kernels', 'persistent'))
    parser.add_argument('--prefill', type=int, default=0, metavar='N',
                        help='run prefills of N tokens instead of decode steps')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, args.shape))
    backend = CudaBackend(checkpoint, args.context + max(64, args.prefill),
                          CudaOptions(decode_step=args.decode_step))
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
