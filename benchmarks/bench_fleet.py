"""Fleet regression on Ray: wall time of a fleet of demo bags against the workers.

    python benchmarks/bench_fleet.py [--bags 64] [--seconds 20] [--workers 1,4,8,16]
        [--cluster] [--write]

Records ``--bags`` demo bags of ``--seconds`` (seeds from 1000000, on every core at once),
writes their goldens once (one cost model), then replays the fleet against them with each
worker count on a local Ray cluster of that many CPUs: wall time (Ray's start included),
speed-up over one worker, and whether every report is the same (it must be: the model clock).
``--cluster``: the same run through ``--address`` on a cluster started here with ``ray start
--head`` and one more node process (half the CPUs each). The results file keeps one section
per CPU count of the machine (a laptop's figures and a 16-core host's side by side).
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import markdown_table  # noqa: E402
from report import print_table  # noqa: E402
from report import write_section  # noqa: E402

PARAMS = str(ROOT / 'config' / 'demo.yaml')
HEADER = ['workers', 'wall s', 'speed-up', 'ticks/s', 'task s', 'bags', 'same report']


def fleet(*args, env=None):
    started = time.monotonic()
    done = subprocess.run([sys.executable, '-m', 'rt_llm_node.fleet', *map(str, args)],
                          capture_output=True, text=True, env=env)
    if done.returncode not in (0, 1):
        sys.exit(f'the fleet run failed:\n{done.stderr[-3000:]}')
    return time.monotonic() - started


def failed(out):
    """Exit naming the failed bags' errors: a timing of failed replays measures nothing."""
    data = json.loads((Path(out) / 'report.json').read_text())
    errors = {b['bag']: b.get('error') for b in data['bags'] if b['status'] == 'error'}
    if errors:
        shown = '\n'.join(f'  {name}: {error}' for name, error in list(errors.items())[:5])
        sys.exit(f'{len(errors)} of {len(data["bags"])} bags failed in {out}:\n{shown}')


def task_seconds(out):
    """Mean seconds a bag's task took (grows with the workers where they contend for cores)."""
    data = json.loads((Path(out) / 'report.json').read_text())
    return sum(b['seconds'] for b in data['bags']) / len(data['bags'])


def decisions(out):
    failed(out)
    data = json.loads((Path(out) / 'report.json').read_text())
    strip = {'seconds', 'host', 'fingerprint', 'path', 'attempts'}
    return [{k: v for k, v in b.items() if k not in strip} for b in data['bags']], data['totals']


def cluster_run(root, golden, cpus):
    """Run the fleet through --address on a head and one more node started here."""
    # a cluster on this host for the run alone: no token authentication (Ray's default for
    # clusters started by ray start; a cluster that has it needs RAY_AUTH_TOKEN here)
    env = dict(os.environ, RAY_ADDRESS='', RAY_AUTH_MODE='disabled')
    port = 6391
    head = cpus // 2 or 1
    subprocess.run(['ray', 'start', '--head', f'--port={port}', f'--num-cpus={head}',
                    '--include-dashboard=false'], check=True, capture_output=True, env=env)
    try:
        subprocess.run(['ray', 'start', f'--address=127.0.0.1:{port}',
                        f'--num-cpus={max(1, cpus - head)}'], check=True,
                       capture_output=True, env=env)
        seconds = fleet(root / 'bags', '--params', PARAMS, '--golden', golden, '--out',
                        root / 'cluster', '--address', f'127.0.0.1:{port}', env=env)
        return seconds, decisions(root / 'cluster')
    finally:
        subprocess.run(['ray', 'stop', '--force'], capture_output=True, env=env)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--bags', type=int, default=64)
    parser.add_argument('--seconds', type=float, default=20.0)
    parser.add_argument('--workers', default='1,4,8,16')
    parser.add_argument('--cluster', action='store_true')
    parser.add_argument('--write', action='store_true')
    args = parser.parse_args()
    from rt_llm_node.demo.recorder import record_demo_bag
    counts = [int(w) for w in args.workers.split(',')]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.monotonic()
        paths = [root / 'bags' / f'bag{i:03d}' for i in range(args.bags)]
        with ProcessPoolExecutor() as pool:
            list(pool.map(record_demo_bag, paths, [args.seconds] * args.bags,
                          [1_000_000 + 7 * i for i in range(args.bags)]))
        print(f'{args.bags} bags of {args.seconds:g} s recorded in '
              f'{time.monotonic() - started:.0f} s', flush=True)
        golden = root / 'golden'
        fleet(root / 'bags', '--params', PARAMS, '--write-golden', golden,
              '--workers', max(counts))
        failed(golden)
        rows, reference, base = [], None, None
        for workers in counts:
            out = root / f'w{workers}'
            seconds = fleet(root / 'bags', '--params', PARAMS, '--golden', golden, '--out',
                            out, '--workers', workers)
            found, totals = decisions(out)
            reference = reference or found
            base = base or seconds
            rows.append([workers, f'{seconds:.1f}', f'{base / seconds:.2f}',
                         f"{totals['ticks'] / seconds:,.0f}", f'{task_seconds(out):.2f}',
                         str(totals['by_status']), 'yes' if found == reference else 'NO'])
            print_table(HEADER, rows[-1:])
        if args.cluster:
            seconds, (found, totals) = cluster_run(root, golden, max(counts))
            rows.append([f'{max(counts)} (head + 1 node, --address)', f'{seconds:.1f}',
                         f'{base / seconds:.2f}', f"{totals['ticks'] / seconds:,.0f}",
                         f"{task_seconds(root / 'cluster'):.2f}",
                         str(totals['by_status']), 'yes' if found == reference else 'NO'])
    print_table(HEADER, rows)
    if args.write:
        body = (f'{args.bags} demo bags of {args.seconds:g} s (demo profile, shipped policy, '
                'numpy backend, model clock) against goldens written once; wall time of '
                "`rt-llm-replay-fleet --golden` including Ray's start; task s: a bag's "
                'replay, mean; same report: every '
                "bag's decisions and counts as with the first row.\n\n"
                + markdown_table(HEADER, rows))
        cpus = os.cpu_count()
        write_section('fleet' if cpus <= 2 else f'fleet-{cpus}',
                      'Fleet regression on Ray' + ('' if cpus <= 2 else f', {cpus} CPUs'), body)


if __name__ == '__main__':
    main()
