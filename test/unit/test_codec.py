"""The codec on its own: every input type rendered, every action type decoded and mapped.

Messages are plain namespaces with the ROS field names (what the renderers read from rclpy
and rosbags messages alike); the tokenizer is the shipped demo model's, a real BPE.
"""

import math
from types import SimpleNamespace as NS

import numpy as np
import pytest

from rt_llm_node.codec import action_message
from rt_llm_node.codec import ActionField
from rt_llm_node.codec import GrammarError
from rt_llm_node.codec import InputSpec
from rt_llm_node.codec import joint_trajectory_grammar
from rt_llm_node.codec import normalize_type
from rt_llm_node.codec import ObservationCodec
from rt_llm_node.codec import refusal_values
from rt_llm_node.codec import RenderError
from rt_llm_node.codec import StringGrammar
from rt_llm_node.codec import TokenTrie
from rt_llm_node.codec import twist_grammar
from rt_llm_node.engine import Refusal
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path


@pytest.fixture(scope='module')
def tokenizer():
    return load_checkpoint(default_model_path()).tokenizer


def quaternion(yaw):
    return NS(x=0.0, y=0.0, z=math.sin(yaw / 2), w=math.cos(yaw / 2))


def vec(x=0.0, y=0.0, z=0.0):
    return NS(x=x, y=y, z=z)


def render(msg_type, msg, **options):
    spec = InputSpec('/in', msg_type, options=options)
    return ObservationCodec(None, [spec]).text('/in', msg)


# -- observations -----------------------------------------------------------------------
def test_laser_scan_renders_the_nearest_return_per_sector_counter_clockwise():
    # 8 beams, one a sector, from straight ahead counter-clockwise
    scan = NS(ranges=[1.0, 2.0, float('inf'), float('nan'), 0.01, 3.25, 9.0, 4.0],
              angle_min=0.0, angle_increment=2 * math.pi / 8, range_min=0.1, range_max=5.0)
    # inf: nothing within range (clear up to range_max); NaN, below range_min or above
    # range_max: no valid return (REP-117)
    assert render('sensor_msgs/msg/LaserScan', scan) == 'scan 1.0 2.0 5.0 - - 3.2 - 4.0'
    # 4 sectors of 90 deg: beams at 45 deg steps fall to the nearer sector centre
    assert render('sensor_msgs/LaserScan', scan, sectors=4) == 'scan 1.0 5.0 3.2 -'


@pytest.mark.parametrize('ranges,limits', [
    ([float('nan')] * 360, (0.1, 5.0)),
    ([float('-inf')] * 360, (0.1, 5.0)),
    ([-1.0] * 360, (0.1, 5.0)),
    ([1.0] * 360, (6.0, 5.0)),          # range_min above range_max
    ([1e39] * 360, (0.1, 5.0)),         # every return beyond range_max
])
def test_a_scan_that_sees_nothing_usable_is_a_render_error_not_an_empty_line(ranges, limits):
    scan = NS(ranges=ranges, angle_min=-math.pi, angle_increment=2 * math.pi / 360,
              range_min=limits[0], range_max=limits[1])
    with pytest.raises(RenderError, match='/in: LaserScan'):
        render('sensor_msgs/msg/LaserScan', scan)


def test_the_share_of_valid_beams_a_scan_needs_is_configurable():
    scan = NS(ranges=[1.0, 2.0, 3.0] + [float('nan')] * 7, angle_min=0.0,
              angle_increment=0.1, range_min=0.1, range_max=5.0)
    assert render('sensor_msgs/msg/LaserScan', scan, min_valid=0.3).startswith('scan 1.0')
    with pytest.raises(RenderError, match='3 of 10 beams valid'):
        render('sensor_msgs/msg/LaserScan', scan, min_valid=0.5)


def test_huge_values_are_refused_not_rendered_digit_by_digit():
    scan = NS(ranges=[1.0] * 8, angle_min=0.0, angle_increment=0.1, range_min=0.0,
              range_max=1e39)
    with pytest.raises(RenderError, match='range_max is out of range'):
        render('sensor_msgs/msg/LaserScan', scan)
    odom = NS(pose=NS(pose=NS(position=vec(1e39), orientation=quaternion(0.0))),
              twist=NS(twist=NS(linear=vec(), angular=vec())))
    with pytest.raises(RenderError, match='pose.position.x is out of range'):
        render('nav_msgs/msg/Odometry', odom)


