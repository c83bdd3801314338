"""Quiet when idle, loud when it matters, over real DDS.

/diagnostics levels from a recent window (OK, WARN, ERROR) with a status per input; INFO
lines for transitions, instructions and inputs going stale and recovering; the instruction
kept across cleanup and configure; a default-QoS instruction publisher told nothing false.
"""

import subprocess
import sys
import textwrap
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402,I100
from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402
from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from rt_llm_node.demo.run import demo_parameters  # noqa: E402

from conftest import wait_until  # noqa: E402,I100
from dds import start  # noqa: E402
from dds import transition  # noqa: E402

TASK = '/task_in_test'


class Diagnostics(Node):
    """Keeps the node's /diagnostics arrays."""

    def __init__(self):
        super().__init__('test_diagnostics')
        self.arrays = []
        self.create_subscription(DiagnosticArray, '/diagnostics', self.arrays.append, 50)

    def last(self, name='/rt_llm_node'):
        for array in reversed(self.arrays):
            for status in array.status:
                if status.name == name:
                    return status
        return None


def task_topics():
    """Return the demo inputs with the instruction on a topic the demo world does not publish."""
    return [t.replace('/instruction', TASK) for t in demo_parameters()['input_topics']]


def test_levels_come_from_a_recent_window_and_each_input_has_a_status(rig, executor, capfd):
    """Waiting for an instruction: WARN; acting: back to OK; the console says each change."""
    world, recorder, make = rig
    diagnostics = Diagnostics()
    executor.add_node(diagnostics)
    teller = Node('test_teller')
    pub = teller.create_publisher(String, TASK, QoSProfile(depth=10))
    executor.add_node(teller)
    try:
        node = make(rate_hz=10.0, input_topics=task_topics(), diagnostics_window_s=1.0)
        start(node, inputs=2)
        wait_until(lambda: diagnostics.last() is not None, what='a diagnostics array')
        waiting = diagnostics.last()
        assert waiting.level == DiagnosticStatus.WARN and 'waiting' in waiting.message
        wait_until(lambda: pub.get_subscription_count() >= 1, what='matching')
        pub.publish(String(data='go to the red box and stop there please'))
        wait_until(lambda: node.stats()[0].get('actions', 0) >= 5, what='actions')
        count = len(diagnostics.arrays)
        wait_until(lambda: len(diagnostics.arrays) >= count + 2, what='two more arrays')
        acting = diagnostics.last()
        assert acting.level == DiagnosticStatus.OK, (acting.level, acting.message)
        scan = diagnostics.last('/rt_llm_node: /scan')
        values = {kv.key: kv.value for kv in scan.values}
        assert scan.level == DiagnosticStatus.OK and float(values['frequency_hz']) > 10
        executor.remove_node(world)   # the sensors go silent
        wait_until(lambda: diagnostics.last('/rt_llm_node: /scan').level
                   == DiagnosticStatus.ERROR, what='the scan reported stale')
        executor.add_node(world)
        wait_until(lambda: node.stats()[1].get('stale_input', 0) >= 2, what='refusals')
        wait_until(lambda: diagnostics.last('/rt_llm_node: /scan').level
                   == DiagnosticStatus.OK, what='the scan fresh again')
        assert node.set_parameters([Parameter('on_refusal', value='hold')])[0].successful
        transition(node, 'deactivate')
    finally:
        for each in (diagnostics, teller):
            executor.remove_node(each)
    log = capfd.readouterr().err
    for line in ('configuring', 'activated: ticking at 10 Hz',
                 f"instruction on {TASK}: 'go to the red box and stop there'",
                 f'{TASK}: in force',
                 f'{TASK}: no message yet, refusing ticks', '/scan: fresh again',
                 'refusing ticks', 'on_refusal: stop -> hold', 'deactivated'):
        assert line in log, f'{line!r} not in the log:\n{log[-3000:]}'
    assert log.count('/scan: fresh again') <= 3, 'rate-limited'


def test_every_tick_refused_for_time_is_an_error(rig, capfd):
    """/diagnostics says ERROR, and the console says once why every tick is refused."""
    world, recorder, make = rig
    diagnostics = Diagnostics()
    rig_executor = recorder.executor
    rig_executor.add_node(diagnostics)
    try:
        # 20 ms periods with 12 ms kept as margin: no tick of the model fits
        node = make(rate_hz=50.0, deadline_margin_ms=12.0, diagnostics_window_s=1.0)
        start(node)
        wait_until(lambda: node.stats()[1].get('deadline', 0) >= 60, what='60 refusals')
        count = len(diagnostics.arrays)
        wait_until(lambda: len(diagnostics.arrays) >= count + 2, what='two more arrays')
        status = diagnostics.last()
        transition(node, 'deactivate')
    finally:
        rig_executor.remove_node(diagnostics)
    assert status.level == DiagnosticStatus.ERROR and 'deadline' in status.message
    log = capfd.readouterr().err
    assert log.count('refusing ticks: deadline (the tick would take') == 1, log[-3000:]


