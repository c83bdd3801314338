"""Numpy backend speed: ms per decode token and prefill, tiny and SmolLM2-135M shapes.

    python tools/bench_numpy.py [--write]
"""

import argparse
import tempfile
import time

import numpy as np

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.bench_report import markdown_table
from rt_llm_node.bench_report import print_table
from rt_llm_node.bench_report import write_section
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

CACHED = 256


def measure(shape, decode_steps):
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape))
    cfg = checkpoint.config
    backend = NumpyBackend(checkpoint, 1024)
    rng = np.random.default_rng(0)
    backend.prefill(rng.integers(0, cfg.vocab_size, CACHED))
    times = []
    token = 1
    for _ in range(decode_steps + 3):
        t0 = time.perf_counter()
        backend.decode(token)
        token = backend.argmax()
        times.append((time.perf_counter() - t0) * 1e3)
    times = np.array(times[3:])
    prefill = []
    for _ in range(5):
        backend.rollback(CACHED)
        t0 = time.perf_counter()
        backend.prefill(rng.integers(0, cfg.vocab_size, 48))
        prefill.append((time.perf_counter() - t0) * 1e3)
    return [shape, f'{cfg.n_parameters() / 1e6:.1f}M', CACHED,
            f'{np.median(times):.2f}', f'{np.percentile(times, 99):.2f}',
            f'{np.median(prefill):.1f}']


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--write', action='store_true', help='record in BENCHMARKS.md')
    args = parser.parse_args()
    header = ['shape', 'params', 'cached tokens', 'decode ms/token (median)', 'decode p99 ms',
              'prefill 48 tokens ms']
    rows = [measure('tiny', 500), measure('smollm2-135m', 30)]
    print_table(header, rows)
    if args.write:
        write_section('numpy', 'numpy backend (CPU), random weights, fp32 math',
                      markdown_table(header, rows))


if __name__ == '__main__':
    main()
