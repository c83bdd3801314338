"""What a robot expects of the node's output, over real DDS: per-type stops, bounds, quiet idle.

An arm (JointTrajectory with a JointState input), a base with TwistStamped, ``hold`` bounded
in time, and a refusing node that says stop once and then leaves the command line free.
"""

import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')

from geometry_msgs.msg import TwistStamped  # noqa: E402,I100
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from rt_llm_node.demo.run import demo_parameters  # noqa: E402

from conftest import wait_until  # noqa: E402,I100
from dds import reasons  # noqa: E402
from dds import start  # noqa: E402
from dds import transition  # noqa: E402

JOINTS = ['shoulder', 'elbow']
MEASURED = [0.4, -0.7]
ARM_TOPIC = '/arm_controller/joint_trajectory'


class Arm(Node):
    """A measured arm: publishes its joint state at 30 Hz and keeps the targets it is sent."""

    def __init__(self):
        super().__init__('test_arm')
        self.positions = list(MEASURED)
        self.targets = []
        self.pub = self.create_publisher(JointState, '/joint_states', qos_profile_sensor_data)
        self.create_subscription(JointTrajectory, ARM_TOPIC, self.targets.append, 50)
        self.timer = self.create_timer(1 / 30, self._publish)

    def _publish(self):
        msg = JointState(name=list(JOINTS), position=list(self.positions))
        msg.header.stamp = self.get_clock().now().to_msg()
        self.pub.publish(msg)


def arm_parameters(**overrides):
    """Return the demo profile's changes for an arm: a JointState input, joint targets."""
    params = demo_parameters()
    return dict(
        rate_hz=10.0,
        input_topics=params['input_topics'] + ['/joint_states'],
        input_types=params['input_types'] + ['sensor_msgs/msg/JointState'],
        input_max_age_s=params['input_max_age_s'] + [0.3],
        input_kinds=params['input_kinds'] + ['observation'],
        input_prefixes=params['input_prefixes'] + ['joints'],
        input_max_tokens=params['input_max_tokens'] + [16],
        action_topic=ARM_TOPIC, action_type='trajectory_msgs/msg/JointTrajectory',
        action_fields=JOINTS, action_min=[-2.0, -2.0], action_max=[2.0, 2.0],
        action_step=[0.25, 0.25], action_grammar_min=[], action_grammar_max=[],
        joint_max_step=[0.1], **overrides)


def test_an_arm_moves_a_step_at_most_and_stops_where_it_is_never_at_zero(rig, executor):
    world, recorder, make = rig
    arm = Arm()
    executor.add_node(arm)
    try:
        node = make(**arm_parameters())
        start(node, inputs=4)
        wait_until(lambda: sum(bool(t.points) for t in arm.targets) >= 5, what='5 targets')
        transition(node, 'deactivate')
        time.sleep(0.3)
    finally:
        executor.remove_node(arm)
    stats, refusals, _ = node.stats()
    assert stats.get('actions', 0) >= 5, (stats, refusals)
    for target in arm.targets:
        assert list(target.joint_names) == JOINTS
        positions = list(target.points[0].positions)
        assert all(abs(p - m) <= 0.1 + 1e-9 for p, m in zip(positions, MEASURED)), positions
    last = arm.targets[-1]
    assert list(last.points[0].positions) == pytest.approx(MEASURED), 'the stop holds'


def test_an_arm_without_a_joint_state_input_is_refused_at_configure(rig):
    world, recorder, make = rig
    params = arm_parameters()
    for key in ('input_topics', 'input_types', 'input_max_age_s', 'input_kinds',
                'input_prefixes', 'input_max_tokens'):
        params[key] = params[key][:-1]
    node = make(**params)
    assert transition(node, 'configure') != TransitionCallbackReturn.SUCCESS
    assert 'JointState' in node.last_error