@pytest.mark.parametrize('text', ['', '   ', '\x00\x07\n\t'])
def test_an_empty_instruction_is_no_task(text):
    spec = InputSpec('/task', 'std_msgs/msg/String', kind='instruction', prefix='task')
    with pytest.raises(RenderError, match='empty instruction'):
        ObservationCodec(None, [spec]).text('/task', NS(data=text))


@pytest.mark.parametrize('field,value', [('range_max', 0.0), ('angle_increment', 0.0),
                                         ('angle_min', float('nan')), ('ranges', [])])
def test_a_laser_scan_that_cannot_be_read_is_a_render_error(field, value):
    scan = NS(ranges=[1.0] * 8, angle_min=0.0, angle_increment=0.1, range_min=0.1,
              range_max=5.0)
    setattr(scan, field, value)
    with pytest.raises(RenderError):
        render('sensor_msgs/msg/LaserScan', scan)


def test_odometry_renders_pose_yaw_and_body_velocity():
    odom = NS(pose=NS(pose=NS(position=vec(1.26, -0.44), orientation=quaternion(math.pi / 2))),
              twist=NS(twist=NS(linear=vec(0.3), angular=vec(z=-0.04))))
    # -0.04 rounds to 0.0 and is never rendered as '-0.0'
    assert render('nav_msgs/msg/Odometry', odom) == 'odom x 1.3 y -0.4 yaw 90 v 0.3 w 0.0'


def test_odometry_with_a_zero_quaternion_or_a_nan_is_a_render_error():
    odom = NS(pose=NS(pose=NS(position=vec(), orientation=NS(x=0.0, y=0.0, z=0.0, w=0.0))),
              twist=NS(twist=NS(linear=vec(), angular=vec())))
    with pytest.raises(RenderError, match='zero length'):
        render('nav_msgs/msg/Odometry', odom)
    odom.pose.pose.orientation = quaternion(0.0)
    odom.twist.twist.linear.x = float('nan')
    with pytest.raises(RenderError, match='twist.linear.x'):
        render('nav_msgs/msg/Odometry', odom)


def test_imu_renders_yaw_rate_planar_acceleration_and_tilt():
    pitch = math.radians(10)
    imu = NS(orientation=NS(x=0.0, y=math.sin(pitch / 2), z=0.0, w=math.cos(pitch / 2)),
             angular_velocity=vec(z=0.123), linear_acceleration=vec(0.25, -1.0, 9.8))
    assert render('sensor_msgs/msg/Imu', imu) == 'imu wz 0.12 ax 0.2 ay -1.0 roll 0 pitch 10'


def test_joint_state_renders_names_and_positions_capped_and_sanitized():
    joints = NS(name=['elbow', 'wrist\n\x07roll', 'a', 'b'], position=[0.5234, -1.1, 2.0, 3.0])
    assert render('sensor_msgs/msg/JointState', joints, max_joints=2) == \
        'joints elbow 0.52 wrist roll -1.10'
    with pytest.raises(RenderError, match='2 names but 1 positions'):
        render('sensor_msgs/msg/JointState', NS(name=['a', 'b'], position=[0.0]))


def test_twist_and_string_inputs():
    twist = NS(linear=vec(0.31), angular=vec(z=-0.25))
    assert render('geometry_msgs/msg/Twist', twist) == 'twist v 0.3 w -0.2'
    text = NS(data='go\tto the\x00 red\n box  ' + 'x' * 500)
    line = render('std_msgs/msg/String', text, max_chars=30)
    assert line == 'go to the red box xxxxxxxxxxxx' and len(line) == 30
    with pytest.raises(RenderError, match='expected text'):
        render('std_msgs/msg/String', NS(data=b'bytes'))


def test_unknown_input_types_and_kinds_are_refused_at_configuration():
    assert normalize_type('sensor_msgs/Imu') == 'sensor_msgs/msg/Imu'
    with pytest.raises(ValueError, match='unsupported input type'):
        normalize_type('sensor_msgs/msg/PointCloud2')
    with pytest.raises(ValueError, match='kind'):
        InputSpec('/x', 'std_msgs/msg/String', kind='command')
    with pytest.raises(ValueError, match='positive'):
        InputSpec('/x', 'std_msgs/msg/String', max_tokens=0)


