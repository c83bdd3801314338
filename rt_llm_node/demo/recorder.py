"""``rt-llm-demo-record``: drive the demo world with the expert and write a rosbag2.

The bags are the replay tests' fixtures and a quick way to get a realistic input
stream without a robot: /scan, /odom and /detections every world tick (30 Hz),
/instruction once per goal, stamped on a fixed epoch so that recordings of one seed
are identical; with ``--commands`` also the expert's /cmd_vel (what a recording of a robot
driven by its operator holds: the fine-tuning data of training/finetune.py). No ROS install
is needed (the rosbags library writes the bag).

    rt-llm-demo-record out/demo_bag --seconds 60 [--seed 1000000] [--storage sqlite3]
"""

import argparse
from pathlib import Path
import sys
from types import SimpleNamespace

import numpy as np

from rt_llm_node.codec import scan_sectors
from rt_llm_node.demo.episodes import SCAN_SECTORS
from rt_llm_node.demo.expert import expert_command
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import numeric_field
from rt_llm_node.demo.task import TWIST_FIELDS
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.files import FileError
from rt_llm_node.files import OutputFolder

EPOCH_NS = 1_700_000_000 * 1_000_000_000
TYPES = {
    '/instruction': 'std_msgs/msg/String',
    '/scan': 'sensor_msgs/msg/LaserScan',
    '/odom': 'nav_msgs/msg/Odometry',
    '/detections': 'std_msgs/msg/String',
}
FRAMES = {'/scan': 'base_scan', '/odom': 'odom'}
SENSOR_DELAY_NS = 4_000_000   # messages are logged a little after the world tick
COMMAND_DELAY_NS = 8_000_000  # and the expert's command after them
COMMAND_TOPIC = '/cmd_vel'
MAX_SECONDS = 24 * 3600.0   # the longest recording or demo run: a day, ~2.6M ticks
# the QoS rt-llm-demo-world offers (sensor data; the instruction reliable and transient
# local, depth 10), recorded in the bag's metadata as ros2 bag record does
SENSOR_QOS = ('best_effort', 'volatile', 5)
INSTRUCTION_QOS = ('reliable', 'transient_local', 10)


def offered_qos(topic):
    """Return the rosbags Qos list rt-llm-demo-world offers on ``topic``."""
    from rosbags.rosbag2.metadata import Qos
    from rosbags.rosbag2.metadata import QosDurability
    from rosbags.rosbag2.metadata import QosHistory
    from rosbags.rosbag2.metadata import QosLiveliness
    from rosbags.rosbag2.metadata import QosReliability
    from rosbags.rosbag2.metadata import QosTime
    reliability, durability, depth = INSTRUCTION_QOS if topic == '/instruction' else SENSOR_QOS
    unspecified = QosTime(0, 0)
    return [Qos(QosHistory.KEEP_LAST, depth, QosReliability[reliability.upper()],
                QosDurability[durability.upper()], unspecified, unspecified,
                QosLiveliness.AUTOMATIC, unspecified, False)]