def test_a_refused_arm_holds_its_last_measured_pose(rig, executor):
    """The joint states stop: the node refuses and the stop is the pose last measured."""
    world, recorder, make = rig
    arm = Arm()
    executor.add_node(arm)
    node = make(**arm_parameters())
    start(node, inputs=4)
    wait_until(lambda: sum(bool(t.points) for t in arm.targets) >= 3, what='3 targets')
    arm.positions = [0.5, -0.6]
    time.sleep(0.3)
    arm.destroy_timer(arm.timer)   # the arm's driver went silent
    wait_until(lambda: 'stale_input' in reasons(recorder), what='a stale_input refusal')
    time.sleep(0.5)
    transition(node, 'deactivate')
    executor.remove_node(arm)
    held = [list(t.points[0].positions) for t in arm.targets if t.points]
    assert held[-1] == pytest.approx([0.5, -0.6])
    assert not any(p == [0.0, 0.0] for p in held), 'never the zero pose'


def test_a_twist_stamped_action_carries_the_time_and_frame(rig, executor):
    world, recorder, make = rig
    got = []
    listener = Node('stamped_listener')
    listener.create_subscription(TwistStamped, '/cmd_vel_stamped', got.append, 50)
    executor.add_node(listener)
    try:
        node = make(rate_hz=10.0, action_type='geometry_msgs/msg/TwistStamped',
                    action_topic='/cmd_vel_stamped', action_frame_id='base_footprint')
        assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS
        wait_until(lambda: len(node._buffer.snapshot()) >= 3, what='the inputs')
        transition(node, 'activate')
        wait_until(lambda: len(got) >= 5, what='5 stamped actions')
        transition(node, 'deactivate')
        now = listener.get_clock().now().nanoseconds
    finally:
        executor.remove_node(listener)
        listener.destroy_node()
    assert all(m.header.frame_id == 'base_footprint' for m in got)
    stamps = [m.header.stamp.sec * 10**9 + m.header.stamp.nanosec for m in got]
    assert all(0 < now - s < 30e9 for s in stamps) and stamps == sorted(stamps)
    assert got[-1].twist.linear.x == 0.0 and got[-1].twist.angular.z == 0.0


def test_hold_repeats_the_last_action_for_its_timeout_then_stops_once(rig, executor):
    world, recorder, make = rig
    node = make(rate_hz=10.0, on_refusal='hold', hold_timeout_s=0.4)
    start(node)
    wait_until(lambda: sum(m.linear.x != 0.0 for _, m in recorder.actions) >= 3,
               what='the robot moving')
    executor.remove_node(world)    # the sensors go silent
    silent = time.monotonic()
    time.sleep(2.0)
    after = [(t.nanoseconds / 1e9, m) for t, m in recorder.actions
             if t.nanoseconds / 1e9 > recorder.get_clock().now().nanoseconds / 1e9
             - (time.monotonic() - silent)]
    transition(node, 'deactivate')
    moving = [m for _, m in after if m.linear.x or m.angular.z]
    stops = [m for _, m in after if not (m.linear.x or m.angular.z)]
    assert len(stops) == 1, f'one stop, then silence: {len(stops)} stops'
    assert len(moving) <= 8, f'the last action at most ~0.4 s + staleness: {len(moving)}'
    assert after[-1][1] is stops[0], 'the stop is the last word'


@pytest.mark.parametrize('repeat, expected', [('once', (1, 1)), ('every_tick', (8, 30))])
def test_a_refusing_node_says_stop_once_then_leaves_the_line_free(rig, repeat, expected):
    """No instruction yet: refused every tick; the stop goes out once (a mux can hand over)."""
    world, recorder, make = rig
    params = demo_parameters()
    topics = [t.replace('/instruction', '/instruction_unused') for t in params['input_topics']]
    node = make(rate_hz=10.0, input_topics=topics, fallback_repeat=repeat)
    start(node, inputs=len(topics) - 1)
    time.sleep(1.5)
    stats, refusals, _ = node.stats()
    sent = len(recorder.actions)
    transition(node, 'deactivate')
    assert refusals.get('stale_input', 0) >= 8 and stats.get('actions', 0) == 0
    low, high = expected
    assert low <= sent <= high, f'{sent} stop messages over {stats["ticks"]} refused ticks'