def test_a_segment_is_the_prefixed_line_and_a_newline_capped_at_max_tokens(tokenizer):
    spec = InputSpec('/task', 'std_msgs/msg/String', prefix='task', max_tokens=64)
    codec = ObservationCodec(tokenizer, [spec])
    ids = codec.encode('/task', NS(data='go to the red box'))
    assert tokenizer.decode(ids) == 'task go to the red box\n'
    capped = ObservationCodec(tokenizer, [InputSpec('/task', 'std_msgs/msg/String',
                                                    max_tokens=4)])
    long = capped.encode('/task', NS(data='go to the red box ' * 20))
    assert len(long) == 4 and tokenizer.decode(long).endswith('\n'), 'a cut line still ends'


def test_a_malformed_message_names_the_topic_and_type():
    codec = ObservationCodec(None, [InputSpec('/odom', 'nav_msgs/msg/Odometry')])
    with pytest.raises(RenderError, match='/odom: malformed nav_msgs/msg/Odometry'):
        codec.text('/odom', NS(pose=None))


# -- the action grammar -------------------------------------------------------------------
def test_token_trie_allows_only_continuations_and_knows_the_shortest_completion():
    trie = TokenTrie()
    trie.insert([1, 2], 'a')
    trie.insert([1, 3, 4], 'b')
    trie.insert([5], 'c')
    assert list(trie.allowed()) == [1, 5]
    assert trie.shortest() == 1 and trie.children[1].shortest() == 1
    assert trie.children[1].children[3].children[4].value == 'b'
    with pytest.raises(GrammarError, match='token prefix'):
        trie.insert([1], 'd')
    with pytest.raises(GrammarError, match='tokenize identically'):
        trie.insert([5], 'e')


def test_action_fields_quantize_clamp_and_never_return_nan():
    f = ActionField('linear.x', 'v', -0.2, 0.8, 0.1)
    assert f.quantize(0.44) == pytest.approx(0.4) and f.quantize(5.0) == pytest.approx(0.8)
    assert f.quantize(-3.0) == pytest.approx(-0.2) and f.quantize(float('nan')) == 0.0
    assert f.text(-0.2) == 'v-0.2' and f.text(0.8) == 'v+0.8'
    for bad in [(-0.2, 0.8, 0.0), (1.0, 0.0, 0.1), (0.0, 1.0, 0.3), (0.0, float('inf'), 0.1)]:
        with pytest.raises(GrammarError):
            ActionField('x', 'x', *bad)


def decode(grammar, tokenizer, text):
    """Drive the grammar's state machine with the tokens of ``text`` (after the prefix)."""
    ids = tokenizer.encode(text).ids[len(grammar.prefix_ids):]
    state, chosen = grammar.start(), []
    for token in ids:
        assert token in set(grammar.allowed(state).tolist()), tokenizer.decode([token])
        state = grammar.advance(state, token)
        chosen.append(token)
        if grammar.done(state):
            break
    return state, chosen


def test_twist_grammar_decodes_parses_and_maps_to_a_twist(tokenizer):
    grammar = twist_grammar(tokenizer, [
        {'name': 'linear.x', 'key': 'v', 'min': -0.2, 'max': 0.8, 'step': 0.1},
        {'name': 'angular.z', 'key': 'w', 'min': -1.5, 'max': 1.5, 'step': 0.25}])
    text = grammar.render({'linear.x': 0.53, 'angular.z': -9.0})
    assert text == 'act v+0.5 w-1.50\n'
    state, chosen = decode(grammar, tokenizer, text)
    assert grammar.done(state) and grammar.min_remaining(state) == 0
    action = grammar.action(state, chosen)
    assert action.values == {'linear.x': 0.5, 'angular.z': -1.5}
    assert grammar.parse('act v+0.5 w-1.50').values == action.values
    with pytest.raises(GrammarError):
        grammar.parse('act w+0.5 v-1.50')
    msg = action_message(action, 'geometry_msgs/msg/Twist', 1 / 30,
                         lambda kind, **fields: NS(kind=kind, **fields))
    assert msg.kind == 'geometry_msgs/msg/Twist'
    assert vars(msg.linear) == {'kind': 'geometry_msgs/msg/Vector3', 'x': 0.5}
    assert msg.angular.z == -1.5
    with pytest.raises(GrammarError, match='Twist has no field'):
        twist_grammar(tokenizer, [{'name': 'linear.q', 'key': 'v', 'min': 0, 'max': 1,
                                   'step': 0.5}])


