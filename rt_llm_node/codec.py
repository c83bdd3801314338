"""Observations to text and text to actions: the model's input and output language.

Observation renderers read message fields by name, so they take rclpy messages,
``rosbags``' deserialized messages and the demo world's own messages alike.
Each renders one compact line whose token count is bounded per topic.

Actions are decoded under a grammar: each field's permitted values, formatted at
fixed width, are tokenized with the model's tokenizer into a token trie at
configure, so constrained decoding can only produce a parsable action. Parsed
values are clamped to the configured limits and are never NaN.

Units follow REP-103: metres, radians (rendered in whole degrees), m/s, rad/s;
angles counter-clockwise positive, x forward, y left.
"""

from dataclasses import dataclass
from dataclasses import field
import math
from typing import Optional

import numpy as np


class RenderError(ValueError):
    """A message cannot be rendered (missing field, NaN where a number is needed, ...)."""


class GrammarError(ValueError):
    """An action schema cannot be expressed with this tokenizer, or is invalid."""


# -- observation renderers -------------------------------------------------------------
def _number(value, what):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RenderError(f'{what} is not a number: {value!r}') from None
    if not math.isfinite(value):
        raise RenderError(f'{what} is not finite: {value}')
    return value


def _fmt(value, decimals=1):
    text = f'{value:.{decimals}f}'
    return text.lstrip('-') if float(text) == 0.0 else text  # never '-0.0'


def yaw_from_quaternion(q):
    """Yaw (rad) of a geometry_msgs/Quaternion (REP-103: about +z, CCW positive)."""
    x, y, z, w = (_number(getattr(q, k), f'orientation.{k}') for k in 'xyzw')
    norm = math.sqrt(x * x + y * y + z * z + w * w)
    if norm < 1e-6:
        raise RenderError('orientation quaternion has zero length')
    return math.atan2(2.0 * (w * z + x * y), 1.0 - 2.0 * (y * y + z * z))


def scan_sectors(msg, sectors):
    """Minimum range per sector; sector 0 is centred straight ahead, then counter-clockwise."""
    ranges = np.asarray(msg.ranges, dtype=np.float64)
    if ranges.ndim != 1 or len(ranges) == 0:
        raise RenderError('LaserScan.ranges is empty')
    range_max = _number(msg.range_max, 'LaserScan.range_max')
    range_min = _number(msg.range_min, 'LaserScan.range_min')
    angle_min = _number(msg.angle_min, 'LaserScan.angle_min')
    increment = _number(msg.angle_increment, 'LaserScan.angle_increment')
    if range_max <= 0 or increment == 0.0:
        raise RenderError('LaserScan has range_max <= 0 or angle_increment == 0')
    angles = angle_min + increment * np.arange(len(ranges))
    width = 2.0 * math.pi / sectors
    index = np.round(angles / width).astype(np.int64) % sectors
    ranges = np.where(np.isposinf(ranges), range_max, ranges)
    valid = np.isfinite(ranges) & (ranges >= range_min)
    out = np.full(sectors, np.inf)
    np.minimum.at(out, index[valid], np.minimum(ranges[valid], range_max))   # exact: a min
    out[np.isinf(out)] = np.nan   # no valid return in the sector
    return out


def render_laser_scan(msg, options):
    """'scan 1.2 3.4 ...': min range per sector (m); '-' for a sector with no valid return."""
    values = scan_sectors(msg, int(options.get('sectors', 8)))
    return 'scan ' + ' '.join('-' if np.isnan(v) else _fmt(v) for v in values)


def render_odometry(msg, options):
    """'odom x 1.2 y -0.4 yaw 90 v 0.3 w -0.1': pose (m, deg), body velocity (m/s, rad/s)."""
    pose, twist = msg.pose.pose, msg.twist.twist
    x = _number(pose.position.x, 'pose.position.x')
    y = _number(pose.position.y, 'pose.position.y')
    yaw = round(math.degrees(yaw_from_quaternion(pose.orientation)))
    v = _number(twist.linear.x, 'twist.linear.x')
    w = _number(twist.angular.z, 'twist.angular.z')
    return f'odom x {_fmt(x)} y {_fmt(y)} yaw {yaw} v {_fmt(v)} w {_fmt(w)}'


