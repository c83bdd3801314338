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


def demo_tick_latency(ticks=900, capacity=256):
    """Whole-tick latency of the shipped model in the engine (numpy, wall clock, always admit)."""
    from rt_llm_node.admission import Admission
    from rt_llm_node.admission import CostModel
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.demo.task import INPUTS
    from rt_llm_node.demo.task import SYSTEM_PROMPT
    from rt_llm_node.demo.world import DemoWorld
    from rt_llm_node.engine import TickEngine
    from rt_llm_node.model.embedded import default_model_path
    checkpoint = load_checkpoint(default_model_path())
    engine = TickEngine(NumpyBackend(checkpoint, capacity), checkpoint.tokenizer, INPUTS,
                        action_grammar(checkpoint.tokenizer), Admission(CostModel(), 0.0),
                        policy='meaning', system_prompt=SYSTEM_PROMPT)
    engine.start()
    world = DemoWorld(1_000_000, messages=MessageFactory(ros=False))
    snap, times = {}, []
    for _ in range(ticks):
        now = time.monotonic()
        snap.update({t: (m, now) for t, m in world.observe().items()})
        t0 = time.perf_counter()
        result = engine.tick(snap, now, now + 1.0)
        times.append((time.perf_counter() - t0) * 1e3)
        values = result.action.values
        world.step(values['linear.x'], values['angular.z'])
        if world.done:
            world = DemoWorld(world.seed + 1, messages=MessageFactory(ros=False))
    times = np.array(times[30:])
    return [f'shipped demo model, meaning@{capacity}', len(times),
            f'{np.median(times):.2f}', f'{np.percentile(times, 99):.2f}',
            f'{times.max():.2f}']


def main_tick():
    header = ['engine tick', 'ticks', 'median ms', 'p99 ms', 'max ms']
    rows = [demo_tick_latency()]
    print_table(header, rows)
    return header, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--write', action='store_true', help='record in BENCHMARKS.md')
    args = parser.parse_args()
    header = ['shape', 'params', 'cached tokens', 'decode ms/token (median)', 'decode p99 ms',
              'prefill 48 tokens ms']
    parser_rows = [measure('tiny', 500), measure('smollm2-135m', 30)]
    print_table(header, parser_rows)
    tick_header, tick_rows = main_tick()
    if args.write:
        write_section('numpy', 'numpy backend (CPU), random weights, fp32 math',
                      markdown_table(header, parser_rows))
        write_section('numpy_tick', 'Whole engine tick, shipped demo model, numpy on 2 CPU cores '
                      '(target: p99 under 33 ms)', markdown_table(tick_header, tick_rows)
                      + '\n\nIn-process (no ROS), every tick admitted; '
                      'render + evict + prefill + constrained decode.')


if __name__ == '__main__':
    main()
