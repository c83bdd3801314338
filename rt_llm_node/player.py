"""Publish a bag's messages for a running node (``rt-llm-replay --live``).

``rt-llm-replay --live``: publish a bag's messages on their topics with their timing, for a running
node, each topic with the QoS its publishers offered when the bag was recorded.
"""

import sys
import time

from rt_llm_node.bags import open_bag


def recorded_qos(connection):
    """Return the QoS a player should offer for a recorded connection.

    {'reliable', 'transient_local', 'depth'} a player should offer for ``connection``, from the QoS
    its publishers offered when the bag was recorded; None if none recorded.

    As ``ros2 bag play`` does: reliable only if every recorded publisher was, transient
    local only if every one was (a best-effort or volatile publisher among them could not
    have served a subscriber that needs more), the deepest history of them.

    """
    from rosbags.rosbag2.metadata import QosDurability
    from rosbags.rosbag2.metadata import QosHistory
    from rosbags.rosbag2.metadata import QosReliability
    ext = getattr(connection, 'ext', None)
    profiles = list(getattr(ext, 'offered_qos_profiles', None) or ())
    if not profiles:
        return None
    # a keep-all publisher recorded depth 0: give the player a deep queue instead
    keep_all = any(p.history == QosHistory.KEEP_ALL for p in profiles)
    return {'reliable': all(p.reliability == QosReliability.RELIABLE for p in profiles),
            'transient_local': all(p.durability == QosDurability.TRANSIENT_LOCAL
                                   for p in profiles),
            'depth': 1000 if keep_all else max(1, max(int(p.depth) for p in profiles))}


def live(bag, remaps=None, publish_clock=False, rate=1.0, delay=1.0, log=print, warn=None):
    """Publish the bag's messages on their topics with the bag's timing (real rclpy)."""
    import importlib
    import rclpy
    from rclpy.qos import DurabilityPolicy
    from rclpy.qos import qos_profile_sensor_data
    from rclpy.qos import QoSProfile
    from rclpy.qos import ReliabilityPolicy
    from rclpy.serialization import deserialize_message
    from rt_llm_node.qos import INSTRUCTION_QOS
    from collections import Counter
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    warn = warn or (lambda text: print(f'rt-llm-replay: warning: {text}', file=sys.stderr))
    store = get_typestore(Stores.LATEST)
    skipped = Counter()
    reader = open_bag(bag)
    inverse = {bag_topic: node_topic for node_topic, bag_topic in (remaps or {}).items()}
    rclpy.init()
    node = rclpy.create_node('rt_llm_replay')
    try:
        publishers, classes = {}, {}
        for connection in reader.connections:
            package, _, name = connection.msgtype.split('/')
            try:
                cls = getattr(importlib.import_module(f'{package}.msg'), name)
            except (ImportError, AttributeError):
                warn(f'skipping {connection.topic}: {connection.msgtype} is not importable here')
                continue
            recorded = recorded_qos(connection)
            if recorded is not None:   # what the robot's publishers offered
                qos = QoSProfile(
                    depth=recorded['depth'],
                    reliability=(ReliabilityPolicy.RELIABLE if recorded['reliable']
                                 else ReliabilityPolicy.BEST_EFFORT),
                    durability=(DurabilityPolicy.TRANSIENT_LOCAL if recorded['transient_local']
                                else DurabilityPolicy.VOLATILE))
            else:
                # a bag without recorded QoS: sensor QoS for sensor data, the rest (an
                # instruction) reliable and transient local, as the node subscribes it (a
                # volatile publisher would not match that subscription)
                sensor = (package == 'sensor_msgs'
                          or connection.topic in ('/odom', '/detections'))
                qos = qos_profile_sensor_data if sensor else INSTRUCTION_QOS
                warn(f'{connection.topic}: no QoS recorded in the bag; publishing '
                     f"{'best effort (sensor data)' if sensor else 'reliable, transient local'}")
            topic = inverse.get(connection.topic, connection.topic)
            publishers[connection.id] = node.create_publisher(cls, topic, qos)
            classes[connection.id] = cls
        clock_pub = None
        if publish_clock:
            from rosgraph_msgs.msg import Clock
            clock_pub = node.create_publisher(Clock, '/clock', 10)
        ready = time.monotonic() + delay   # let DDS discovery match the subscribers first
        while time.monotonic() < ready:
            rclpy.spin_once(node, timeout_sec=0.05)
        t0_bag, t0_wall = reader.start_time, time.monotonic()
        count = 0
        for connection, stamp_ns, raw in reader.messages():
            if connection.id not in publishers:
                continue
            due = t0_wall + (stamp_ns - t0_bag) / 1e9 / rate
            while True:
                left = due - time.monotonic()
                if left <= 0:
                    break
                rclpy.spin_once(node, timeout_sec=min(left, 0.01))
            if clock_pub is not None:
                clock_msg = Clock()
                clock_msg.clock.sec, clock_msg.clock.nanosec = divmod(stamp_ns, 1_000_000_000)
                clock_pub.publish(clock_msg)
            try:   # checked by rosbags first: rmw prints bare errors for what it cannot read
                if connection.msgtype in store.types:
                    store.deserialize_cdr(raw, connection.msgtype)
                message = deserialize_message(raw, classes[connection.id])
            except Exception as exc:   # a corrupt message: skip it, say which topic
                skipped[connection.topic] += 1
                if skipped[connection.topic] == 1:
                    warn(f'{connection.topic}: undecodable message skipped ({exc}); further '
                         'ones on this topic are counted at the end')
                continue
            publishers[connection.id].publish(message)
            count += 1
        log(f'published {count} messages over {(reader.end_time - t0_bag) / 1e9 / rate:.1f} s')
        for topic, n in skipped.items():
            warn(f'{topic}: {n} undecodable messages skipped')
        return count
    finally:
        reader.close()
        node.destroy_node()
        rclpy.try_shutdown()
