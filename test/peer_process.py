"""Separate processes for node tests: the demo world feeds the inputs, a recorder listens.

    python test/peer_process.py world SECONDS
    python test/peer_process.py recorder SECONDS OUT.json

Writes {"refusals": [[receive_ns, deadline_ns, reason, tick], ...], "actions": [[ns, v, w]]}.
"""

import json
import sys
import time

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from diagnostic_msgs.msg import DiagnosticArray  # noqa: I100
from geometry_msgs.msg import Twist

from rt_llm_node.demo.world_node import DemoWorldNode


class Recorder(Node):
    def __init__(self):
        super().__init__('peer_recorder')
        self.refusals, self.actions = [], []
        self.create_subscription(DiagnosticArray, '/rt_llm_node/refusal', self._refusal, 100)
        self.create_subscription(Twist, '/cmd_vel', self._action, 10)

    def _refusal(self, msg):
        now = self.get_clock().now().nanoseconds
        values = {kv.key: kv.value for kv in msg.status[0].values}
        self.refusals.append([now, int(values['deadline_stamp']), values['reason'],
                              int(values['tick']), int(values['published_stamp'])])

    def _action(self, msg):
        self.actions.append([self.get_clock().now().nanoseconds, msg.linear.x, msg.angular.z])


def main():
    role, seconds = sys.argv[1], float(sys.argv[2])
    rclpy.init()
    node = DemoWorldNode() if role == 'world' else Recorder()
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            executor.spin_once(timeout_sec=0.05)
    except (KeyboardInterrupt, ExternalShutdownException):  # the test is done with us
        pass
    if role == 'recorder':
        with open(sys.argv[3], 'w') as f:
            json.dump({'refusals': node.refusals, 'actions': node.actions}, f)
    executor.shutdown()
    if rclpy.ok():
        rclpy.shutdown()


if __name__ == '__main__':
    main()
