"""``rt-llm-demo`` (``make demo``): the demo world and the node in closed loop over DDS.

Starts both nodes (one process, one executor, real topics), configures and
activates the LLM node with ``config/demo.yaml``, runs for ``--seconds``,
prints one line per second and writes a PNG of the trajectory and of the tick
latency against the deadline.
"""

import argparse
from pathlib import Path
import sys
import threading
import time

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
import yaml

from rt_llm_node.demo.world_node import DemoWorldNode
from rt_llm_node.node import RtLlmNode

ROOT = Path(__file__).resolve().parents[2]


def demo_parameters(path=None):
    """The demo profile's ros__parameters (from the source tree or the installed share)."""
    candidates = [Path(path)] if path else [ROOT / 'config' / 'demo.yaml']
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory('rt_llm_node')) / 'config' /
                          'demo.yaml')
    except Exception:  # not installed through ament: the source tree will do
        pass
    for candidate in candidates:
        if candidate.exists():
            data = yaml.safe_load(candidate.read_text())
            return data['rt_llm_node']['ros__parameters']
    raise FileNotFoundError('config/demo.yaml not found')


def plot(world, latencies, deadline_ms, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    w = world.world
    for (p, r) in w.obstacles:
        ax1.add_patch(plt.Circle(p, r, color='0.6'))
    for (colour, shape), p in w.objects:
        ax1.add_patch(plt.Circle(p, 0.2, color=colour))
        ax1.text(p[0] + 0.25, p[1], shape, fontsize=8)
    episode = world.episode
    pts = [(x, y) for _, x, y, e in world.trajectory if e == episode]
    if pts:
        ax1.plot(*zip(*pts), 'k-', lw=1)
    ax1.set_xlim(0, w.config.arena)
    ax1.set_ylim(0, w.config.arena)
    ax1.set_aspect('equal')
    ax1.set_title(f'trajectory (episode {episode}), goals: {world.goals}')
    ax2.plot(latencies, lw=0.7, label='tick latency')
    ax2.axhline(deadline_ms, color='r', ls='--', label='deadline')
    ax2.set_xlabel('tick')
    ax2.set_ylabel('ms')
    ax2.legend()
    ax2.set_title('tick latency against the deadline')
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(prog='rt-llm-demo', description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--params', default=None, help='YAML (default: config/demo.yaml)')
    parser.add_argument('--backend', default=None, help='override: auto, numpy or cuda')
    parser.add_argument('--out', default='out/demo.png')
    args = parser.parse_args(argv)
    params = demo_parameters(args.params)
    if args.backend:
        params['backend'] = args.backend
    rclpy.init()
    world = DemoWorldNode()
    node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(world)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            print('rt-llm-demo: configure failed (see the log above)', file=sys.stderr)
            return 1
        node.trigger_activate()
        started = time.monotonic()
        while time.monotonic() - started < args.seconds:
            time.sleep(1.0)
            stats, refusals, latencies = node.stats()
            p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))] if latencies else 0.0
            print(f"t={time.monotonic() - started:5.1f}s ticks {stats.get('ticks', 0):5d} "
                  f"actions {stats.get('actions', 0):5d} refusals {stats.get('refusals', 0):4d} "
                  f"{dict(refusals) or ''} p99 {p99:5.1f} ms late {stats.get('late', 0)} "
                  f"goals reached {world.goals['reached']} timed out {world.goals['timeout']}",
                  flush=True)
        node.trigger_deactivate()
        stats, refusals, latencies = node.stats()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        plot(world, latencies, 1e3 / params['rate_hz'], args.out)
        print(f'wrote {args.out}')
    finally:
        executor.shutdown()
        node.destroy_node()
        world.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
