"""What reaches the robot: limits that clamp, a bound on joint steps, and safe fallbacks.

The model decodes in its own grammar range (``action_grammar_min``/``_max``: the range it was
trained on); what is published is that action clamped to ``action_min``/``action_max``, as
ros2_control's limiters clamp, so a tighter limit changes an action only by clamping it. For
joint targets each published position also lies within ``joint_max_step`` of the measured
position (the joint-state input, required for such an action): a model cannot command a
jump. Fallbacks depend on the action type: a Twist stops with zeros; a joint target stops by
holding the positions last measured (never zeros, which on a position-controlled arm is a
full-speed move to the zero pose); ``hold`` repeats the last action for at most
``hold_timeout_s``, then stops. No ROS here: the node and the replay share it.
"""

from dataclasses import replace
import math

from rt_llm_node.codec.actions import Action
from rt_llm_node.codec.actions import is_plan_field

JOINT_STATE = 'sensor_msgs/msg/JointState'
FALLBACK_REPEATS = ('once', 'every_tick')


class OutputGuard:
    """Clamp and bound each action against the measured state; choose the fallback.

    ``fields``: the grammar's field names (plan fields, ``_...``, are never published and so
    never clamped); ``minimum``/``maximum``: the published limits, one per field;
    ``joint_topic``: the joint-state input a joint target is measured by (None for other
    action types); ``max_step``: per field, the farthest a joint target may lie from the
    measured position; ``repeat``: ``once`` (the fallback goes out once on entering a
    refusal state, then silence until the next action) or ``every_tick``.
    """

    def __init__(self, kind, fields, minimum=(), maximum=(), joint_topic=None, max_step=(),
                 hold_timeout_s=0.5, repeat='once'):
        self.kind = kind
        self.fields = list(fields)
        self.minimum = dict(zip(self.fields, map(float, minimum)))
        self.maximum = dict(zip(self.fields, map(float, maximum)))
        self.joint_topic = joint_topic
        self.max_step = dict(zip(self.fields, map(float, max_step)))
        self.hold_timeout_s = float(hold_timeout_s)
        if repeat not in FALLBACK_REPEATS:
            raise ValueError(f'fallback_repeat = {repeat!r} is not one of '
                             f'{", ".join(FALLBACK_REPEATS)}')
        self.repeat = repeat
        self.published = [f for f in self.fields if not is_plan_field(f)]
        self.last_action = None        # the last action published, and when
        self.last_action_time = None
        self.refusing = False          # a fallback already went out since the last action

    # -- actions ---------------------------------------------------------------------------
    def measured(self, snapshot):
        """{joint: measured position} from the joint-state input of ``snapshot``, or None."""
        entry = snapshot.get(self.joint_topic) if self.joint_topic else None
        if entry is None:
            return None
        msg = entry[0]
        try:
            names = list(msg.name)
            positions = [float(p) for p in msg.position]
        except (AttributeError, TypeError, ValueError):
            return None
        return {n: p for n, p in zip(names, positions) if math.isfinite(p)}

    def check(self, snapshot):
        """Say why no joint target can be bounded now ('' when it can): a joint not measured."""
        if self.joint_topic is None:
            return ''
        measured = self.measured(snapshot)
        if measured is None:
            return f'{self.joint_topic}: no joint state yet'
        missing = [j for j in self.published if j not in measured]
        if missing:
            return (f'{self.joint_topic}: no finite position for joint'
                    f'{"s" if len(missing) > 1 else ""} {", ".join(missing)}')
        return ''

    def limit(self, action, snapshot):
        """Return ``action`` as published: clamped, joint targets within a step of measured.

        The decoded values stay in ``action.decoded`` when any was changed.
        """
        if self.kind == 'string':
            return action
        measured = self.measured(snapshot) if self.joint_topic else None
        values = {}
        for name, value in action.values.items():
            if is_plan_field(name):
                values[name] = value
                continue
            value = min(max(value, self.minimum.get(name, value)), self.maximum.get(name, value))
            if measured is not None and name in measured and name in self.max_step:
                at, step = measured[name], self.max_step[name]
                value = min(max(value, at - step), at + step)
            values[name] = float(value)
        if values == action.values:
            return action
        return replace(action, values=values, decoded=dict(action.values))

    # -- fallbacks ------------------------------------------------------------------------
    def stop(self, snapshot):
        """Return the stop action: zeros for a Twist, the measured positions for joint targets.

        Joint targets with no measured position are an empty trajectory (no points), which a
        joint_trajectory_controller takes as: hold where you are.
        """
        if self.kind == 'string':
            return Action('string', {}, text='')
        if self.joint_topic is not None:
            measured = self.measured(snapshot) or {}
            if any(j not in measured for j in self.published):
                return Action(self.kind, dict.fromkeys(self.published))
            return Action(self.kind, {j: measured[j] for j in self.published})
        return Action(self.kind, dict.fromkeys(self.published, 0.0))

    def on_action(self, action, now):
        """Note the action just published at ``now`` (s): the refusal state ends."""
        self.last_action, self.last_action_time = action, now
        self.refusing = False

    def on_refusal(self, mode, now, snapshot):
        """Return the fallback to publish after a refusal at ``now``, or None for silence.

        ``stop``: the stop action; ``hold``: the last action while it is at most
        ``hold_timeout_s`` old, then the stop; ``none``: nothing. With ``repeat`` ``once`` a
        stop goes out once on entering the refusal state, then nothing until the next action,
        so a command multiplexer can hand the base over.
        """
        if mode == 'none':
            return None
        if (mode == 'hold' and self.last_action is not None
                and now - self.last_action_time <= self.hold_timeout_s):
            return self.last_action
        if self.refusing and self.repeat == 'once':
            return None
        self.refusing = True
        return self.stop(snapshot)

    def on_exit(self, snapshot):
        """Return the action every way out of the active state publishes: the stop, always."""
        self.refusing = True
        return self.stop(snapshot)

    def reset(self):
        """Forget the last action (a new activation starts in the refusal state's start)."""
        self.last_action = self.last_action_time = None
        self.refusing = False