def test_an_instruction_is_kept_across_cleanup_and_configure(rig, executor):
    """A one-shot instruction from a volatile publisher: not lost by a reconfigure."""
    world, recorder, make = rig
    teller = Node('test_one_shot')
    pub = teller.create_publisher(String, TASK, QoSProfile(depth=10))
    executor.add_node(teller)
    try:
        node = make(rate_hz=10.0, input_topics=task_topics())
        start(node, inputs=2)
        wait_until(lambda: pub.get_subscription_count() >= 1, what='matching')
        pub.publish(String(data='go to the red box'))
        wait_until(lambda: node.stats()[0].get('actions', 0) >= 3, what='actions')
        transition(node, 'deactivate')
        assert transition(node, 'cleanup') == TransitionCallbackReturn.SUCCESS
        assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS
        transition(node, 'activate')
        wait_until(lambda: node.stats()[0].get('actions', 0) >= 3,
                   what='actions after the reconfigure, with no new instruction')
        transition(node, 'deactivate')
    finally:
        executor.remove_node(teller)


PUBLISHER = textwrap.dedent("""
    import sys, time
    import rclpy
    from rclpy.qos import QoSProfile
    from std_msgs.msg import String
    rclpy.init()
    node = rclpy.create_node('default_qos_teller')
    pub = node.create_publisher(String, sys.argv[1], QoSProfile(depth=10))
    end = time.monotonic() + 20
    while pub.get_subscription_count() < 1 and time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.05)
    pub.publish(String(data='go to the blue cone'))
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.05)
    print('published', flush=True)
    node.destroy_node()
    rclpy.shutdown()
""")


def test_a_default_qos_publisher_is_not_told_that_nothing_will_reach_the_node(rig):
    world, recorder, make = rig
    node = make(input_topics=task_topics())
    assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS
    teller = subprocess.run([sys.executable, '-c', PUBLISHER, TASK], capture_output=True,
                            text=True, timeout=60)
    assert 'published' in teller.stdout, teller.stderr[-2000:]
    wait_until(lambda: TASK in node._buffer.snapshot(), what='the instruction')
    assert node._buffer.snapshot()[TASK][0].data == 'go to the blue cone'
    assert 'incompatible' not in teller.stderr.lower(), teller.stderr[-2000:]
    assert 'No messages will be sent' not in teller.stderr
    assert transition(node, 'cleanup') == TransitionCallbackReturn.SUCCESS


def test_a_flood_of_instructions_is_received_once_a_message_the_latest_kept(rig, executor):
    """A latched publisher sends 300 distinct instructions: each reaches the node once.

    The node's instruction callback is wrapped to count what it is handed (the callback then
    runs as it would): one call a message, not one a subscription (two subscriptions each
    handing over every message doubled a flood's work on the executor's thread).
    """
    from rt_llm_node.qos import INSTRUCTION_QOS
    world, recorder, make = rig
    flooder = Node('test_flooder')
    pub = flooder.create_publisher(String, TASK, INSTRUCTION_QOS)
    executor.add_node(flooder)
    handed = []
    try:
        node = make(rate_hz=10.0, input_topics=task_topics())
        name = '_receive_instruction' if hasattr(node, '_receive_instruction') else '_receive'
        callback = getattr(node, name)

        def counting(topic, msg, *args, **kwargs):
            if topic == TASK:
                handed.append(msg.data)
            return callback(topic, msg, *args, **kwargs)
        setattr(node, name, counting)
        start(node, inputs=2)
        wait_until(lambda: pub.get_subscription_count() >= 1, what='matching')
        time.sleep(3.0)   # what the latched publisher kept is fetched (node.LATCHED_FETCH_S)
        handed.clear()
        sent = [f'go to the red box number {i}' for i in range(300)]
        for text in sent:
            pub.publish(String(data=text))
            time.sleep(0.002)
        wait_until(lambda: node._buffer.snapshot()[TASK][0].data == sent[-1],
                   what='the last instruction')
        time.sleep(0.5)
        stats = node.stats()[0]
        transition(node, 'deactivate')
    finally:
        executor.remove_node(flooder)
    assert len(handed) <= len(sent), f'{len(handed)} receptions of {len(sent)} messages'
    assert handed[-1] == sent[-1]
    placements = stats.get('instructions_prefilled', 0) + stats.get('instructions_restored', 0)
    assert placements <= stats.get('ticks', 0)
