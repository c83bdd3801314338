"""The lifecycle node over real rclpy and DDS: a separate publisher node feeds the inputs."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402,I100
from rclpy.node import Node  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from rt_llm_node.demo.run import demo_parameters  # noqa: E402
from rt_llm_node.node import RtLlmNode  # noqa: E402

from conftest import TEST_DIR  # noqa: E402,I100
from conftest import wait_until  # noqa: E402
from dds import reasons  # noqa: E402
from dds import start  # noqa: E402
from dds import transition  # noqa: E402


def test_publishes_actions_at_the_rate(rig, tmp_path):
    world, recorder, make = rig
    cost_file = tmp_path / 'robot_cost_model.json'
    node = make(rate_hz=10.0, deadline_margin_ms=5.0, cost_model_path=str(cost_file))
    start(node)
    from rt_llm_node.admission import CostModel
    cost = CostModel.from_json(cost_file.read_text())   # the node's calibration
    assert cost.decode[0] > 0 and cost.prefill_ms(48, 100) > cost.decode_ms(100)
    wait_until(lambda: node.stats()[0].get('ticks', 0) >= 40, what='40 ticks')
    transition(node, 'deactivate')
    stats, refusals, _ = node.stats()
    assert stats['ticks'] >= 40, stats
    # a missed QoS deadline is a period without an action on the wire, not jitter
    assert stats.get('qos_deadline_missed', 0) <= max(2, 0.05 * stats['ticks']), stats
    assert stats.get('actions', 0) >= 20, (stats, refusals)
    assert stats.get('late', 0) == 0
    assert len(recorder.actions) >= stats.get('actions', 0) - 2  # discovery may miss a first
    for _, msg in recorder.actions:
        assert -0.2 <= msg.linear.x <= 0.8 and -1.5 <= msg.angular.z <= 1.5
        assert math.isfinite(msg.linear.x) and math.isfinite(msg.angular.z)


def test_too_short_a_period_refuses_with_deadline_before_the_deadline(executor, tmp_path):
    """The inputs come from, and the outputs go to, another process (as on a robot)."""
    out = tmp_path / 'peer.json'
    script = str(TEST_DIR / 'peer_process.py')
    world = subprocess.Popen([sys.executable, script, 'world', '40'])
    peer = subprocess.Popen([sys.executable, script, 'recorder', '40', str(out)])
    params = demo_parameters()
    # 20 ms periods with 12 ms kept as margin: 8 ms is less than any tick of the model takes
    params.update(backend='numpy', calibration_repeats=3, rate_hz=50.0,
                  deadline_margin_ms=12.0, on_refusal='none')
    node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor.add_node(node)
    try:
        start(node)
        time.sleep(2.5)
        transition(node, 'deactivate')
        stats, refusals, _ = node.stats()
    finally:
        node._stop_loop()
        executor.shutdown()   # its callbacks finish before the node goes (see rig)
        executor.spin_thread.join(timeout=10.0)
        node.destroy_node()
        for proc in (world, peer):
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    record = json.loads(out.read_text())
    assert refusals.get('deadline', 0) > 80, (stats, refusals)
    assert stats.get('actions', 0) == 0
    deadline_refusals = [r for r in record['refusals'] if r[2] == 'deadline']
    assert len(deadline_refusals) > 80
    assert stats.get('late', 0) == 0
    # deadline_stamp is the end of the tick's period; the engine stops deadline_margin_ms
    # (here 12 ms) earlier to leave time for publishing. Python on a non-real-time kernel,
    # 3 processes on 2 shared cores: the OS may still preempt the control thread between
    # decision and publish, or the recorder before it reads; both are counted and printed.
    late_published = [(tick, reason, (published - deadline) / 1e6) for _, deadline, reason, tick,
                      published in record['refusals'] if published > deadline]
    late = [(tick, (received - deadline) / 1e6) for received, deadline, _, tick, _
            in record['refusals'] if received > deadline]
    print(f'refusals: {len(record["refusals"])}, published late {len(late_published)}, '
          f'arrived late {len(late)}, worst {max([d for _, d in late], default=0):.1f} ms')
    assert not late_published, late_published[:5]
    if len(late) > 0.02 * len(record['refusals']):
        # more than 2% late is tolerated only as one stall of the receiving process (seen
        # on shared 2-core machines: 15 refusals in one ~280 ms burst), not as a spread
        arrived = [received for received, deadline, *_ in record['refusals']
                   if received > deadline]
        span_ms = (max(arrived) - min(arrived)) / 1e6
        assert span_ms <= 500, f'{len(late)} arrived late over {span_ms:.0f} ms: {late[:5]}'
    assert len(record['actions']) == 1, 'only the stop sent on deactivate'


def test_missing_input_gives_stale_input(rig):
    world, recorder, make = rig
    topics = [t.replace('/detections', '/detections_missing')
              for t in demo_parameters()['input_topics']]
    assert '/detections_missing' in topics
    node = make(rate_hz=10.0, input_topics=topics)
    start(node, inputs=len(topics) - 1)
    time.sleep(1.5)
    transition(node, 'deactivate')
    stats, refusals, _ = node.stats()
    assert refusals.get('stale_input', 0) >= 5 and stats.get('actions', 0) == 0
    assert 'stale_input' in reasons(recorder)
    detail = {kv.key: kv.value for kv in recorder.refusals[-1][1].status[0].values}['detail']
    assert '/detections_missing' in detail


def test_undecodable_scans_are_dropped_and_refused_as_stale(rig, executor):
    """Scans that do not decode (cut short on the wire) never reach the node.

    It refuses them as stale input naming the topic; it does not crash and does not act on
    old data.
    """
    from rclpy.serialization import serialize_message
    from sensor_msgs.msg import LaserScan
    world, recorder, make = rig
    scan = LaserScan(range_min=0.1, range_max=10.0, ranges=[1.0] * 32)
    cut = serialize_message(scan)[:-8]   # the CDR stream ends inside the ranges
    sender = Node('corrupt_scan_sender')
    pub = sender.create_publisher(LaserScan, '/scan_corrupt', 10)
    sender.create_timer(0.05, lambda: pub.publish(cut))
    executor.add_node(sender)
    try:
        topics = [t.replace('/scan', '/scan_corrupt')
                  for t in demo_parameters()['input_topics']]
        node = make(rate_hz=10.0, input_topics=topics)
        start(node, inputs=len(topics) - 1)
        wait_until(lambda: pub.get_subscription_count() >= 1, what='the node subscribed')
        time.sleep(1.5)
        assert '/scan_corrupt' not in node._buffer.snapshot()
        transition(node, 'deactivate')
    finally:
        executor.remove_node(sender)
        sender.destroy_node()
    stats, refusals, _ = node.stats()
    assert refusals.get('stale_input', 0) >= 5 and stats.get('actions', 0) == 0, (stats,
                                                                                  refusals)
    detail = {kv.key: kv.value for kv in recorder.refusals[-1][1].status[0].values}['detail']
    assert '/scan_corrupt' in detail


def test_broken_model_fails_configure_with_the_loader_message(rig, tmp_path):
    world, recorder, make = rig
    (tmp_path / 'config.json').write_text('{"architectures": ["GPT2LMHeadModel"]}')
    node = make(model_path=str(tmp_path))
    assert transition(node, 'configure') != TransitionCallbackReturn.SUCCESS
    assert 'GPT2LMHeadModel' in node.last_error and 'config.json' in node.last_error
    node2 = make(model_path=str(tmp_path / 'missing'))
    assert transition(node2, 'configure') != TransitionCallbackReturn.SUCCESS
    assert 'not a checkpoint directory' in node2.last_error


def test_a_gguf_model_acts_over_dds_and_a_truncated_one_fails_configure(rig, tmp_path):
    """A quantized GGUF file as model_path, with an int8 cache: configure, act; cut: refused."""
    pytest.importorskip('gguf', reason='the gguf package reads GGUF files')
    from gguf_models import write_gguf
    world, recorder, make = rig
    path = write_gguf(tmp_path / 'model.gguf', 'qwen2', 'Q4_K')
    node = make(model_path=str(path), kv_dtype='int8', rate_hz=10.0)
    start(node)
    wait_until(lambda: node.stats()[0].get('actions', 0) >= 5, what='5 actions')
    transition(node, 'deactivate')
    stats, refusals, _ = node.stats()
    assert stats.get('late', 0) == 0, stats
    for _, msg in recorder.actions:   # a random model's actions: within the grammar's limits
        assert -0.2 <= msg.linear.x <= 0.8 and -1.5 <= msg.angular.z <= 1.5
    cut = tmp_path / 'cut.gguf'
    cut.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    broken = make(model_path=str(cut))
    assert transition(broken, 'configure') != TransitionCallbackReturn.SUCCESS
    assert 'cut.gguf' in broken.last_error and 'truncated' in broken.last_error
    assert '\n' not in broken.last_error


def test_a_reconfigured_node_restores_its_prompt_and_instruction_from_state_dir(rig, tmp_path):
    """Deactivate and cleanup store the state; the next configure and instruction restore it."""
    world, recorder, make = rig
    node = make(rate_hz=10.0, state_dir=str(tmp_path / 'state'))
    start(node)
    wait_until(lambda: node.stats()[0].get('instructions_prefilled', 0) >= 1,
               what='the instruction placed after the system prompt')
    transition(node, 'deactivate')
    assert transition(node, 'cleanup') == TransitionCallbackReturn.SUCCESS
    assert any(p.name.startswith('prefix-') for p in (tmp_path / 'state').iterdir())
    start(node)
    wait_until(lambda: node.stats()[0].get('actions', 0) >= 3, what='actions after a restart')
    stats = node.stats()[0]
    transition(node, 'deactivate')
    assert stats.get('instructions_restored', 0) >= 1, stats
    assert stats.get('instructions_prefilled', 0) == 0, stats


def test_deactivate_stops_output_and_cleanup_then_configure_works(rig):
    world, recorder, make = rig
    node = make(rate_hz=10.0)
    start(node)
    time.sleep(1.0)
    transition(node, 'deactivate')
    time.sleep(0.3)
    count = len(recorder.actions) + len(recorder.refusals)
    last = recorder.actions[-1][1]
    assert last.linear.x == 0.0 and last.angular.z == 0.0, 'deactivate sends a stop'
    time.sleep(1.0)
    assert len(recorder.actions) + len(recorder.refusals) == count, 'output after deactivate'
    assert transition(node, 'cleanup') == TransitionCallbackReturn.SUCCESS
    start(node)
    time.sleep(1.0)
    transition(node, 'deactivate')
    assert len(recorder.actions) + len(recorder.refusals) > count


def test_the_shutdown_transition_while_active_publishes_a_stop_first(rig):
    world, recorder, make = rig
    node = make(rate_hz=10.0)
    start(node)
    wait_until(lambda: sum(m.linear.x != 0.0 for _, m in recorder.actions) >= 5,
               what='the robot moving')
    assert transition(node, 'shutdown') == TransitionCallbackReturn.SUCCESS
    wait_until(lambda: recorder.actions[-1][1].linear.x == 0.0
               and recorder.actions[-1][1].angular.z == 0.0, timeout=5.0,
               what='a stop action after shutdown')
    count = len(recorder.actions)
    time.sleep(0.5)
    assert len(recorder.actions) == count, 'output after shutdown'


def test_an_instruction_reaches_the_node_from_a_default_or_a_latched_publisher(executor):
    """A default-QoS and a latched publisher both deliver the instruction, once each message.

    ros2 topic pub offers reliable, volatile; a latched publisher may have spoken before the
    node started.
    """
    from rclpy.qos import QoSProfile
    from std_msgs.msg import String
    from rt_llm_node.qos import INSTRUCTION_QOS
    params = demo_parameters()
    params.update(backend='numpy', calibration_repeats=2)
    latched = Node('latched_instruction')
    latched_pub = latched.create_publisher(String, '/instruction', INSTRUCTION_QOS)
    latched_pub.publish(String(data='go to the red box'))   # before the node exists
    executor.add_node(latched)
    node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    executor.add_node(node)
    try:
        assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS
        wait_until(lambda: '/instruction' in node._buffer.snapshot(), what='the latched one')
        assert node._buffer.snapshot()['/instruction'][0].data == 'go to the red box'
        plain = Node('plain_instruction')
        plain_pub = plain.create_publisher(String, '/instruction', QoSProfile(depth=10))
        executor.add_node(plain)
        wait_until(lambda: plain_pub.get_subscription_count() >= 1, what='matching')
        plain_pub.publish(String(data='go to the blue cone'))
        wait_until(lambda: node._buffer.snapshot()['/instruction'][0].data ==
                   'go to the blue cone', what='the default-QoS instruction')
        arrivals = node._buffer.snapshot()['/instruction'][1]
        latched_pub.publish(String(data='go to the green ball'))   # reaches both subscriptions
        wait_until(lambda: node._buffer.snapshot()['/instruction'][0].data ==
                   'go to the green ball', what='a live latched instruction')
        assert node._buffer.snapshot()['/instruction'][1] > arrivals
    finally:
        node._stop_loop()
        executor.shutdown()
        executor.spin_thread.join(timeout=10.0)
        for each in (node, latched):
            each.destroy_node()


def test_invalid_parameters_are_rejected(rig):
    world, recorder, make = rig
    node = make()
    bad = [Parameter('rate_hz', value=-5.0), Parameter('eviction_policy', value='lru'),
           Parameter('backend', value='tpu'), Parameter('input_max_age_s', value=[0.1]),
           Parameter('action_step', value=[0.1, -0.25]),
           Parameter('kv_capacity_tokens', value=5), Parameter('realtime_priority', value=99)]
    for param in bad:
        result = node.set_parameters([param])[0]
        assert not result.successful, param.name
        assert result.reason
    assert node.set_parameters([Parameter('rate_hz', value=20.0)])[0].successful
    assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS
    result = node.set_parameters([Parameter('rate_hz', value=25.0)])[0]
    assert not result.successful and 'clean up' in result.reason
    assert node.set_parameters([Parameter('on_refusal', value='hold')])[0].successful


def test_repeated_backend_errors_go_through_error_processing(rig):
    world, recorder, make = rig
    node = make(rate_hz=10.0, backend_error_limit=3)
    start(node)
    time.sleep(0.5)
    # a real fault, not a stand-in: corrupt the weights so the model yields NaN logits
    node._engine.backend.lm_head[:] = float('nan')
    end = time.monotonic() + 10.0
    while node._state_machine.current_state[1] != 'unconfigured' and time.monotonic() < end:
        time.sleep(0.1)
    state = node._state_machine.current_state[1]
    assert state == 'unconfigured', (node.stats()[:2], node.last_error)
    assert 'consecutive backend errors' in node.last_error and 'non-finite' in node.last_error
    assert 'backend_error' in reasons(recorder)
    last = recorder.actions[-1][1]
    assert last.linear.x == 0.0 and last.angular.z == 0.0, 'the robot is told to stop'
    assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS, 'and can start over'


def _fifo_permitted(priority):
    """Whether this process may put a thread under SCHED_FIFO (probed in a throwaway thread)."""
    result = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
            result.append(True)
        except (AttributeError, OSError):
            result.append(False)
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result[0]


def test_realtime_priority_is_applied_or_refused_with_a_warning(rig):
    world, recorder, make = rig
    node = make(rate_hz=10.0, realtime_priority=5)
    start(node)
    end = time.monotonic() + 10.0
    while node.stats()[0].get('ticks', 0) < 3 and time.monotonic() < end:
        time.sleep(0.1)
    assert node.stats()[0].get('ticks', 0) >= 3, 'the loop runs either way'
    assert node._realtime == _fifo_permitted(5)
    if node._realtime:
        assert os.sched_getscheduler(node._thread.native_id) == os.SCHED_FIFO
