"""The demo node with speculative decoding off and on: tick time and passes, one run each.

    python benchmarks/bench_node_speculative.py [--seconds 300] [--tokens 0,4] [--write]

The demo world and the demo node (numpy backend, the demo profile at 30 Hz, its control
thread at SCHED_FIFO 50 where permitted; interference.py's harness, nothing else running),
once per ``--tokens`` value of speculative_tokens, one after another in this process: ticks,
actions, refusals, late ticks, the node's tick time (median and p99, from the tick's
scheduled start to its decision), forward passes an action and the share of drafts kept.
"""

import argparse
import sys

from interference import run  # noqa: I100
from report import markdown_table  # noqa: I201
from report import print_table
from report import write_section


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_node_speculative.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=300.0, help='seconds a run')
    parser.add_argument('--tokens', default='0,4', help='speculative_tokens values')
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    header = ['speculative tokens', 'ticks', 'actions', 'refused by reason',
              'admitted but late', 'tick ms (median)', 'tick p99', 'passes an action',
              'drafts kept', 'longest gap between world scans s', 'minutes']
    rows = []
    for tokens in (int(v) for v in args.tokens.split(',')):
        r = run(int(args.seconds * 30), 30.0, 0, 0, {'speculative_tokens': tokens})
        kept = f"{r['drafts_kept']} of {r['drafted']}" if r['drafted'] else '-'
        refused = ', '.join(f'{k} {v}' for k, v in sorted(r['refusals'].items())) or '0'
        rows.append([tokens, r['ticks'], r['actions'], refused, r['late'],
                     f"{r['p50']:.2f}", f"{r['p99']:.2f}",
                     f"{r['forward_passes'] / max(1, r['actions']):.3f}", kept,
                     f"{r['scan_gap_max_s']:.2f}", f"{r['seconds'] / 60:.1f}"])
        print(f'speculative_tokens {tokens}: done', file=sys.stderr, flush=True)
    print_table(header, rows)
    if args.write:
        write_section('node_speculative', 'The demo node with speculative decoding off and on '
                      '(numpy, CPU)', markdown_table(header, rows)
                      + '\n\nThe demo world and node over DDS at 30 Hz, one run a row, one '
                      "after the other; tick ms: the node's own latency figures (scheduled "
                      'start to decision).')
    return 0


if __name__ == '__main__':
    sys.exit(main())
