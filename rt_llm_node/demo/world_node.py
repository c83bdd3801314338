"""``rt-llm-demo-world``: the demo world as a ROS 2 node (30 Hz, real topics).

Publishes /scan, /odom, /detections (sensor QoS) and /instruction (reliable,
transient local: once per goal); drives the robot with the latest /cmd_vel
(zero if none arrived for ``cmd_timeout_s``). Episodes follow one another.
"""

import argparse
import json
import sys
import time

from geometry_msgs.msg import Twist
from nav_msgs.msg import Odometry
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import LaserScan
from std_msgs.msg import String

from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.files import write_atomic
from rt_llm_node.qos import INSTRUCTION_QOS
from rt_llm_node.spin import spin_until_shutdown


class DemoWorldNode(Node):
    """Steps a DemoWorld at ``rate_hz`` on the node's timer."""

    def __init__(self, seed=1_000_000, rate_hz=30.0, cmd_timeout_s=0.5):
        super().__init__('rt_llm_demo_world')
        self.seed = seed
        self.cmd_timeout_s = cmd_timeout_s
        self.world = DemoWorld(seed, messages=MessageFactory(ros=True))
        self.cmd = (0.0, 0.0)
        self.cmd_time = 0.0
        self.goals = {'reached': 0, 'timeout': 0}
        self.trajectory = []           # (t, x, y, episode)
        self.episode = 0
        self.pubs = {
            '/scan': self.create_publisher(LaserScan, '/scan', qos_profile_sensor_data),
            '/odom': self.create_publisher(Odometry, '/odom', qos_profile_sensor_data),
            '/detections': self.create_publisher(String, '/detections', qos_profile_sensor_data),
            '/instruction': self.create_publisher(String, '/instruction', INSTRUCTION_QOS),
        }
        self.events = self.create_publisher(String, '~/goal_events', INSTRUCTION_QOS)
        self.create_subscription(Twist, '/cmd_vel', self._on_cmd, 1)
        self.create_timer(1.0 / rate_hz, self._step)

    def layout(self):
        """Return the current episode's arena, pillars, objects and trajectory (for plots)."""
        w = self.world
        return {'arena': w.config.arena, 'obstacles': w.obstacles, 'objects': w.objects,
                'goals': self.goals, 'episode': self.episode,
                'trajectory': [(x, y) for _, x, y, e in self.trajectory if e == self.episode]}

    def _on_cmd(self, msg):
        self.cmd = (msg.linear.x, msg.angular.z)
        self.cmd_time = time.monotonic()

    def _step(self):
        # act, then sense: the newest command moves the robot and the state it reached is
        # published at once, as a physics simulator does. Publishing first and stepping
        # after put the command one more period behind what the model saw (two ticks in
        # all), and the in-process evaluation, where a tick's action moves the robot
        # before the next observation, measured another task (docs/history.md, latency).
        # (the first period has no command yet: the robot stands still for it)
        v, w = self.cmd if time.monotonic() - self.cmd_time < self.cmd_timeout_s else (0.0, 0.0)
        event = self.world.step(v, w)
        if event:
            self.goals[event] += 1
            self.events.publish(String(data=event))
            self.get_logger().info(f'goal {event}: {self.world.results}')
        self.trajectory.append((time.monotonic(), self.world.x, self.world.y, self.episode))
        if self.world.done:
            self.episode += 1
            self.world = DemoWorld(self.seed + self.episode, messages=MessageFactory(ros=True))
        stamp = self.get_clock().now().to_msg()
        for topic, msg in self.world.observe().items():
            if hasattr(msg, 'header'):
                msg.header.stamp = stamp
            self.pubs[topic].publish(msg)


def main(args=None):
    argv = list(sys.argv[1:] if args is None else args)
    ros_args = argv[argv.index('--ros-args'):] if '--ros-args' in argv else []
    parser = argparse.ArgumentParser(prog='rt-llm-demo-world')
    parser.add_argument('--seed', type=int, default=1_000_000)
    parser.add_argument('--record', default=None, help='write the layout and trajectory '
                        '(JSON) here on exit')
    options = parser.parse_args(argv[:len(argv) - len(ros_args)])

    def record(node):
        if options.record:
            write_atomic(options.record, json.dumps(node.layout()), '--record')

    return spin_until_shutdown('rt-llm-demo-world', ros_args,
                               lambda: DemoWorldNode(seed=options.seed), finish=record)


if __name__ == '__main__':
    sys.exit(main())
