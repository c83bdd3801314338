"""What reaches the robot: clamps, joint steps bounded by the measured state, fallbacks."""

from types import SimpleNamespace as NS

from rt_llm_node.codec import Action
from rt_llm_node.codec import action_message
from rt_llm_node.guard import OutputGuard

JOINTS = ['shoulder', 'elbow']


def joint_state(positions, names=JOINTS):
    return {'/joint_states': (NS(name=list(names), position=list(positions)), 0.0, None)}


def arm(**options):
    return OutputGuard('joint_trajectory', JOINTS, [-3.0, -3.0], [3.0, 3.0], '/joint_states',
                       [0.05, 0.1], **options)


def test_a_twist_is_clamped_and_its_stop_is_zero_even_outside_the_limits():
    guard = OutputGuard('twist', ['_aim', 'linear.x', 'angular.z'], [-180, 0.2, -1.0],
                        [180, 0.8, 1.0])
    action = Action('twist', {'_aim': 90.0, 'linear.x': 0.9, 'angular.z': 1.5})
    limited = guard.limit(action, {})
    assert limited.values == {'_aim': 90.0, 'linear.x': 0.8, 'angular.z': 1.0}
    assert limited.decoded == action.values, 'the decoded values stay on record'
    inside = Action('twist', {'_aim': 0.0, 'linear.x': 0.5, 'angular.z': -0.25})
    assert guard.limit(inside, {}) is inside
    # a stop is zero whatever the limits: a "stop" clamped to 0.2 m/s would be a move
    assert guard.stop({}).values == {'linear.x': 0.0, 'angular.z': 0.0}


def test_a_joint_target_moves_at_most_its_step_from_the_measured_position():
    guard = arm()
    snapshot = joint_state([0.5, -1.0])
    limited = guard.limit(Action('joint_trajectory', {'shoulder': 2.0, 'elbow': -1.04}),
                          snapshot)
    assert limited.values == {'shoulder': 0.55, 'elbow': -1.04}
    assert guard.check(snapshot) == ''
    assert 'elbow' in guard.check(joint_state([0.5], ['shoulder']))
    assert 'no finite position' in guard.check(joint_state([0.5, float('nan')]))
    assert 'no joint state' in guard.check({})


def test_an_arm_stops_where_it_is_measured_never_at_zero():
    guard = arm()
    stop = guard.stop(joint_state([0.5, -1.0, 9.0], JOINTS + ['gripper']))
    assert stop.values == {'shoulder': 0.5, 'elbow': -1.0}
    msg = action_message(stop, 'trajectory_msgs/msg/JointTrajectory', 0.1,
                         lambda kind, **fields: NS(**fields))
    assert msg.joint_names == JOINTS and msg.points[0].positions == [0.5, -1.0]
    # nothing measured yet: an empty trajectory, which a trajectory controller holds on
    unknown = action_message(guard.stop({}), 'trajectory_msgs/msg/JointTrajectory', 0.1,
                             lambda kind, **fields: NS(**fields))
    assert unknown.joint_names == JOINTS and unknown.points == []


def test_hold_is_bounded_in_time_then_stops_once():
    guard = OutputGuard('twist', ['linear.x'], [-1.0], [1.0], hold_timeout_s=0.5)
    moving = Action('twist', {'linear.x': 0.7})
    guard.on_action(moving, now=10.0)
    assert guard.on_refusal('hold', 10.2, {}) is moving
    assert guard.on_refusal('hold', 10.5, {}) is moving
    assert guard.on_refusal('hold', 10.6, {}).values == {'linear.x': 0.0}
    assert guard.on_refusal('hold', 10.7, {}) is None, 'then silence until the next action'
    assert guard.on_refusal('none', 10.8, {}) is None


def test_a_stop_goes_out_once_per_refusal_state_or_every_tick():
    once = OutputGuard('twist', ['linear.x'], [-1.0], [1.0])
    stops = [once.on_refusal('stop', t, {}) for t in range(3)]
    assert stops[0].values == {'linear.x': 0.0} and stops[1:] == [None, None]
    once.on_action(Action('twist', {'linear.x': 0.3}), 3.0)
    assert once.on_refusal('stop', 4.0, {}) is not None, 'a new refusal state'
    assert once.on_exit({}).values == {'linear.x': 0.0}, 'leaving active always stops'
    every = OutputGuard('twist', ['linear.x'], [-1.0], [1.0], repeat='every_tick')
    assert all(every.on_refusal('stop', t, {}) is not None for t in range(3))


def test_a_twist_stamped_carries_its_stamp_and_frame():
    msg = action_message(Action('twist', {'linear.x': 0.5, 'angular.z': -0.25}),
                         'geometry_msgs/msg/TwistStamped', 1 / 30,
                         lambda kind, **fields: NS(**fields), stamp=NS(sec=5, nanosec=7),
                         frame_id='base_footprint')
    assert msg.header.frame_id == 'base_footprint' and msg.header.stamp.sec == 5
    assert msg.twist.linear.x == 0.5 and msg.twist.angular.z == -0.25
