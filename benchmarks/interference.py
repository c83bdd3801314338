"""Real time under interference: the demo node beside CPU hogs and a message flood.

    python benchmarks/interference.py [--ticks 34000] [--rate 100] [--write]

Runs, one after another, the demo world (its own process) and the demo node (this process,
numpy backend, the demo profile at ``--rate``: its control thread and calibration at
SCHED_FIFO 50) quiet, beside busy-loop processes (one per core), and beside those plus a
flood of messages on an input topic and an unrelated one. Per run: ticks, admitted,
refused by reason, admitted but late (computed, then withheld: never published), skipped
periods, and refusals whose message went out after their deadline (read back over DDS by a
recorder node). A late action is never published; the figure that matters is how often the
node still acts, and that every refusal is on time.
"""

import argparse
from collections import Counter
import multiprocessing
import os
from pathlib import Path
import sys
import threading
import time

from report import markdown_table
from report import print_table
from report import write_section

ROOT = Path(__file__).resolve().parents[1]


def hog(stop):
    """Spin a core until ``stop`` is set."""
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x = (x * 31 + 7) % 1000003


def flood(stop, per_second):
    """Publish junk on an input topic and an unrelated one at ``per_second`` messages."""
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from std_msgs.msg import String
    rclpy.init()
    node = rclpy.create_node('interference_flood')
    pubs = [node.create_publisher(String, '/detections', qos_profile_sensor_data),
            node.create_publisher(String, '/chatter', 10)]
    text = 'red ball 23deg 4.0m; ' * 20
    period = 1.0 / per_second
    next_at = time.monotonic()
    while not stop.is_set():
        for pub in pubs:
            pub.publish(String(data=text))
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    node.destroy_node()
    rclpy.shutdown()


def world(stop):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rt_llm_node.demo.world_node import DemoWorldNode
    rclpy.init()
    node = DemoWorldNode()
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    while not stop.is_set():
        executor.spin_once(timeout_sec=0.05)
    executor.shutdown()
    node.destroy_node()
    rclpy.shutdown()


