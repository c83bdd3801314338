"""Soak: stream a tick-shaped workload through a bounded cache under every policy.

Checks that positions never reach the capacity and that resident memory stays
flat; prints (and with --write records) RSS after the first 10,000 tokens and
at the end.

    python benchmarks/soak.py --tokens 1000000 [--capacity 256] [--write]
"""

import argparse
import tempfile
import time

import numpy as np

from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.kvcache import ACTION
from rt_llm_node.kvcache import INSTRUCTION
from rt_llm_node.kvcache import make_policy
from rt_llm_node.kvcache import OBSERVATION
from rt_llm_node.kvcache import POLICIES
from rt_llm_node.kvcache import SYSTEM
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint
from rt_llm_node.session import KVSession

FIRST_MARK = 10_000
ACTION_TOKENS = 6
TOPICS = (('/scan', 20), ('/odom', 12), ('/detections', 16))


def rss_mib():
    """Resident set size of this process, MiB."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError('no VmRSS in /proc/self/status')


def soak(checkpoint, policy, capacity, total_tokens, seed=0):
    """Run ``total_tokens`` through one policy; returns a result dict."""
    rng = np.random.default_rng(seed)
    vocab = checkpoint.config.vocab_size
    backend = NumpyBackend(checkpoint, capacity)
    context = KVSession(backend, make_policy(policy))
    context.append(rng.integers(0, vocab, 16), kind=SYSTEM)
    tokens, tick, max_length, rss_first = 16, 0, 0, None
    started = time.perf_counter()
    while tokens < total_tokens:
        if tick % 300 == 0:
            context.append(rng.integers(0, vocab, 8), kind=INSTRUCTION)
            tokens += 8
        topic, n = TOPICS[tick % len(TOPICS)]
        context.append(rng.integers(0, vocab, n), kind=OBSERVATION, topic=topic,
                       stamp=tick / 30.0, reserve=ACTION_TOKENS)
        action = context.open_segment(ACTION)
        for _ in range(ACTION_TOKENS):
            context.decode(action, backend.argmax())
        tokens += n + ACTION_TOKENS
        context.decay_scores()
        tick += 1
        max_length = max(max_length, backend.length)
        assert backend.length == context.length <= capacity
        if rss_first is None and tokens >= FIRST_MARK:
            rss_first = rss_mib()
    rss_end = rss_mib()
    return {'policy': policy, 'tokens': tokens, 'ticks': tick, 'max_position': max_length - 1,
            'evicted': context.cache.evicted_tokens, 'rss_first': rss_first, 'rss_end': rss_end,
            'seconds': time.perf_counter() - started}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--tokens', type=int, default=1_000_000)
    parser.add_argument('--capacity', type=int, default=256)
    parser.add_argument('--policies', default=','.join(POLICIES))
    parser.add_argument('--write', action='store_true', help='record in benchmarks/RESULTS.md')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, 'tiny'))
    header = ['policy', 'tokens', 'ticks', 'max position', 'evicted tokens',
              'RSS after 10k tokens (MiB)', 'RSS at end (MiB)', 'change', 'wall s']
    rows = []
    for policy in args.policies.split(','):
        r = soak(checkpoint, policy, args.capacity, args.tokens)
        change = (r['rss_end'] - r['rss_first']) / r['rss_first']
        rows.append([policy, r['tokens'], r['ticks'], r['max_position'], r['evicted'],
                     f"{r['rss_first']:.1f}", f"{r['rss_end']:.1f}", f'{change:+.2%}',
                     f"{r['seconds']:.0f}"])
        print_table(header, rows[-1:])
        assert r['max_position'] < args.capacity
    print_table(header, rows)
    if args.write:
        write_section('soak', f'Soak: tiny model, {args.capacity}-token cache, numpy backend',
                      markdown_table(header, rows))


if __name__ == '__main__':
    main()
