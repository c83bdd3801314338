"""Actions and refusals as ROS messages.

Actions and refusals as ROS messages, one mapping for the node (rclpy classes) and for replay
(rosbags messages built from plain namespaces).
"""

from rt_llm_node.codec.actions import is_plan_field


TWIST_TYPES = ('geometry_msgs/msg/Twist', 'geometry_msgs/msg/TwistStamped')


def action_message(action, action_type, period_s, make, stamp=None, frame_id=''):
    """Return the Action as a message of ``action_type``, built by ``make(type_name, **fields)``.

    The node passes rclpy's message classes, replay plain namespaces: one mapping from
    grammar fields to message fields for both. A TwistStamped carries ``stamp`` (a
    ``builtin_interfaces/Time``, the time it was published) and ``frame_id``. A
    JointTrajectory has one point, due one tick period from now; an action whose positions
    are unknown (None: a stop before any joint state arrived) has none, which a
    joint_trajectory_controller takes as: hold the current position.
    """
    published = {name: value for name, value in action.values.items()
                 if not is_plan_field(name)}
    if action_type in TWIST_TYPES:
        groups = {'linear': {}, 'angular': {}}
        for name, value in published.items():
            group, axis = name.split('.')
            groups[group][axis] = float(value)
        twist = {group: make('geometry_msgs/msg/Vector3', **axes)
                 for group, axes in groups.items()}
        if action_type == 'geometry_msgs/msg/Twist':
            return make(action_type, **twist)
        header = make('std_msgs/msg/Header', stamp=stamp, frame_id=frame_id)
        return make(action_type, header=header, twist=make('geometry_msgs/msg/Twist', **twist))
    if action_type == 'std_msgs/msg/String':
        return make(action_type, data=action.text)
    if any(v is None for v in published.values()):
        return make(action_type, joint_names=list(published), points=[])
    period_ns = int(round(period_s * 1e9))
    due = make('builtin_interfaces/msg/Duration', sec=period_ns // 1_000_000_000,
               nanosec=period_ns % 1_000_000_000)
    point = make('trajectory_msgs/msg/JointTrajectoryPoint',
                 positions=[float(v) for v in published.values()], time_from_start=due)
    return make(action_type, joint_names=list(published), points=[point])


def refusal_values(refusal, deadline_ns, published_ns):
    """[(key, value)] of a refusal's DiagnosticStatus, in the order the node publishes them.

    ``deadline_ns``: the end of the tick's period (the engine stopped work
    ``deadline_margin_ms`` before it); ``published_ns``: when the refusal went out.
    """
    return [('tick', str(refusal.tick)), ('reason', refusal.reason),
            ('predicted_ms', f'{refusal.predicted_ms:.3f}'),
            ('available_ms', f'{refusal.available_ms:.3f}'),
            ('deadline_stamp', str(int(deadline_ns))), ('detail', refusal.detail[:200]),
            ('published_stamp', str(int(published_ns)))]