def render_imu(msg, options):
    """'imu wz 0.12 ax 0.1 ay 0.0 roll 0 pitch 2': yaw rate, planar accel, tilt (deg)."""
    q = msg.orientation
    x, y, z, w = (_number(getattr(q, k), f'orientation.{k}') for k in 'xyzw')
    roll = math.degrees(math.atan2(2 * (w * x + y * z), 1 - 2 * (x * x + y * y)))
    pitch = math.degrees(math.asin(max(-1.0, min(1.0, 2 * (w * y - z * x)))))
    wz = _number(msg.angular_velocity.z, 'angular_velocity.z')
    ax = _number(msg.linear_acceleration.x, 'linear_acceleration.x')
    ay = _number(msg.linear_acceleration.y, 'linear_acceleration.y')
    return (f'imu wz {_fmt(wz, 2)} ax {_fmt(ax)} ay {_fmt(ay)} roll {round(roll)} '
            f'pitch {round(pitch)}')


def render_joint_state(msg, options):
    """'joints elbow 0.52 wrist -1.10': positions (rad or m), at most ``max_joints``."""
    names = list(msg.name)[:int(options.get('max_joints', 8))]
    positions = list(msg.position)
    if len(positions) < len(names):
        raise RenderError(f'JointState has {len(names)} names but {len(positions)} positions')
    parts = [f'{_sanitize(n, 24)} {_fmt(_number(p, f"position of {n}"), 2)}'
             for n, p in zip(names, positions)]
    return 'joints ' + ' '.join(parts)


def render_twist(msg, options):
    """'twist v 0.3 w -0.2': commanded linear.x (m/s) and angular.z (rad/s)."""
    v = _number(msg.linear.x, 'linear.x')
    w = _number(msg.angular.z, 'angular.z')
    return f'twist v {_fmt(v)} w {_fmt(w)}'


def _sanitize(text, max_chars):
    if not isinstance(text, str):
        raise RenderError(f'expected text, got {type(text).__name__}')
    printable = ''.join(c if c.isprintable() else ' ' for c in text[:max_chars * 4])
    return ' '.join(printable.split())[:max_chars]


def render_string(msg, options):
    """The text, printable characters only, whitespace collapsed, capped at ``max_chars``."""
    return _sanitize(msg.data, int(options.get('max_chars', 160)))


RENDERERS = {
    'sensor_msgs/msg/LaserScan': render_laser_scan,
    'nav_msgs/msg/Odometry': render_odometry,
    'sensor_msgs/msg/Imu': render_imu,
    'sensor_msgs/msg/JointState': render_joint_state,
    'geometry_msgs/msg/Twist': render_twist,
    'std_msgs/msg/String': render_string,
}


def normalize_type(type_name):
    """'sensor_msgs/LaserScan' or 'sensor_msgs/msg/LaserScan' -> 'sensor_msgs/msg/LaserScan'."""
    parts = type_name.strip().split('/')
    if len(parts) == 2:
        parts = [parts[0], 'msg', parts[1]]
    normalized = '/'.join(parts)
    if normalized not in RENDERERS:
        raise ValueError(f'unsupported input type {type_name!r} '
                         f'(supported: {", ".join(sorted(RENDERERS))})')
    return normalized


@dataclass
class InputSpec:
    """One subscribed topic: how to render it and when it is too old."""

    topic: str
    msg_type: str                  # e.g. 'sensor_msgs/msg/LaserScan'
    max_age_s: float = 0.5
    required: bool = True
    kind: str = 'observation'      # or 'instruction' (rendered once per new message)
    prefix: str = ''               # text before the rendered line, e.g. 'det'
    max_tokens: int = 48
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        self.msg_type = normalize_type(self.msg_type)
        if self.kind not in ('observation', 'instruction'):
            raise ValueError(f'input {self.topic}: kind must be observation or instruction')
        if not (self.max_age_s > 0 and self.max_tokens > 0):
            raise ValueError(f'input {self.topic}: max_age_s and max_tokens must be positive')


