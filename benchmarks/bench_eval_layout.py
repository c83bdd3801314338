"""Closed-loop evaluation throughput on the GPU: worker processes against threads a process.

    PYTHONPATH=. python3 benchmarks/bench_eval_layout.py --model SmolLM2-135M-Instruct.Q4_1.gguf
        [--adapter rt_llm_node/demo/smollm2] [--params config/demo_smollm2.yaml]
        [--episodes 16] [--budget 512] [--policy meaning] [--layouts 16x1,4x4,2x8]
        [--backend cuda] [--write]

The same held-out episodes (seeds from 1000000) run once per layout, PROCESSESxTHREADS, through
rt-llm-eval's own runner (``evaluate.run_episodes``): each process a CUDA context, each thread
a backend with its own stream in it. Separate contexts take turns on the GPU; streams of one
context run their kernels side by side, so a layout with threads can keep more of the GPU busy
while each thread's host work waits for the GIL. Per layout: wall time (process start, model
load and graph capture included; the kernels are compiled once before the first), ticks a
second, seconds an episode, and whether every episode matches the first layout's (goals,
ticks, agreement and the executed commands: the model clock makes an episode deterministic,
whatever ran beside it).
"""

import argparse
import hashlib
from pathlib import Path
import sys
import time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import markdown_table  # noqa: E402
from report import print_table  # noqa: E402
from report import write_section  # noqa: E402

HEADER = ['layout', 'processes', 'threads', 'wall s', 'ticks/s', 's an episode',
          'same episodes']


def layouts(text):
    """Parse '16x1,4x4' into [(16, 1), (4, 4)]."""
    try:
        out = [tuple(int(n) for n in item.split('x')) for item in text.split(',')]
    except ValueError:
        out = []
    if not out or any(len(p) != 2 or min(p) < 1 for p in out):
        raise argparse.ArgumentTypeError(f'layouts are PROCESSESxTHREADS, not {text!r}')
    return out


def signature(episode):
    """Return what must agree between layouts: goals, ticks, agreement, executed commands."""
    executed = hashlib.sha256(repr(episode['executed']).encode()).hexdigest()
    return (tuple(episode['results']), episode['ticks'], episode['agree'], executed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True)
    parser.add_argument('--adapter', default=str(ROOT / 'rt_llm_node' / 'demo' / 'smollm2'))
    parser.add_argument('--params', default=str(ROOT / 'config' / 'demo_smollm2.yaml'))
    parser.add_argument('--episodes', type=int, default=16)
    parser.add_argument('--budget', type=int, default=512)
    parser.add_argument('--policy', default='meaning')
    parser.add_argument('--layouts', type=layouts, default=layouts('16x1,4x4,2x8'))
    parser.add_argument('--backend', default='cuda', choices=('numpy', 'cuda'))
    parser.add_argument('--write', action='store_true')
    args = parser.parse_args()
    from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
    from rt_llm_node.demo.evaluate import run_episodes

    def jobs(seeds):
        return {(args.model, args.policy, args.budget, seed, 0, args.backend, 'native',
                 'native', args.adapter, args.params): 'row' for seed in seeds}
    seeds = range(HELD_OUT_SEED0, HELD_OUT_SEED0 + args.episodes)
    started = time.monotonic()   # compiles the kernels into the disk cache every process reads
    for _ in run_episodes(jobs([HELD_OUT_SEED0]), 1, 1, args.backend):
        pass
    print(f'warm-up episode: {time.monotonic() - started:.1f} s', flush=True)
    rows, first = [], None
    for processes, threads in args.layouts:
        started = time.monotonic()
        episodes = {job[3]: episode for job, episode in
                    run_episodes(jobs(seeds), processes, threads, args.backend)}
        wall = time.monotonic() - started
        found = {seed: signature(episodes[seed]) for seed in seeds}
        first = first or found
        ticks = sum(e['ticks'] for e in episodes.values())
        rows.append([f'{processes}x{threads}', processes, threads, f'{wall:.1f}',
                     f'{ticks / wall:.0f}', f'{wall / args.episodes:.2f}',
                     'yes' if found == first else 'NO'])
        print_table(HEADER, rows[-1:])
    print_table(HEADER, rows)
    if args.write:
        from report import machine_description
        machine = machine_description()
        if args.backend == 'cuda':
            from bench_cuda import gpu_machine
            machine = gpu_machine()
        body = (f'{args.episodes} held-out episodes (seeds from {HELD_OUT_SEED0}) of '
                f'{Path(args.model).name} with the adapter {Path(args.adapter).name or "none"}'
                f', {args.policy} at {args.budget} tokens, {args.backend} backend, each '
                "layout PROCESSESxTHREADS through rt-llm-eval's runner; wall time with "
                'process start, model load and capture (kernels compiled before the first); '
                'same episodes: goals, ticks, agreement and executed commands equal to the '
                f"first layout's.\n\n{markdown_table(HEADER, rows)}")
        write_section('eval_layout', 'Closed-loop evaluation: processes against threads',
                      body, machine=machine)
    return 0 if all(r[-1] == 'yes' for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
