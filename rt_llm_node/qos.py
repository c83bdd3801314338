"""QoS profiles the node, the demo world and the live player agree on (rclpy only here)."""

from rclpy.qos import DurabilityPolicy
from rclpy.qos import QoSProfile
from rclpy.qos import ReliabilityPolicy

# Instructions: reliable and latched, so a node that starts (or restarts) after the
# instruction was published still gets it.
INSTRUCTION_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
