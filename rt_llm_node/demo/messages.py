"""Message objects for the demo world: real ROS classes when importable, else plain twins.

The plain twins carry the same field names (that is all the renderers read), so
the world can make training data on a machine without ROS, such as the GPU one.
"""

import math
from types import SimpleNamespace

try:  # pragma: no cover - which branch runs depends on the machine
    from geometry_msgs.msg import Twist as RosTwist
    from nav_msgs.msg import Odometry as RosOdometry
    from sensor_msgs.msg import LaserScan as RosLaserScan
    from std_msgs.msg import String as RosString
    HAVE_ROS = True
except ImportError:
    HAVE_ROS = False


def _ns(**fields):
    return SimpleNamespace(**fields)


def _vector(x=0.0, y=0.0, z=0.0):
    return _ns(x=x, y=y, z=z)


class MessageFactory:
    """Build the demo world's messages; ``ros=None`` picks ROS classes when available."""

    def __init__(self, ros=None):
        self.ros = HAVE_ROS if ros is None else bool(ros)
        if self.ros and not HAVE_ROS:
            raise RuntimeError('ROS message packages are not importable')

    def laser_scan(self, ranges, angle_min, angle_increment, range_min, range_max):
        if self.ros:
            msg = RosLaserScan()
            msg.header.frame_id = 'base_scan'
            msg.angle_min = float(angle_min)
            msg.angle_max = float(angle_min + angle_increment * (len(ranges) - 1))
            msg.angle_increment = float(angle_increment)
            msg.range_min = float(range_min)
            msg.range_max = float(range_max)
            msg.ranges = [float(r) for r in ranges]
            return msg
        return _ns(angle_min=float(angle_min),
                   angle_max=float(angle_min + angle_increment * (len(ranges) - 1)),
                   angle_increment=float(angle_increment), range_min=float(range_min),
                   range_max=float(range_max), ranges=[float(r) for r in ranges])

    def odometry(self, x, y, yaw, v, w):
        qz, qw = math.sin(yaw / 2.0), math.cos(yaw / 2.0)
        if self.ros:
            msg = RosOdometry()
            msg.header.frame_id = 'odom'
            msg.child_frame_id = 'base_link'
            msg.pose.pose.position.x = float(x)
            msg.pose.pose.position.y = float(y)
            msg.pose.pose.orientation.z = qz
            msg.pose.pose.orientation.w = qw
            msg.twist.twist.linear.x = float(v)
            msg.twist.twist.angular.z = float(w)
            return msg
        pose = _ns(position=_vector(float(x), float(y)),
                   orientation=_ns(x=0.0, y=0.0, z=qz, w=qw))
        twist = _ns(linear=_vector(float(v)), angular=_vector(0.0, 0.0, float(w)))
        return _ns(pose=_ns(pose=pose), twist=_ns(twist=twist))

    def string(self, text):
        if self.ros:
            return RosString(data=text)
        return _ns(data=text)

    def twist(self, v, w):
        if self.ros:
            msg = RosTwist()
            msg.linear.x = float(v)
            msg.angular.z = float(w)
            return msg
        return _ns(linear=_vector(float(v)), angular=_vector(0.0, 0.0, float(w)))