def run(ticks, rate, hogs, flood_rate, overrides=None):
    """Run the node for ``ticks`` ticks beside the given interference; return its figures.

    ``overrides``: node parameters set over the demo profile's.
    """
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter import Parameter
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import LaserScan
    from rt_llm_node.demo.run import demo_parameters
    from rt_llm_node.node import RtLlmNode
    context = multiprocessing.get_context('spawn')
    stop = context.Event()
    helpers = [context.Process(target=world, args=(stop,), daemon=True)]
    helpers += [context.Process(target=hog, args=(stop,), daemon=True) for _ in range(hogs)]
    if flood_rate:
        helpers.append(context.Process(target=flood, args=(stop, flood_rate), daemon=True))
    for process in helpers:
        process.start()
    rclpy.init()
    late_refusals = Counter()
    received = Counter()
    late_by = []

    def on_refusal(msg):
        values = {kv.key: kv.value for kv in msg.status[0].values}
        received['refusals'] += 1
        over_ms = (int(values['published_stamp']) - int(values['deadline_stamp'])) / 1e6
        if over_ms > 0:
            late_refusals[values['reason']] += 1
            late_by.append(over_ms)

    params = demo_parameters()
    params.update(backend='numpy', rate_hz=float(rate), **(overrides or {}))
    node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    listener = rclpy.create_node('interference_recorder')
    listener.create_subscription(DiagnosticArray, '/rt_llm_node/refusal', on_refusal, 100)
    # the world's scans as this process sees them: the run starts once they arrive, and a
    # world that stalls mid-run shows as a gap (stale_input refusals are the world's, not
    # the engine's)
    scans = []
    listener.create_subscription(LaserScan, '/scan', lambda _: scans.append(time.monotonic()),
                                 qos_profile_sensor_data)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    executor.add_node(listener)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    started = time.monotonic()
    try:
        node.trigger_configure()
        deadline = time.monotonic() + 60.0
        while len(scans) < 3 and time.monotonic() < deadline:   # DDS discovery of the world
            time.sleep(0.1)
        if len(scans) < 3:
            raise RuntimeError('the demo world published no /scan within 60 s')
        node.trigger_activate()
        activated = time.monotonic()
        while node.stats()[0].get('ticks', 0) < ticks:
            time.sleep(1.0)
        node.trigger_deactivate()
        stats, refusals, latencies = node.stats()
    finally:
        node._stop_loop()
        executor.shutdown()
        spinner.join(timeout=10)
        node.destroy_node()
        listener.destroy_node()
        rclpy.shutdown()
        stop.set()
        for process in helpers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    latencies.sort()
    during = [t for t in scans if t >= activated]
    gaps = [b - a for a, b in zip(during, during[1:])]
    return {'scan_gap_max_s': max(gaps, default=0.0),
            'scans': len(during),
            'ticks': stats.get('ticks', 0), 'actions': stats.get('actions', 0),
            'refusals': dict(refusals), 'late': stats.get('late', 0),
            'skipped': stats.get('skipped_periods', 0),
            'refusals_received': received['refusals'],
            'refusals_late': sum(late_refusals.values()),
            'refusals_late_node': stats.get('late_refusals', 0),
            'refusals_late_reasons': dict(late_refusals),
            'late_by_max_ms': max(late_by, default=0.0),
            'p99': latencies[int(0.99 * (len(latencies) - 1))] if latencies else 0.0,
            'p50': latencies[int(0.5 * (len(latencies) - 1))] if latencies else 0.0,
            'forward_passes': stats.get('forward_passes', 0),
            'drafted': stats.get('drafted', 0), 'drafts_kept': stats.get('drafts_kept', 0),
            'seconds': time.monotonic() - started}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ticks', type=int, default=34000, help='ticks per run (3 runs)')
    parser.add_argument('--rate', type=float, default=100.0, help='control rate, Hz')
    parser.add_argument('--flood', type=int, default=2000, help='flood messages a second')
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    cores = os.cpu_count() or 1
    runs = [('quiet', 0, 0), (f'{cores} CPU hogs', cores, 0),
            (f'{cores} CPU hogs + {args.flood} msg/s flood', cores, args.flood)]
    header = ['interference', 'ticks', 'admitted', 'refused by reason', 'admitted but late',
              'skipped periods', 'refusals published after their deadline (reasons)',
              'most late ms', 'p99 tick ms', 'minutes']
    rows = []
    for label, hogs, flood_rate in runs:
        result = run(args.ticks, args.rate, hogs, flood_rate)
        why = ', '.join(f'{k} {v}' for k, v in sorted(result['refusals_late_reasons'].items()))
        rows.append([label, result['ticks'], result['actions'],
                     ', '.join(f'{k} {v}' for k, v in sorted(result['refusals'].items()))
                     or '-', result['late'], result['skipped'],
                     f"{result['refusals_late']} of {result['refusals_received']}"
                     + (f' ({why})' if why else ''),
                     f"{result['late_by_max_ms']:.1f}",
                     f"{result['p99']:.2f}", f"{result['seconds'] / 60:.1f}"])
        print_table(header, [rows[-1]])
        sys.stdout.flush()
    print()
    print_table(header, rows)
    total = sum(r[1] for r in rows)
    body = (f'The demo node (numpy backend, demo profile at {args.rate:g} Hz, SCHED_FIFO '
            'priority 50 where permitted) and the demo world, in this order: quiet, beside a '
            f'busy loop per core, and beside those plus {args.flood} messages a second on '
            f'/detections and /chatter; {total} ticks in all. Admitted but late: computed, '
            'found past the deadline and withheld (never published). Refusals published '
            'after their deadline: read back over DDS (published_stamp against '
            'deadline_stamp; the node counts the same in its diagnostics as '
            'late_refusals_published); most late: the worst of those, in ms past the '
            'deadline.\n\n' + markdown_table(header, rows))
    if args.write:
        write_section('interference', 'Real time under interference (demo node, CPU)', body)
    return 0


if __name__ == '__main__':
    sys.exit(main())
