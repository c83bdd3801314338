"""Speculative action decoding on the demo: forward passes per action, acceptance, same actions.

    python benchmarks/bench_speculative.py [--episodes 200] [--workers 2] [--tokens 0,4]
        [--write]

The shipped policy (numpy backend, ``meaning`` eviction at 256 tokens) on held-out episodes,
once per ``--tokens`` value (speculative_tokens; 0: plain greedy decoding), each episode in
closed loop on the model clock. Per row: forward passes an action (its prefill, decode steps
and verify passes; mean and p99), drafted tokens kept, engine tick wall time on this host
(median and p99 of ``TickEngine.tick``), goals reached, and whether every tick's action equals
the plain run's, token for token.
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
import os
import sys
import time

import numpy as np

from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.demo.evaluate import _checkpoint
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.engine import TickEngine
from rt_llm_node.model.embedded import default_model_path


def timed_episode(seed, **options):
    """Run held-out episode ``seed`` of the shipped policy (``run_model_episode`` options).

    Returns its result and the wall time of each ``TickEngine.tick`` (ms).
    """
    os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
    path = default_model_path()
    times = []
    tick = TickEngine.tick

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return tick(self, *args, **kwargs)
        finally:
            times.append((time.perf_counter() - start) * 1e3)
    TickEngine.tick = timed
    try:
        result = run_model_episode(_checkpoint(str(path)), seed, 'meaning', 256,
                                   inputs=model_inputs(path), aim=model_aim(path), **options)
    finally:
        TickEngine.tick = tick
    return result, times


def episode(job):
    """Run one episode; returns its results, passes, drafts, actions and tick wall times."""
    seed, tokens = job
    result, times = timed_episode(seed, speculative_tokens=tokens)
    return {'goals': sum(r == 'reached' for r in result['results']),
            'passes': result['passes'], 'drafted': result['drafted'],
            'accepted': result['accepted'], 'actions': result['actions'], 'times': times}


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_speculative.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--episodes', type=int, default=200)
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--tokens', default='0,4', help='speculative_tokens values; 0 first')
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    values = [int(v) for v in args.tokens.split(',')]
    if values[0] != 0:
        parser.error('--tokens must start with 0 (the plain run the others are compared to)')
    seeds = range(HELD_OUT_SEED0, HELD_OUT_SEED0 + args.episodes)
    runs = {}
    with ProcessPoolExecutor(args.workers) as pool:
        for tokens in values:
            runs[tokens] = list(pool.map(episode, [(s, tokens) for s in seeds]))
            print(f'speculative_tokens {tokens}: done', file=sys.stderr, flush=True)
    plain = runs[0]
    header = ['speculative tokens', 'episodes', 'actions', 'passes an action (mean)',
              'p99', 'drafted', 'kept', 'kept share', 'tick ms (median)', 'tick p99',
              'goals reached', 'same actions as plain, tick for tick']
    rows = []
    for tokens, episodes in runs.items():
        passes = np.concatenate([e['passes'] for e in episodes])
        times = np.concatenate([e['times'] for e in episodes])
        drafted = sum(e['drafted'] for e in episodes)
        kept = sum(e['accepted'] for e in episodes)
        same = all(e['actions'] == p['actions'] for e, p in zip(episodes, plain))
        rows.append([tokens, len(episodes), len(passes), f'{passes.mean():.3f}',
                     f'{np.percentile(passes, 99):.0f}', drafted, kept,
                     f'{kept / drafted:.3f}' if drafted else '-',
                     f'{np.median(times):.2f}', f'{np.percentile(times, 99):.2f}',
                     f"{sum(e['goals'] for e in episodes)} of {3 * len(episodes)}",
                     'yes' if same else 'NO'])
    print_table(header, rows)
    if args.write:
        body = (markdown_table(header, rows)
                + f'\n\nSeeds {seeds[0]}..{seeds[-1]} (held out), the shipped policy, numpy '
                '(one BLAS thread a worker), `meaning` eviction at 256 tokens, model clock. '
                'Passes: the prefill, decode steps and verify passes of each action; tick '
                'ms: wall time of `TickEngine.tick` on this host, '
                f'{args.workers} episodes at a time.')
        write_section('speculative', 'Speculative action decoding on the demo (numpy, CPU)',
                      body)
    return 0 if all(r[-1] == 'yes' for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
