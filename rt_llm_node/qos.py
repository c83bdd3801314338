"""QoS profiles the node, the demo world and the live player agree on (rclpy only here)."""

from rclpy.qos import DurabilityPolicy
from rclpy.qos import QoSProfile
from rclpy.qos import ReliabilityPolicy

# Instructions: reliable and latched, so a node that starts (or restarts) after the
# instruction was published still gets it.
INSTRUCTION_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
# What a default publisher offers (``ros2 topic pub``): reliable, volatile. A latched
# subscription cannot match it, so the node subscribes an instruction with both profiles.
INSTRUCTION_VOLATILE_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                                      durability=DurabilityPolicy.VOLATILE)
