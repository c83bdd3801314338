"""Helpers of the tests over real DDS: the rig's nodes, lifecycle transitions, discovery.

The fixtures ``executor`` and ``rig`` (in conftest.py) are built from these.
"""

import time

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import Twist
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.node import Node

from rt_llm_node.demo.run import demo_parameters


def transition(node, name, timeout=60.0):
    """Run ``node.trigger_<name>()`` on the node's executor thread; its result."""
    task = node.executor.create_task(getattr(node, f'trigger_{name}'))
    end = time.monotonic() + timeout
    while not task.done():
        assert time.monotonic() < end, f'{name} did not finish in {timeout} s'
        time.sleep(0.01)
    return task.result()


class Recorder(Node):
    """Subscribes to the node's outputs and keeps (receive ROS time, message)."""

    def __init__(self, name='recorder'):
        super().__init__(name)
        self.actions, self.refusals = [], []
        self.create_subscription(Twist, '/cmd_vel', lambda m: self.actions.append(
            (self.get_clock().now(), m)), 10)
        self.create_subscription(DiagnosticArray, '/rt_llm_node/refusal',
                                 lambda m: self.refusals.append((self.get_clock().now(), m)),
                                 100)


def wait_for_peers(node, inputs=None, timeout=30.0):
    """Block until the inputs arrive and the outputs have subscribers (DDS discovery).

    ``inputs``: how many inputs to wait for (None: every demo input).
    """
    if inputs is None:
        inputs = len(demo_parameters()['input_topics'])
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (len(node._buffer.snapshot()) >= inputs
                and node._refusal_pub.get_subscription_count() >= 1
                and node._action_pub.get_subscription_count() >= 1):
            time.sleep(0.3)
            return
        time.sleep(0.1)
    inputs = sorted(node._buffer.snapshot())
    raise AssertionError(f'peers not discovered in time: inputs {inputs}, '
                         f'refusal subscribers {node._refusal_pub.get_subscription_count()}, '
                         f'action subscribers {node._action_pub.get_subscription_count()}')


def start(node, inputs=None):
    """Configure, wait for DDS discovery, activate."""
    assert transition(node, 'configure') == TransitionCallbackReturn.SUCCESS
    wait_for_peers(node, inputs)
    transition(node, 'activate')


def reasons(recorder):
    return [m.status[0].message for _, m in recorder.refusals]
