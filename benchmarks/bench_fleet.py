"""Fleet regression on Ray: wall time of a fleet of demo bags against the workers.

    python benchmarks/bench_fleet.py [--bags 64] [--seconds 20] [--workers 1,4,8,16]
        [--running | --only-running] [--cluster] [--work DIR] [--write]

Records ``--bags`` demo bags of ``--seconds`` (seeds from 1000000, on every core at once),
writes their goldens once (one cost model, every core), then replays the fleet against them
with each worker count on a local Ray cluster of that many CPUs: wall time (Ray's start included),
speed-up over one worker, and whether every report is the same (it must be: the model clock).
``--running``: each worker count also through ``--address`` on a Ray cluster of that many CPUs
started before the timed command (``ray start --head``) and stopped after it, as a team's
standing cluster is: the fleet's own scaling, without the ~5 s Ray takes to start and stop a
local cluster in every run; ``--only-running``: those rows alone. With ``--write`` the table
is written after every row, in the order of ``--workers`` (16,1,8,4 gives the speed-up
first), so a run cut short keeps what it measured.
``--cluster``: the same run through ``--address`` on a cluster started here with ``ray start
--head`` and one more node process (half the CPUs each). The results file keeps one section
per CPU count of the machine (a laptop's figures and a 16-core host's side by side).
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
import json
import os
from pathlib import Path
import signal
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


@contextmanager
def ray_cluster(node_cpus, port):
    """Yield (env, address) of a Ray cluster started here: a head and more nodes, their CPUs.

    No token authentication (Ray's default for clusters started by ray start; a cluster that
    has it needs RAY_AUTH_TOKEN here); stopped on the way out.
    """
    env = dict(os.environ, RAY_ADDRESS='', RAY_AUTH_MODE='disabled')
    try:
        subprocess.run(['ray', 'start', '--head', f'--port={port}', f'--num-cpus={node_cpus[0]}',
                        '--include-dashboard=false'], check=True, capture_output=True, env=env)
        for cpus in node_cpus[1:]:
            subprocess.run(['ray', 'start', f'--address=127.0.0.1:{port}', f'--num-cpus={cpus}'],
                           check=True, capture_output=True, env=env)
        yield env, f'127.0.0.1:{port}'
    finally:
        subprocess.run(['ray', 'stop', '--force'], capture_output=True, env=env)


def address_run(root, golden, node_cpus, out):
    """Return (wall time, out) of the fleet through --address on a cluster of ``node_cpus``.

    Only the fleet command is timed: the cluster stands before it, as a team's does.
    """
    with ray_cluster(node_cpus, 6391) as (env, address):
        return fleet(root / 'bags', '--params', PARAMS, '--golden', golden, '--out', out,
                     '--force', '--address', address, env=env), out


def measure(root, key, run):
    """Return row ``key``'s measurement, kept in ROOT/measured.json across invocations."""
    path = root / 'measured.json'
    measured = json.loads(path.read_text()) if path.exists() else {}
    if key not in measured:
        seconds, out = run()
        found, totals = decisions(out)
        measured[key] = {'seconds': seconds, 'found': found, 'totals': totals,
                         'task_s': task_seconds(out)}
        path.write_text(json.dumps(measured))
    return measured[key]


