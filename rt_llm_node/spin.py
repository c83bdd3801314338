"""The console scripts' common life: init rclpy, make the node, spin until shut down."""

import signal
import sys
import threading

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.executors import SingleThreadedExecutor


def one_line(exc):
    """Return an exception's message on one line (rcl's carry their own newlines)."""
    return ' '.join(str(exc).split()) or type(exc).__name__


def spin_until_shutdown(program, ros_args, make_node, start=None, finish=None):
    """Spin ``make_node()`` until SIGINT, SIGTERM or an external shutdown; return the exit code.

    ``start(node)`` runs before spinning and may return a non-zero exit code to stop there;
    ``finish(node)`` runs before the node is destroyed, however the spin ended, and while the
    ROS context is still valid: rclpy's own signal handlers would shut the context down first,
    so a node could no longer publish on its way out (a robot's stop command, say). The
    script's handlers only ask the spin to end; once it has, SIGTERM is the process's own
    again, so a teardown that hangs (in DDS, say) still ends when launch escalates to it.
    """
    try:
        try:
            from rclpy.signals import SignalHandlerOptions
            rclpy.init(args=[program, *ros_args],
                       signal_handler_options=SignalHandlerOptions.NO)
        except ImportError:   # an rclpy without the option: its handlers shut down on SIGINT
            rclpy.init(args=[program, *ros_args])
    except Exception as exc:   # a parameters file rcl cannot parse, a bad --ros-args
        print(f'{program}: error: {one_line(exc)}', file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    node = executor = None
    try:
        try:
            node = make_node()
        except (KeyboardInterrupt, ExternalShutdownException):
            raise
        except Exception as exc:   # a parameter rclpy refused while declaring it
            print(f'{program}: error: {one_line(exc)}', file=sys.stderr)
            return 2
        if start is not None:
            code = start(node)
            if code:
                return code
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        while not stop.is_set() and rclpy.ok():
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        # the spin has ended: from here a SIGTERM ends the process at once (launch sends one
        # when a SIGINT did not end it in time, and a teardown stuck in the middleware must not
        # outlive it), where the first one only asked the spin to end
        signal.signal(signal.SIGTERM, previous[signal.SIGTERM])
        if executor is not None:
            executor.shutdown()
        if node is not None:
            if finish is not None and rclpy.ok():
                finish(node)
            node.destroy_node()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if rclpy.ok():
            rclpy.shutdown()
    return 0
