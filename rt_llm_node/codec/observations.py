"""Observations to text and token ids: one bounded line per input message.

Renderers read message fields by name, so they take rclpy messages, ``rosbags``'
deserialized messages and the demo world's own messages alike. Each renders one compact
line whose token count is capped per topic.

Units follow REP-103: metres, radians (rendered in whole degrees), m/s, rad/s; angles
counter-clockwise positive, x forward, y left.
"""

from dataclasses import dataclass
from dataclasses import field
import math

import numpy as np


class RenderError(ValueError):
    """A message cannot be rendered (missing field, NaN where a number is needed, ...)."""


# -- observation renderers -------------------------------------------------------------
MAX_MAGNITUDE = 1e6   # a field beyond this is a sensor fault, not something to render
DEFAULT_MIN_VALID = 0.1   # LaserScan: the least share of beams with a valid return


def _number(value, what):
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        raise RenderError(f'{what} is not a number: {value!r}') from None
    if not math.isfinite(value):
        raise RenderError(f'{what} is not finite: {value}')
    if abs(value) > MAX_MAGNITUDE:
        raise RenderError(f'{what} is out of range: {value:.3g} (at most {MAX_MAGNITUDE:.0e})')
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


def scan_sectors(msg, sectors, min_valid=0.0):
    """Minimum range per sector; sector 0 is centred straight ahead, then counter-clockwise.

    A beam is valid when its range is finite and within [range_min, range_max] (+inf means
    nothing within range_max: clear up to it). A scan with fewer than ``min_valid`` of its
    beams valid sees nothing usable: a RenderError, so the tick is refused, not driven blind.
    """
    try:
        ranges = np.asarray(msg.ranges, dtype=np.float64)
    except (TypeError, ValueError):
        raise RenderError('LaserScan.ranges is not a sequence of numbers') from None
    if ranges.ndim != 1 or len(ranges) == 0:
        raise RenderError('LaserScan.ranges is empty')
    range_max = _number(msg.range_max, 'LaserScan.range_max')
    range_min = max(0.0, _number(msg.range_min, 'LaserScan.range_min'))
    angle_min = _number(msg.angle_min, 'LaserScan.angle_min')
    increment = _number(msg.angle_increment, 'LaserScan.angle_increment')
    if range_max <= 0 or increment == 0.0 or range_min > range_max:
        raise RenderError(f'LaserScan has range_max {range_max:g}, range_min {range_min:g}, '
                          f'angle_increment {increment:g}: no range can be valid')
    angles = angle_min + increment * np.arange(len(ranges))
    width = 2.0 * math.pi / sectors
    index = np.round(angles / width).astype(np.int64) % sectors
    ranges = np.where(np.isposinf(ranges), range_max, ranges)
    valid = np.isfinite(ranges) & (ranges >= range_min) & (ranges <= range_max)
    if valid.mean() < min_valid or not valid.any():
        raise RenderError(f'LaserScan sees nothing usable: {int(valid.sum())} of {len(ranges)} '
                          f'beams valid (at least {100 * min_valid:.0f}% needed)')
    out = np.full(sectors, np.inf)
    np.minimum.at(out, index[valid], np.minimum(ranges[valid], range_max))   # exact: a min
    out[np.isinf(out)] = np.nan   # no valid return in the sector
    return out


def render_laser_scan(msg, options):
    """'scan 1.2 3.4 ...': min range per sector (m); '-' for a sector with no valid return."""
    values = scan_sectors(msg, int(options.get('sectors', 8)),
                          float(options.get('min_valid', DEFAULT_MIN_VALID)))
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
    if not names:
        raise RenderError('JointState names no joint')
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
    """Render the text: printable characters only, whitespace collapsed, ``max_chars`` at most."""
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
    """Render inputs to text and token ids, each bounded by its ``max_tokens``."""

    def __init__(self, tokenizer, inputs):
        self.tokenizer = tokenizer
        self.inputs = {spec.topic: spec for spec in inputs}

    def text(self, topic, msg):
        """Render ``msg`` on ``topic`` as one line (RenderError if it cannot be rendered)."""
        spec = self.inputs[topic]
        try:
            line = RENDERERS[spec.msg_type](msg, spec.options)
        except RenderError as exc:
            raise RenderError(f'{topic}: {exc}') from None
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:
            raise RenderError(f'{topic}: malformed {spec.msg_type}: {exc}') from None
        if spec.kind == 'instruction' and not line.strip():
            raise RenderError(f'{topic}: empty instruction: no task, so no motion')
        return f'{spec.prefix} {line}'.strip() if spec.prefix else line

    def encode(self, topic, msg):
        """Token ids of one segment: the line plus a newline, capped at ``max_tokens``.

        A line cut at its cap still ends with the newline, so the next segment starts a line
        of its own.
        """
        ids = self.tokenizer.encode(self.text(topic, msg) + '\n').ids
        cap = self.inputs[topic].max_tokens
        if len(ids) <= cap:
            return ids
        newline = self.tokenizer.encode('\n').ids
        return ids[:max(0, cap - len(newline))] + newline
