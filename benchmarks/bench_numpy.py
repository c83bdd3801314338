"""Numpy backend speed: ms per decode token and prefill, tiny and SmolLM2-135M shapes.

    python benchmarks/bench_numpy.py [--write]
    python benchmarks/bench_numpy.py --sizes [--write]

``--sizes``: the whole engine tick of demo policies of other shapes and inputs (random
weights, the shipped tokenizer, the demo world in closed loop, `meaning` at 256 tokens),
the speed a replay could reach at best: what a policy must cost for a 10x faster-than-real-time
offline replay.
"""

import argparse
import json
import os
from pathlib import Path
import tempfile
import time

# one BLAS thread, as the node has (rt_llm_node/__init__.py), set before numpy loads its BLAS:
# imported first, numpy started one a core, and the engine tick row's max went from ~8 ms to
# 22-43 ms on 2 cores
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

import numpy as np  # noqa: E402

from report import markdown_table  # noqa: E402
from report import print_table  # noqa: E402
from report import write_section  # noqa: E402
from rt_llm_node.backends.numpy_backend import NumpyBackend  # noqa: E402
from rt_llm_node.model import load_checkpoint  # noqa: E402
from rt_llm_node.model.synthetic import write_random_checkpoint  # noqa: E402

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


def engine_ticks(checkpoint, inputs, ticks=900, capacity=256, aim=False):
    """Time the engine ticks of a checkpoint driving the demo world.

    Wall-clock ms of each engine tick (numpy, always admitted) of ``checkpoint`` driving the demo
    world with ``inputs`` (``aim``: its actions state the '_aim' plan field first), the first 30
    dropped; and the mean prefill tokens a tick.
    """
    from rt_llm_node.admission import Admission
    from rt_llm_node.admission import CostModel
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.demo.task import SYSTEM_PROMPT
    from rt_llm_node.demo.world import DemoWorld
    from rt_llm_node.engine import TickEngine
    engine = TickEngine(NumpyBackend(checkpoint, capacity), checkpoint.tokenizer, inputs,
                        action_grammar(checkpoint.tokenizer, aim), Admission(CostModel(), 0.0),
                        policy='meaning', system_prompt=SYSTEM_PROMPT)
    engine.start()
    world = DemoWorld(1_000_000, messages=MessageFactory(ros=False))
    snap, times, tokens = {}, [], []
    for _ in range(ticks):
        now = time.monotonic()
        snap.update({t: (m, now) for t, m in world.observe().items()})
        t0 = time.perf_counter()
        result = engine.tick(snap, now, now + 1.0)
        times.append((time.perf_counter() - t0) * 1e3)
        tokens.append(result.record.n_prefill)
        values = result.action.values
        world.step(values['linear.x'], values['angular.z'])
        if world.done:
            world = DemoWorld(world.seed + 1, messages=MessageFactory(ros=False))
    return np.array(times[30:]), float(np.mean(tokens[30:]))


def demo_tick_latency(ticks=900, capacity=256):
    """Whole-tick latency of the shipped model in the engine (numpy, wall clock, always admit)."""
    from rt_llm_node.demo.task import model_aim
    from rt_llm_node.demo.task import model_inputs
    from rt_llm_node.model.embedded import default_model_path
    path = default_model_path()
    times, _ = engine_ticks(load_checkpoint(path), model_inputs(path), ticks, capacity,
                            model_aim(path))
    return [f'shipped demo model, meaning@{capacity}', len(times),
            f'{np.median(times):.2f}', f'{np.percentile(times, 99):.2f}',
            f'{times.max():.2f}']


# (hidden, layers, intermediate, kv heads): head_dim 32 as in the shipped policy
SIZES = [(192, 4, 512, 2), (192, 2, 512, 2), (128, 4, 384, 2), (128, 2, 384, 2),
         (96, 4, 256, 1)]


def size_rows(ticks):
    """Engine tick of each of ``SIZES`` with every demo input and without /odom."""
    from tokenizers import Tokenizer

    from rt_llm_node.demo.task import demo_inputs
    from rt_llm_node.model.config import ModelConfig
    from rt_llm_node.model.embedded import default_model_path
    from rt_llm_node.model.synthetic import random_weights
    from rt_llm_node.model.synthetic import write_checkpoint
    shipped = Path(default_model_path())
    tokenizer = Tokenizer.from_file(str(shipped / 'tokenizer.json'))
    vocab = json.loads((shipped / 'config.json').read_text())['vocab_size']
    rows = []
    for hidden, layers, inter, kv in SIZES:
        config = ModelConfig(family='llama', vocab_size=vocab, hidden_size=hidden,
                             intermediate_size=inter, num_layers=layers,
                             num_heads=hidden // 32, num_kv_heads=kv, head_dim=32,
                             max_position_embeddings=1024, rms_norm_eps=1e-5,
                             tie_word_embeddings=True)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_checkpoint(tmp, config, random_weights(config),
                                                          tokenizer))
        for topics in (None, ('/instruction', '/scan', '/detections')):
            times, tokens = engine_ticks(checkpoint, demo_inputs(topics), ticks)
            median = float(np.median(times))
            rows.append([f'{hidden}/{layers}/{inter}', f'{config.n_parameters() / 1e6:.2f}M',
                         'all' if topics is None else 'no /odom', f'{tokens:.1f}',
                         f'{median:.2f}', f'{np.percentile(times, 99):.2f}',
                         f'{1000.0 / 30.0 / median:.1f}x'])
    return rows


def main_tick():
    header = ['engine tick', 'ticks', 'median ms', 'p99 ms', 'max ms']
    rows = [demo_tick_latency()]
    print_table(header, rows)
    return header, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--write', action='store_true', help='record in benchmarks/RESULTS.md')
    parser.add_argument('--sizes', action='store_true',
                        help='engine ticks of other policy shapes and inputs (see above)')
    parser.add_argument('--ticks', type=int, default=900)
    args = parser.parse_args()
    if args.sizes:
        header = ['hidden/layers/intermediate', 'params', 'inputs', 'prefill tokens a tick',
                  'engine tick ms (median)', 'p99 ms', 'real time / engine tick']
        rows = size_rows(args.ticks)
        print_table(header, rows)
        if args.write:
            write_section('numpy_sizes', 'Engine tick by policy size and inputs (numpy, CPU)',
                          'Random weights, the shipped tokenizer, the demo world in closed '
                          'loop (seed 1000000 on), `meaning` at 256 tokens, every tick '
                          f'admitted, {args.ticks} ticks a row (the first 30 dropped), one '
                          'process, rows one after another. Last column: 33.3 ms over the '
                          "median engine tick, a ceiling on a replay's speed (bag reading, "
                          'rendering of the outputs and the summary come on top: about 0.7 '
                          'ms a tick in section "replay").\n\n' + markdown_table(header, rows))
        return
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