def test_joint_trajectory_grammar_maps_to_one_point_due_one_period_ahead(tokenizer):
    grammar = joint_trajectory_grammar(tokenizer, [
        {'name': 'shoulder', 'min': -1.0, 'max': 1.0, 'step': 0.5},
        {'name': 'elbow', 'min': 0.0, 'max': 2.0, 'step': 0.25}])
    text = grammar.render({'shoulder': -0.6, 'elbow': 1.8})
    state, chosen = decode(grammar, tokenizer, text)
    action = grammar.action(state, chosen)
    assert action.values == {'shoulder': -0.5, 'elbow': 1.75}
    msg = action_message(action, 'trajectory_msgs/msg/JointTrajectory', 0.05,
                         lambda kind, **fields: NS(**fields))
    assert msg.joint_names == ['shoulder', 'elbow']
    (point,) = msg.points
    assert point.positions == [-0.5, 1.75]
    assert (point.time_from_start.sec, point.time_from_start.nanosec) == (0, 50_000_000)


def test_string_grammar_stops_at_its_text_or_its_token_cap(tokenizer):
    grammar = StringGrammar(tokenizer, max_tokens=32, stop_text='\n')
    state = grammar.start()
    for token in tokenizer.encode('go left\nand more').ids:
        state = grammar.advance(state, token)
        if grammar.done(state):
            break
    assert grammar.action(state).text == 'go left'
    grammar = StringGrammar(tokenizer, max_tokens=6, stop_text='\n')
    state = grammar.start()
    for token in tokenizer.encode('a b c d e f g h i j').ids[:6]:
        assert not grammar.done(state) and grammar.min_remaining(state) == 1
        state = grammar.advance(state, token)
    assert grammar.done(state)
    msg = action_message(grammar.action(state), 'std_msgs/msg/String', 1 / 30,
                         lambda kind, **fields: NS(**fields))
    assert msg.data == tokenizer.decode(list(state))
    with pytest.raises(GrammarError):
        StringGrammar(tokenizer, max_tokens=0)


def test_a_plan_field_is_decoded_but_never_published(tokenizer):
    grammar = twist_grammar(tokenizer, [
        {'name': '_aim', 'key': 'a', 'min': -180, 'max': 180, 'step': 15},
        {'name': 'linear.x', 'key': 'v', 'min': -0.2, 'max': 0.8, 'step': 0.1}])
    state, chosen = decode(grammar, tokenizer, grammar.render({'_aim': 31, 'linear.x': 0.3}))
    action = grammar.action(state, chosen)
    assert action.values == {'_aim': 30.0, 'linear.x': 0.3}
    msg = action_message(action, 'geometry_msgs/msg/Twist', 1 / 30,
                         lambda kind, **fields: NS(**fields))
    assert vars(msg.linear) == {'x': 0.3} and vars(msg.angular) == {}


def test_refusal_values_in_the_published_order():
    refusal = Refusal(7, 'deadline', 12.5, 9.25, 1.0, 1.03, 'x' * 300)
    values = refusal_values(refusal, 1_033_000_000, 1_020_000_000)
    assert [k for k, _ in values] == ['tick', 'reason', 'predicted_ms', 'available_ms',
                                      'deadline_stamp', 'detail', 'published_stamp']
    assert dict(values)['predicted_ms'] == '12.500' and len(dict(values)['detail']) == 200
    assert dict(values)['deadline_stamp'] == '1033000000'


def test_decoded_actions_stay_within_limits_for_any_logits(tokenizer, rng):
    """Greedy choice under the grammar with random logits: always a complete, clamped action."""
    grammar = twist_grammar(tokenizer, [
        {'name': 'linear.x', 'key': 'v', 'min': -0.2, 'max': 0.8, 'step': 0.1},
        {'name': 'angular.z', 'key': 'w', 'min': -1.5, 'max': 1.5, 'step': 0.25}])
    vocab = tokenizer.get_vocab_size()
    for _ in range(200):
        logits = rng.standard_normal(vocab)
        state = grammar.start()
        while not grammar.done(state):
            allowed = grammar.allowed(state)
            state = grammar.advance(state, int(allowed[np.argmax(logits[allowed])]))
        v, w = grammar.action(state).values.values()
        assert -0.2 <= v <= 0.8 and -1.5 <= w <= 1.5
