"""Offline replay speed: a 60 s demo bag through rt-llm-replay (model clock, shipped model).

    python benchmarks/bench_replay.py [--seconds 60] [--threads 1,2] [--backend numpy|cuda]
        [--write]

Each replay runs as its own ``rt-llm-replay`` process with ``OPENBLAS_NUM_THREADS`` set to
each of ``--threads`` (the package defaults to one BLAS thread, right for the node beside a
robot's other processes; an offline replay may use every core). Per bag, the one-thread
replay runs first, then the others, and every decision stream (``actions.jsonl``) is
compared byte for byte with the one-thread one. More BLAS threads than idle cores is far
slower (OpenBLAS threads spin): 2 threads took 30x longer on 2 busy cores.
"""

import argparse
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time

from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.demo.recorder import record_demo_bag
from rt_llm_node.model.embedded import default_model_path

ROOT = Path(__file__).resolve().parents[1]


def demo_params(backend, folder):
    """Return config/demo.yaml with ``backend`` pinned.

    config/demo.yaml with ``backend`` pinned (its own ``auto`` picks CUDA on a GPU host, and this
    benchmark measures the backend it names).
    """
    text = (ROOT / 'config' / 'demo.yaml').read_text()
    pinned = re.sub(r'^(\s*backend:\s*)\S+', rf'\g<1>{backend}', text, count=1, flags=re.M)
    if pinned == text and f'backend: {backend}' not in text:
        raise SystemExit('config/demo.yaml has no backend line to pin')
    path = Path(folder) / f'demo_{backend}.yaml'
    path.write_text(pinned)
    return path


def replay_process(bag, out, threads, params):
    """Replay ``bag`` in a fresh process with ``threads`` BLAS threads.

    Its summary and the process's whole wall time (start, imports, model load and configure
    included).
    """
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, '-c', 'import sys; from rt_llm_node.replay import main; '
               'sys.exit(main())', str(bag), '--params', str(params),
               '--out', str(out), '--clock', 'model',
               '--cost-model', str(Path(default_model_path()) / 'cost_model.json')]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    process_s = time.perf_counter() - started
    return json.loads((Path(out) / 'summary.json').read_text()), process_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--threads', default='1,2', help='BLAS thread counts, comma-separated')
    parser.add_argument('--backend', choices=('numpy', 'cuda'), default='numpy',
                        help='the backend every replay uses (default numpy: the CPU figure)')
    parser.add_argument('--write', action='store_true')
    args = parser.parse_args()
    threads = sorted({int(t) for t in args.threads.split(',')})
    if threads[0] != 1:
        threads.insert(0, 1)   # the reference stream
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for storage in ('mcap', 'sqlite3'):
            params = demo_params(args.backend, tmp)
            bag = record_demo_bag(Path(tmp) / storage, args.seconds, storage=storage)
            for n in threads:   # one thread first: its stream is the reference
                out = Path(tmp) / f'out_{storage}_{n}'
                s, process_s = replay_process(bag, out, n, params)
                if s.get('backend') != args.backend:
                    raise SystemExit(f"the replay ran on {s.get('backend')}, not {args.backend}")
                stream = (out / 'actions.jsonl').read_bytes()
                if n == 1:
                    reference = stream
                per_tick = s['wall_seconds'] / s['ticks'] * 1e3
                rows.append([storage, n, f"{s['bag_seconds']:.1f}", s['ticks'],
                             f"{s['wall_seconds']:.1f}", f'{per_tick:.2f}',
                             f"{s['speed_x_realtime']:.1f}x", f'{process_s:.1f}',
                             f"{s['bag_seconds'] / process_s:.1f}x", s['actions'], s['refusals'],
                             'yes' if stream == reference else 'NO'])
    header = ['storage', 'BLAS threads', 'bag s', 'ticks', 'replay s', 'ms / tick',
              'speed vs real time', 'process s', 'process vs real time', 'actions',
              'refusals', 'same decisions as 1 thread']
    print_table(header, rows)
    if args.write:
        write_section('replay', f'Offline replay speed ({args.backend} backend, shipped model)',
                      'A demo bag recorded by rt-llm-demo-record, replayed by `rt-llm-replay '
                      '--clock model` with config/demo.yaml (its backend pinned to '
                      f'`{args.backend}`) and the cost model shipped beside '
                      'the model, one process per row with `OPENBLAS_NUM_THREADS` = BLAS '
                      'threads (replay s: the tick loop, bag reading and writing, every output '
                      'file and the PNG, as summary.json records it; process s: the whole '
                      'command, Python start, imports, model load and configure included). '
                      'Last column: the decision stream '
                      '(actions.jsonl) byte-identical to the one-thread replay of the same '
                      'bag.\n\n' + markdown_table(header, rows))


if __name__ == '__main__':
    main()
