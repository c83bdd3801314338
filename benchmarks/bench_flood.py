"""A flood of instructions: how many ticks the demo node still acts on.

    python benchmarks/bench_flood.py [--seconds 11] [--rate 2000] [--runs 2]
        [--compare LABEL=CHECKOUT ...] [--write]

The demo world (its own process) drives the demo node (this process, numpy backend, the demo
profile at 30 Hz) while a third process publishes a new instruction on /instruction
``--rate`` times a second, latched as the demo world publishes its own (so each message
reaches both of the node's instruction subscriptions where it has two). Per run: ticks,
actions, refusals by reason, instruction messages that reached the node's buffer and how
many placements of a new instruction the ticks made. Instructions that arrive faster than
ticks coalesce: the latest wins, at most one placement a tick, each message kept once.
``--compare LABEL=CHECKOUT`` runs another version of the node the same way, run for run.
"""

import argparse
from collections import Counter
import json
import multiprocessing
import os
from pathlib import Path
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def flood(stop, per_second, count):
    """Publish a new instruction ``per_second`` times a second until ``stop`` is set."""
    import rclpy
    from std_msgs.msg import String
    from rt_llm_node.qos import INSTRUCTION_QOS
    rclpy.init()
    node = rclpy.create_node('bench_instruction_flood')
    pub = node.create_publisher(String, '/instruction', INSTRUCTION_QOS)
    objects = ('red box', 'blue cone', 'green ball', 'yellow crate')
    period, sent = 1.0 / per_second, 0
    next_at = time.monotonic()
    while not stop.is_set():
        pub.publish(String(data=f'go to the {objects[sent % 4]} number {sent}'))
        sent += 1
        count.value = sent
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    node.destroy_node()
    rclpy.shutdown()


def run(seconds, per_second):
    """Return the counts of one run of the node beside the world and the flood."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter import Parameter
    from rt_llm_node.demo.run import demo_parameters
    from rt_llm_node.engine import InputBuffer
    from rt_llm_node.node import RtLlmNode
    kept = Counter()
    put = InputBuffer.put

    def counting_put(self, topic, *args, **kwargs):   # what reached the buffer, per topic
        kept[topic] += 1
        return put(self, topic, *args, **kwargs)
    InputBuffer.put = counting_put
    world = multiprocessing.get_context('spawn').Process(
        target=_world, args=(seconds + 20,), daemon=True)
    world.start()
    rclpy.init()
    params = demo_parameters()
    params.update(backend='numpy', calibration_repeats=3)
    node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    spawn = multiprocessing.get_context('spawn')
    stop, sent = spawn.Event(), spawn.Value('q', 0)
    flooder = spawn.Process(target=flood, args=(stop, per_second, sent), daemon=True)
    try:
        task = executor.create_task(node.trigger_configure)
        while not task.done():
            time.sleep(0.05)
        end = time.monotonic() + 30
        while len(node._buffer.snapshot()) < 3 and time.monotonic() < end:
            time.sleep(0.1)
        flooder.start()
        time.sleep(1.0)
        kept.clear()
        sent_before = sent.value
        task = executor.create_task(node.trigger_activate)
        while not task.done():
            time.sleep(0.05)
        time.sleep(seconds)
        stats, refusals, latencies = node.stats()
        instructions, published = kept['/instruction'], sent.value - sent_before
        task = executor.create_task(node.trigger_deactivate)
        while not task.done():
            time.sleep(0.05)
    finally:
        stop.set()
        if flooder.is_alive():
            flooder.join(timeout=10)
        world.terminate()
        executor.shutdown()
        node.destroy_node()
        rclpy.shutdown()
        InputBuffer.put = put
    placements = stats.get('instructions_prefilled', 0) + stats.get('instructions_restored', 0)
    return {'ticks': stats.get('ticks', 0), 'actions': stats.get('actions', 0),
            'refusals': dict(refusals), 'instructions kept': instructions,
            'instructions sent': published,
            'placements': placements,
            'tick p50 ms': float(np.percentile(latencies, 50)) if latencies else 0.0,
            'tick p99 ms': float(np.percentile(latencies, 99)) if latencies else 0.0}


def _world(seconds):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rt_llm_node.demo.world_node import DemoWorldNode
    rclpy.init()
    node = DemoWorldNode()
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            executor.spin_once(timeout_sec=0.05)
    except (KeyboardInterrupt, Exception):   # terminated with the run
        pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=11.0)
    parser.add_argument('--rate', type=float, default=2000.0, help='instructions a second')
    parser.add_argument('--runs', type=int, default=2)
    parser.add_argument('--compare', nargs='*', default=[], metavar='LABEL=CHECKOUT',
                        help='also run the node of another checkout (e.g. a git worktree)')
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--write', action='store_true', help='write benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    if args.child:   # one run of whichever rt_llm_node is on the path, as a JSON line
        print('RESULT ' + json.dumps(run(args.seconds, args.rate)), flush=True)
        return
    trees = [('this checkout', str(ROOT))] + [tuple(c.split('=', 1)) for c in args.compare]
    rows = []
    for i in range(args.runs):
        for label, tree in trees:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, __file__, '--child', '--seconds',
                                  str(args.seconds), '--rate', str(args.rate)], env=env,
                                 capture_output=True, text=True).stdout
            found = [line[7:] for line in out.splitlines() if line.startswith('RESULT ')]
            if not found:
                print(f'{label}: no result', flush=True)
                continue
            r = json.loads(found[0])
            refusals = ', '.join(f'{k} {v}' for k, v in sorted(r['refusals'].items()))
            rows.append([label, i + 1, r['ticks'], r['actions'], r['instructions sent'],
                         r['instructions kept'], r['placements'],
                         f"{r['tick p50 ms']:.2f}", f"{r['tick p99 ms']:.2f}", refusals or '-'])
            print(rows[-1], flush=True)
    header = ['node', 'run', 'ticks', 'actions', 'instructions sent', 'kept', 'placements',
              'tick p50 ms', 'tick p99 ms', 'refusals']
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    from report import markdown_table
    from report import print_table
    print_table(header, rows)
    if args.write:
        from report import write_section
        write_section('flood', f'An instruction flood ({args.rate:g} a second, 30 Hz demo node)',
                      markdown_table(header, rows))


if __name__ == '__main__':
    main()
