"""The instruction cache: an instruction switched back to is a copy; bounds; the demo's goals.

    python benchmarks/bench_instruction_cache.py [--models demo,smollm2-135m]
        [--backend numpy] [--episodes 200] [--workers 2] [--soak 1000] [--write]

Three parts, each skipped when its option is 0 or empty:
- switches: per model (``bench_warm_start``'s: the shipped policy, or the SmolLM2-135M shape
  with random weights and the demo's vocabulary, at 2 Hz on numpy), the engine as configure
  builds it (``instruction_cache_entries`` 8) ticks the demo world on the wall clock while the
  instruction goes A, B, A, B, A; per placement, its time (``TickRecord.instruction_ms``) and
  how it was placed (prefilled, or restored by copy). Median of the prefills vs of the
  restores.
- demo: the shipped policy on ``--episodes`` held-out episodes (model clock) with the cache
  (a new instruction starts the cache over after the system prompt) and without it (the
  instruction appended like an observation): goals reached, tick p99.
- soak: ``--soak`` distinct instructions, one a tick, with a state_dir of 1 MiB and a cache of
  8 entries in 256 KiB, the state saved after every switch: the largest sizes seen against
  the bounds.
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
import copy
import sys
import tempfile
import time

from bench_speculative import timed_episode
from bench_warm_start import DEMO_PARAMS
from bench_warm_start import model_path
from bench_warm_start import RATES
import numpy as np

from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.replay import load_params

TEXTS = ('go to the red box', 'go to the blue ball')


def instruction_ticks(engine, texts, period, per_text=5):
    """Tick the demo world, switching the instruction through ``texts``; yield each result."""
    world = DemoWorld(3, messages=MessageFactory(ros=False))
    snapshot = {}
    for text in texts:
        for i in range(per_text):
            now = time.monotonic()
            msgs = world.observe()
            snapshot.update({t: (m, now) for t, m in msgs.items() if t != '/instruction'})
            if i == 0:
                msg = copy.copy(msgs.get('/instruction') or snapshot['/instruction'][0])
                msg.data = text
                snapshot['/instruction'] = (msg, now)
            yield engine.tick(snapshot, now, now + 10 * period)
            world.step(0.0, 0.0)


def switches(name, backend, folder):
    """Rows of placements for model ``name``: A, B, A, B, A."""
    from rt_llm_node.configure import configure_engine
    values = load_params(DEMO_PARAMS)
    rate = RATES[name] if backend == 'numpy' else 30.0
    values.update(backend=backend, model_path=model_path(name, folder), rate_hz=rate,
                  instruction_cache_entries=8)
    engine = configure_engine(values, log=lambda line: None)
    placed = [(r.record.instruction, r.record.instruction_ms)
              for r in instruction_ticks(engine, TEXTS * 2 + TEXTS[:1], 1 / rate)
              if r.record.instruction]
    prefilled = [ms for how, ms in placed if how == 'prefilled']
    restored = [ms for how, ms in placed if how == 'restored']
    first, again = np.median(prefilled), np.median(restored)
    return [name, backend, len(engine.system_ids), ' '.join(how[0] for how, _ in placed),
            f'{first:.3f}', f'{again:.3f}', f'{again / first:.3f}']


def soak(n, folder):
    """Cycle ``n`` distinct instructions; return the largest store and cache sizes seen."""
    from rt_llm_node.configure import configure_engine
    values = load_params(DEMO_PARAMS)
    values.update(backend='numpy', state_dir=f'{folder}/soak', state_max_mb=1,
                  instruction_cache_entries=8)
    engine = configure_engine(values, log=lambda line: None)
    engine.instructions.max_bytes = 256 << 10
    store, fields = engine.state
    words = ('red', 'blue', 'green', 'yellow', 'box', 'ball', 'cone', 'left', 'right', 'slow')
    texts = [' '.join(words[(i // 10 ** k) % 10] for k in range(4)) for i in range(n)]
    worst = [0, 0, 0]
    for _ in instruction_ticks(engine, texts, 1 / 30, per_text=1):
        engine.save_state(store, fields)
        worst = [max(worst[0], store.size_bytes()), max(worst[1], engine.instructions.nbytes),
                 max(worst[2], len(engine.instructions))]
    return [n, f'{worst[0]:,} of {store.max_bytes:,}',
            f'{worst[1]:,} of {engine.instructions.max_bytes:,}',
            f'{worst[2]} of {engine.instructions.max_entries}',
            engine.instructions.hits, engine.instructions.misses]


def episode(job):
    """Run one held-out demo episode with (``entries``) or without an instruction cache."""
    seed, entries = job
    result, times = timed_episode(seed, instruction_cache=entries)
    return {'goals': sum(r == 'reached' for r in result['results']),
            'refusals': result['refusals'], 'ticks': result['ticks'], 'times': times}


def demo(episodes, workers):
    """Rows: the demo's goals without and with the instruction cache."""
    seeds = range(HELD_OUT_SEED0, HELD_OUT_SEED0 + episodes)
    rows = []
    with ProcessPoolExecutor(workers) as pool:
        for entries in (0, 8):
            runs = list(pool.map(episode, [(s, entries) for s in seeds]))
            times = np.concatenate([r['times'] for r in runs])
            rows.append([entries, episodes, sum(r['ticks'] for r in runs),
                         sum(r['refusals'] for r in runs),
                         f"{sum(r['goals'] for r in runs)} of {3 * episodes}",
                         f'{np.median(times):.2f}', f'{np.percentile(times, 99):.2f}'])
            print(f'instruction cache {entries}: done', file=sys.stderr, flush=True)
    return rows, seeds


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_instruction_cache.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--models', default='demo,smollm2-135m')
    parser.add_argument('--backend', default='numpy', choices=('numpy', 'cuda'))
    parser.add_argument('--episodes', type=int, default=200)
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--soak', type=int, default=1000)
    parser.add_argument('--write', action='store_true',
                        help='write the sections into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    where = 'numpy, CPU' if args.backend == 'numpy' else 'CUDA'
    suffix = '' if args.backend == 'numpy' else '_cuda'
    if args.models:
        header = ['model', 'backend', 'system prompt tokens', 'placements (p: prefilled, '
                  'r: restored)', 'prefill ms (median)', 'restore ms (median)',
                  'restore / prefill']
        with tempfile.TemporaryDirectory() as tmp:
            rows = [switches(name, args.backend, tmp) for name in args.models.split(',')]
        print_table(header, rows)
        if args.write:
            write_section('instruction_switch' + suffix,
                          f'Instruction switches A, B, A, B, A ({where})',
                          markdown_table(header, rows) + '\n\nEach placement of a new '
                          'instruction after the system prompt, timed by the engine '
                          '(`TickRecord.instruction_ms`, wall clock): a prefill of the '
                          'instruction alone the first time, a copy of its kept KV state '
                          'after that.')
    if args.episodes:
        rows, seeds = demo(args.episodes, args.workers)
        header = ['instruction cache entries', 'episodes', 'ticks', 'refusals',
                  'goals reached', 'tick ms (median)', 'tick p99']
        print_table(header, rows)
        if args.write:
            write_section('instruction_demo', 'The demo with and without the instruction cache'
                          ' (numpy, CPU)', markdown_table(header, rows)
                          + f'\n\nSeeds {seeds[0]}..{seeds[-1]} (held out), the shipped '
                          'policy, `meaning` eviction at 256 tokens, model clock; 0: the '
                          'instruction appended like an observation; 8: a new instruction '
                          'starts the cache over after the system prompt. Tick ms: wall '
                          f'time of `TickEngine.tick`, {args.workers} episodes at a time.')
    if args.soak:
        with tempfile.TemporaryDirectory() as tmp:
            row = soak(args.soak, tmp)
        header = ['distinct instructions', 'state_dir bytes (largest of bound)',
                  'cache bytes (largest of bound)', 'cache entries (most of bound)',
                  'cache hits', 'misses']
        print_table(header, [row])
        if args.write:
            write_section('instruction_soak', 'Instruction soak: bounded store and cache '
                          '(numpy, CPU)', markdown_table(header, [row]) + '\n\nThe shipped '
                          'policy, one new instruction a tick, the state saved after each.')
    return 0


if __name__ == '__main__':
    sys.exit(main())