def record_demo_bag(path, seconds=10.0, seed=1_000_000, storage='mcap', force=False,
                    commands=False, noise=(0.0, 0.0), executed=None):
    """Write a bag of ``seconds`` of the expert driving the world; returns its path.

    ``commands``: the expert's commands too (geometry_msgs/Twist on /cmd_vel, quantized to
    the demo's action grammar, each logged after the observations it answers). ``noise``:
    standard deviations of (v, w) added to what the robot executes, never to what is recorded
    (the expert's command is the label of the states its own drive would not reach: the
    recovery data imitation needs).
    When an episode ends (three goals) the world of the next seed continues the stream.
    ``executed``: instead, the (v, w) the robot executed each tick of one episode of ``seed``
    (rt-llm-eval's ``executed``, another driver's): the bag holds that episode's
    ``len(executed)`` ticks, and the expert answers each state given the turn rate executed
    last, as in rt-llm-eval (the DAgger data of training/rollout_bags.py). An
    existing ``path`` is replaced only when it is an earlier bag of this tool
    (``files.OutputFolder``; ``force``: written beside what else is there).
    """
    if not 0.0 < seconds <= MAX_SECONDS:   # NaN fails this too
        raise ValueError(f'seconds must be in (0, {MAX_SECONDS:g}], not {seconds!r}')
    if seed < 0:
        raise ValueError(f'the seed must be >= 0, not {seed}')
    from rosbags.rosbag2 import StoragePlugin
    from rosbags.rosbag2 import Writer
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    from rt_llm_node.bags import to_store_message
    path = Path(path)
    folder = OutputFolder(path, 'rt-llm-demo-record', force)   # an earlier bag of this tool
    store = get_typestore(Stores.LATEST)
    plugin = {'mcap': StoragePlugin.MCAP, 'sqlite3': StoragePlugin.SQLITE3}[storage]
    world = DemoWorld(seed, messages=MessageFactory(ros=False))
    rng = np.random.default_rng(seed)
    writer = Writer(folder.staging, version=9, storage_plugin=plugin)
    writer.open()
    try:
        connections = {topic: writer.add_connection(topic, msgtype, typestore=store,
                                                    offered_qos_profiles=offered_qos(topic))
                       for topic, msgtype in TYPES.items()}
        if commands:
            connections[COMMAND_TOPIC] = writer.add_connection(
                COMMAND_TOPIC, 'geometry_msgs/msg/Twist', typestore=store,
                offered_qos_profiles=offered_qos(COMMAND_TOPIC))
        fv, fw = (numeric_field(f) for f in TWIST_FIELDS)
        instruction, w = '', 0.0   # w: the turn rate last commanded
        ticks = (len(executed) if executed is not None
                 else int(round(seconds / world.config.dt)))
        for tick in range(ticks):
            if world.done and executed is not None:
                raise ValueError(f'seed {seed} ended after {tick} of the {ticks} executed '
                                 'commands: not an episode of this seed')
            if world.done:  # episode over (3 goals): the next seed takes over, same timeline
                seed += 1
                world = DemoWorld(seed, messages=MessageFactory(ros=False))
                w = 0.0
            stamp_ns = EPOCH_NS + int(round(tick * world.config.dt * 1e9))
            msgs = world.observe()
            for topic, msg in msgs.items():
                header = SimpleNamespace(stamp=SimpleNamespace(
                    sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000),
                    frame_id=FRAMES.get(topic, ''))
                msg.header = header
                if topic == '/odom':
                    msg.child_frame_id = 'base_link'
                data = store.serialize_cdr(to_store_message(msg, TYPES[topic], store),
                                           TYPES[topic])
                writer.write(connections[topic], stamp_ns + SENSOR_DELAY_NS, data)
            if '/instruction' in msgs:
                instruction = msgs['/instruction'].data
            v, w = expert_command(instruction, scan_sectors(msgs['/scan'], SCAN_SECTORS),
                                  msgs['/detections'].data, w)
            if commands:   # as the model's action would be: on the grammar's steps
                v, w = fv.quantize(v), fw.quantize(w)
                twist = store.types['geometry_msgs/msg/Twist'](
                    linear=store.types['geometry_msgs/msg/Vector3'](x=v, y=0.0, z=0.0),
                    angular=store.types['geometry_msgs/msg/Vector3'](x=0.0, y=0.0, z=w))
                writer.write(connections[COMMAND_TOPIC], stamp_ns + COMMAND_DELAY_NS,
                             store.serialize_cdr(twist, 'geometry_msgs/msg/Twist'))
            if executed is not None:
                v, w = (float(x) for x in executed[tick])
                world.step(v, w)
            elif any(noise):
                world.step(v + rng.normal(0.0, noise[0]), w + rng.normal(0.0, noise[1]))
            else:
                world.step(v, w)
    except BaseException:
        try:
            writer.close()
        finally:
            folder.discard()   # a failed recording leaves what was there as it was
        raise
    writer.close()
    folder.commit()
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog='rt-llm-demo-record',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('out', help='bag folder to create (an earlier bag of this tool there '
                        'is replaced; anything else is refused)')
    parser.add_argument('--force', action='store_true',
                        help='write into a folder that holds other files, beside them')
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--seed', type=int, default=1_000_000)
    parser.add_argument('--storage', choices=('mcap', 'sqlite3'), default='mcap')
    parser.add_argument('--commands', action='store_true',
                        help="record the expert's /cmd_vel too (fine-tuning data)")
    parser.add_argument('--noise', default='0,0', metavar='V,W',
                        help='standard deviations (m/s, rad/s) of noise added to what the '
                        'robot executes, not to the recorded command (default 0,0)')
    args = parser.parse_args(argv)
    try:
        noise = tuple(float(x) for x in args.noise.split(','))
        if len(noise) != 2 or not all(0.0 <= x < 10.0 for x in noise):
            raise ValueError
    except ValueError:
        parser.error(f'--noise takes two standard deviations V,W in [0, 10), not {args.noise!r}')
    try:
        path = record_demo_bag(args.out, args.seconds, args.seed, args.storage, args.force,
                               args.commands, noise)
    except ValueError as exc:
        parser.error(str(exc))
    except FileError as exc:
        print(f'rt-llm-demo-record: error: {exc}', file=sys.stderr)
        return 2
    print(f'wrote {path} ({args.storage}, {args.seconds:g} s, seed {args.seed})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
