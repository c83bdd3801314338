"""A steady run of decode steps for Nsight Compute to sample (nothing else on the GPU).

    ncu --clock-control none -k regex:'matmul_.*_t1|attn_decode' -s 400 -c 12 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/ncu_decode.py --shape llama-3.2-1b

Builds the backend on a random checkpoint of the shape, prefills --context tokens, then
replays --steps decode graphs (each rolled back to the same cache length).
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, args.shape))
    backend = CudaBackend(checkpoint, args.context + 64, grid_stride=args.grid_stride == 'on')
    backend.prefill(np.random.default_rng(0).integers(0, checkpoint.config.vocab_size,
                                                      args.context))
    for _ in range(args.steps):
        backend.rollback(args.context)
        backend.decode(7)
    backend.stream.synchronize()
    print(f'{args.steps} decode steps of {args.shape} at {args.context} cached tokens')


if __name__ == '__main__':
    main()