def row(label, m, base, reference):
    return [label, f"{m['seconds']:.1f}", f"{base / m['seconds']:.2f}",
            f"{m['totals']['ticks'] / m['seconds']:,.0f}", f"{m['task_s']:.2f}",
            str(m['totals']['by_status']), 'yes' if m['found'] == reference else 'NO']


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--bags', type=int, default=64)
    parser.add_argument('--seconds', type=float, default=20.0)
    parser.add_argument('--workers', default='1,4,8,16')
    parser.add_argument('--running', action='store_true',
                        help='each worker count on a running cluster of that many CPUs too')
    parser.add_argument('--only-running', action='store_true',
                        help='the running-cluster rows alone (no local ones): half the time')
    parser.add_argument('--cluster', action='store_true')
    parser.add_argument('--work', help='keep the bags, goldens and measured rows here: a '
                        'later invocation with the same --work measures only the rows not yet '
                        'there (a long baseline and the rest in separate runs)')
    parser.add_argument('--write', action='store_true')
    args = parser.parse_args()
    # a time limit's SIGTERM unwinds like Ctrl-C: the cluster a row started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from rt_llm_node.demo.recorder import record_demo_bag
    counts = [int(w) for w in args.workers.split(',')]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        started = time.monotonic()
        paths = [root / 'bags' / f'bag{i:03d}' for i in range(args.bags)]
        todo = [i for i, path in enumerate(paths) if not (path / 'metadata.yaml').exists()]
        with ProcessPoolExecutor() as pool:
            list(pool.map(record_demo_bag, [paths[i] for i in todo], [args.seconds] * len(todo),
                          [1_000_000 + 7 * i for i in todo]))
        print(f'{len(todo)} bags of {args.seconds:g} s recorded in '
              f'{time.monotonic() - started:.0f} s', flush=True)
        golden = root / 'golden'
        if not (golden / 'report.json').exists():
            # every core, whatever rows this invocation measures: a report does not depend
            # on the workers, and a later --work run of one worker reuses it
            fleet(root / 'bags', '--params', PARAMS, '--write-golden', golden,
                  '--workers', os.cpu_count())
        failed(golden)
        for workers in counts:
            out = root / f'w{workers}'
            if not args.only_running:
                seconds = measure(root, str(workers), lambda: (fleet(
                    root / 'bags', '--params', PARAMS, '--golden', golden, '--out', out,
                    '--force', '--workers', workers), out))['seconds']
                print(f'{workers} workers: {seconds:.1f} s', flush=True)
                report(args, root, max(counts), quiet=True)
            if args.running or args.only_running:
                seconds = measure(root, f'running{workers}', lambda: address_run(
                    root, golden, [workers], root / f'running{workers}'))['seconds']
                print(f'{workers} CPUs of a running cluster: {seconds:.1f} s', flush=True)
                report(args, root, max(counts), quiet=True)
        if args.cluster:
            cpus = max(counts)   # a head and one more node, half the CPUs each
            measure(root, 'cluster', lambda: address_run(
                root, golden, [cpus // 2 or 1, max(1, cpus - cpus // 2)], root / 'cluster'))
        if not report(args, root, max(counts)):
            sys.exit('no one-worker row yet: the speed-up needs it (--workers 1)')


def report(args, root, most, quiet=False):
    """Print (and with --write record) the rows measured so far; False before the first row.

    Called quietly after every row too, so that a run cut short (a lost machine, a time limit)
    has written what it measured.
    """
    path = root / 'measured.json'
    measured = json.loads(path.read_text()) if path.exists() else {}
    first = '1' if '1' in measured else 'running1'
    if first not in measured:
        return False
    base, reference = measured[first]['seconds'], measured[first]['found']
    rows = [row(w, m, base, reference) for w, m in sorted(
        ((int(k), m) for k, m in measured.items() if k.isdigit()))]
    if 'running1' in measured:   # against the one-CPU running cluster
        rows += [row(f'{w} (running cluster)', m, measured['running1']['seconds'],
                     reference) for w, m in sorted(
            (int(k[7:]), m) for k, m in measured.items() if k.startswith('running'))]
    if 'cluster' in measured:
        rows.append(row(f'{most} (head + 1 node, --address)', measured['cluster'],
                        base, reference))
    if not quiet:
        print_table(HEADER, rows)
    if args.write:
        body = (f'{args.bags} demo bags of {args.seconds:g} s (demo profile, shipped policy, '
                'numpy backend, model clock) against goldens written once; wall time of '
                "`rt-llm-replay-fleet --golden` including Ray's start (running cluster: "
                'started before the command, its speed-up over one CPU of such a cluster); '
                "task s: a bag's "
                'replay, mean; same report: every '
                "bag's decisions and counts as with the one-worker row"
                + (', rows measured by invocations with the same --work on this machine'
                   if args.work else '') + '.\n\n' + markdown_table(HEADER, rows))
        cpus = os.cpu_count()
        write_section('fleet' if cpus <= 2 else f'fleet-{cpus}',
                      'Fleet regression on Ray' + ('' if cpus <= 2 else f', {cpus} CPUs'), body)
    return True


if __name__ == '__main__':
    main()
