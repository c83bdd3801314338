"""The console scripts' common life: init rclpy, make the node, spin until shut down."""

import rclpy
from rclpy.executors import ExternalShutdownException


def spin_until_shutdown(program, ros_args, make_node, start=None, finish=None):
    """Spin ``make_node()`` until Ctrl-C or an external shutdown; returns the exit code.

    ``start(node)`` runs before spinning and may return a non-zero exit code to stop
    there; ``finish(node)`` runs before the node is destroyed, however the spin ended.
    """
    rclpy.init(args=[program, *ros_args])
    node = None
    try:
        node = make_node()
        if start is not None:
            code = start(node)
            if code:
                return code
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        if node is not None:
            if finish is not None:
                finish(node)
            node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0