class ObservationCodec:
    """Renders inputs to text and token ids, each bounded by its ``max_tokens``."""

    def __init__(self, tokenizer, inputs):
        self.tokenizer = tokenizer
        self.inputs = {spec.topic: spec for spec in inputs}

    def text(self, topic, msg):
        """Rendered line for ``msg`` on ``topic`` (RenderError if it cannot be rendered)."""
        spec = self.inputs[topic]
        try:
            line = RENDERERS[spec.msg_type](msg, spec.options)
        except RenderError:
            raise
        except (AttributeError, TypeError, ValueError) as exc:
            raise RenderError(f'{topic}: malformed {spec.msg_type}: {exc}') from None
        return f'{spec.prefix} {line}'.strip() if spec.prefix else line

    def encode(self, topic, msg):
        """Token ids of one segment: the line plus a newline, capped at ``max_tokens``."""
        ids = self.tokenizer.encode(self.text(topic, msg) + '\n').ids
        cap = self.inputs[topic].max_tokens
        return ids if len(ids) <= cap else ids[:cap]


# -- action grammar ---------------------------------------------------------------------
class TokenTrie:
    """Token-id sequences of a finite set of strings, with the value each one spells."""

    def __init__(self):
        self.children = {}
        self.value = None
        self.terminal = False
        self._allowed = None

    def insert(self, ids, value):
        node = self
        for token in ids:
            node = node.children.setdefault(int(token), TokenTrie())
        if node.terminal and node.value != value:
            raise GrammarError(f'two values tokenize identically: {node.value!r}, {value!r}')
        if node.children:
            raise GrammarError(f'{value!r} is a token prefix of another value')
        node.terminal, node.value = True, value

    def shortest(self):
        """Fewest tokens from here to a complete value (cached)."""
        if not hasattr(self, '_shortest'):
            self._shortest = 0 if self.terminal else 1 + min(
                c.shortest() for c in self.children.values())
        return self._shortest

    def allowed(self):
        """Sorted int64 array of the tokens that may follow here (cached)."""
        if self._allowed is None:
            self._allowed = np.array(sorted(self.children), dtype=np.int64)
        return self._allowed


def _steps(minimum, maximum, step):
    count = int(round((maximum - minimum) / step)) + 1
    if count < 1 or count > 4096 or not math.isclose(minimum + (count - 1) * step, maximum,
                                                     rel_tol=0, abs_tol=step * 1e-6):
        raise GrammarError(f'range [{minimum}, {maximum}] is not a whole number of {step} steps')
    return [minimum + i * step for i in range(count)]


@dataclass
class ActionField:
    """One numeric action field: which message field, limits, quantization, and its text key."""

    name: str            # message field, e.g. 'linear.x' or a joint name
    key: str             # text key, e.g. 'v'
    minimum: float
    maximum: float
    step: float

    def __post_init__(self):
        for what in ('minimum', 'maximum', 'step'):
            if not math.isfinite(getattr(self, what)):
                raise GrammarError(f'action field {self.name}: {what} must be finite')
        if self.step <= 0 or self.maximum < self.minimum:
            raise GrammarError(f'action field {self.name}: need step > 0 and max >= min')
        self.values = _steps(self.minimum, self.maximum, self.step)
        decimals = next(d for d in range(7)
                        if abs(self.step * 10 ** d - round(self.step * 10 ** d)) < 1e-6)
        self.decimals = decimals
        width = max(len(f'{abs(v):.{decimals}f}') for v in self.values)
        self.width = width

    def text(self, value):
        """Fixed-width text of one quantized value, e.g. 'v+0.40' (never a prefix of another)."""
        return f'{self.key}{"-" if value < 0 else "+"}{abs(value):0{self.width}.{self.decimals}f}'

    def quantize(self, value):
        """The permitted value nearest to ``value`` (clamped; NaN goes to 0 or the minimum)."""
        if not math.isfinite(value):
            value = 0.0
        value = min(max(value, self.minimum), self.maximum)
        return self.values[int(round((value - self.minimum) / self.step))]


@dataclass
class Action:
    """A parsed, clamped action: numeric fields by name, or text."""

    kind: str                       # 'twist', 'joint_trajectory' or 'string'
    values: dict = field(default_factory=dict)
    text: str = ''
    token_ids: tuple = ()


class FieldGrammar:
    """Actions as ``prefix`` then one fixed-width word per field, then a newline."""

    def __init__(self, tokenizer, kind, fields, prefix='act'):
        if not fields:
            raise GrammarError('an action schema needs at least one field')
        self.tokenizer = tokenizer
        self.kind = kind
        self.fields = list(fields)
        self.prefix = prefix
        self.prefix_ids = tokenizer.encode(prefix).ids if prefix else []
        self.end_ids = tokenizer.encode('\n').ids
        self.tries = []
        for f in self.fields:
            trie = TokenTrie()
            for value in f.values:
                trie.insert(self._word_ids(f.text(value)), value)
            self.tries.append(trie)
        self._check_round_trip()

    def field(self, name):
        """The ActionField of message field (or plan field) ``name``."""
        for f in self.fields:
            if f.name == name:
                return f
        raise GrammarError(f'the action has no field {name!r}')

    def _word_ids(self, word):
        """Ids of ``' ' + word`` as it appears after the prefix (tokenized in context)."""
        base = self.tokenizer.encode(self.prefix).ids
        both = self.tokenizer.encode(self.prefix + ' ' + word).ids
        if both[:len(base)] != base:
            raise GrammarError(f'tokenizer merges action word {word!r} into the prefix')
        return both[len(base):]

    def _check_round_trip(self):
        """Every field word must tokenize the same inside a whole action as alone."""
        for f in self.fields:
            for value in (f.values[0], f.values[-1], f.values[len(f.values) // 2]):
                words = [g.text(value if g is f else g.values[0]) for g in self.fields]
                whole = self.tokenizer.encode(self.render_words(words)).ids
                parts = list(self.prefix_ids)
                for word in words:
                    parts += self._word_ids(word)
                parts += self.end_ids
                if whole != parts:
                    raise GrammarError(f'action words do not tokenize independently with this '
                                       f'tokenizer (field {f.name}); choose other keys or steps')

    def render_words(self, words):
        return ' '.join([self.prefix, *words]) + '\n' if self.prefix else ' '.join(words) + '\n'

    def render(self, values):
        """Text of an action given field values (quantized first); used to make training data."""
        return self.render_words([f.text(f.quantize(values[f.name])) for f in self.fields])

    def typical_decode_tokens(self):
        """Tokens of an action whose every field takes its median-length value."""
        return sum(sorted(len(self._word_ids(f.text(v))) for v in f.values)[len(f.values) // 2]
                   for f in self.fields)

    # decoding state: (field index, trie node, chosen values)
    def start(self):
        return (0, self.tries[0], ())

    def allowed(self, state):
        return state[1].allowed()

    def advance(self, state, token):
        index, node, chosen = state
        child = node.children.get(int(token))
        if child is None:
            raise GrammarError(f'token {token} is not allowed here')
        if child.terminal:
            chosen = chosen + (child.value,)
            index += 1
            return (index, self.tries[index] if index < len(self.tries) else None, chosen)
        return (index, child, chosen)

    def done(self, state):
        return state[0] >= len(self.tries)

    def min_remaining(self, state):
        """Fewest tokens still to choose before the action is complete."""
        index, node, _ = state
        if index >= len(self.tries):
            return 0
        return node.shortest() + sum(t.shortest() for t in self.tries[index + 1:])

    def action(self, state, token_ids=()):
        """The clamped Action of a finished state."""
        values = {f.name: float(f.quantize(v)) for f, v in zip(self.fields, state[2])}
        return Action(self.kind, values, token_ids=tuple(token_ids))

    def parse(self, text):
        """Parse action text (e.g. from a log) into a clamped Action; GrammarError if invalid."""
        words = text.split()
        if self.prefix:
            if not words or words[0] != self.prefix:
                raise GrammarError(f'action text does not start with {self.prefix!r}')
            words = words[1:]
        if len(words) != len(self.fields):
            raise GrammarError(f'expected {len(self.fields)} fields, got {len(words)}')
        values = {}
        for f, word in zip(self.fields, words):
            if not word.startswith(f.key):
                raise GrammarError(f'expected field {f.key!r}, got {word!r}')
            try:
                values[f.name] = float(f.quantize(float(word[len(f.key):])))
            except ValueError:
                raise GrammarError(f'bad number in {word!r}') from None
        return Action(self.kind, values)


def is_plan_field(name):
    """A field named '_...' is decoded like any other (constrained, before the fields after
    it) and kept in the tick's records, but never published: a plan the policy states
    first and conditions the command on (e.g. the demo's '_aim', the bearing it steers for)."""
    return name.startswith('_')


def twist_grammar(tokenizer, fields, prefix='act'):
    """Grammar for geometry_msgs/Twist; ``fields``: dicts with name, key, min, max, step."""
    allowed = {'linear.x', 'linear.y', 'linear.z', 'angular.x', 'angular.y', 'angular.z'}
    specs = []
    for f in fields:
        if f['name'] not in allowed and not is_plan_field(f['name']):
            raise GrammarError(f"Twist has no field {f['name']!r} (one of {sorted(allowed)}, "
                               "or a plan field named '_...')")
        specs.append(ActionField(f['name'], f['key'], float(f['min']), float(f['max']),
                                 float(f['step'])))
    return FieldGrammar(tokenizer, 'twist', specs, prefix)


def joint_trajectory_grammar(tokenizer, joints, prefix='act'):
    """Grammar for trajectory_msgs/JointTrajectory: one position per joint."""
    specs = [ActionField(j['name'], f'j{i}', float(j['min']), float(j['max']),
                         float(j['step'])) for i, j in enumerate(joints)]
    return FieldGrammar(tokenizer, 'joint_trajectory', specs, prefix)


class StringGrammar:
    """Free text of at most ``max_tokens`` tokens, ended by ``stop_text`` (std_msgs/String)."""

    kind = 'string'

    def __init__(self, tokenizer, max_tokens=16, stop_text='\n', prefix='say'):
        if max_tokens < 1:
            raise GrammarError('max_tokens must be at least 1')
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.stop_text = stop_text
        self.prefix = prefix
        self.prefix_ids = tokenizer.encode(prefix).ids if prefix else []
        self.end_ids = tokenizer.encode('\n').ids
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self._all = np.arange(vocab, dtype=np.int64)

    def typical_decode_tokens(self):
        return self.max_tokens

    def start(self):
        return ()

    def allowed(self, state):
        return self._all

    def advance(self, state, token):
        return state + (int(token),)

    def min_remaining(self, state):
        return 0 if self.done(state) else 1

    def done(self, state):
        return (len(state) >= self.max_tokens
                or (self.stop_text and self.stop_text in self.tokenizer.decode(list(state))))

    def action(self, state, token_ids=()):
        text = self.tokenizer.decode(list(state))
        if self.stop_text and self.stop_text in text:
            text = text.split(self.stop_text, 1)[0]
        return Action('string', {}, text=_sanitize(text, 1000), token_ids=tuple(token_ids))

    def render(self, values):
        return f'{self.prefix} {values}{self.stop_text}'


def fallback_values(grammar, mode: str, last: Optional[Action]):
    """Values of the fallback action: 'stop' -> zeros (clamped), 'hold' -> the last action."""
    if mode == 'hold' and last is not None:
        return last
    if grammar.kind == 'string':
        return Action('string', {}, text='')
    return Action(grammar.kind, {f.name: float(f.quantize(0.0)) for f in grammar.fields})


def action_message(action, action_type, period_s, make):
    """The Action as a message of ``action_type``, built by ``make(type_name, **fields)``.

    The node passes rclpy's message classes, replay plain namespaces: one mapping from
    grammar fields to message fields for both. A JointTrajectory has one point, due one
    tick period from now.
    """
    published = {name: value for name, value in action.values.items()
                 if not is_plan_field(name)}
    if action_type == 'geometry_msgs/msg/Twist':
        groups = {'linear': {}, 'angular': {}}
        for name, value in published.items():
            group, axis = name.split('.')
            groups[group][axis] = float(value)
        return make(action_type, **{group: make('geometry_msgs/msg/Vector3', **axes)
                                    for group, axes in groups.items()})
    if action_type == 'std_msgs/msg/String':
        return make(action_type, data=action.text)
    period_ns = int(round(period_s * 1e9))
    due = make('builtin_interfaces/msg/Duration', sec=period_ns // 1_000_000_000,
               nanosec=period_ns % 1_000_000_000)
    point = make('trajectory_msgs/msg/JointTrajectoryPoint',
                 positions=[float(v) for v in published.values()], time_from_start=due)
    return make(action_type, joint_names=list(published), points=[point])
