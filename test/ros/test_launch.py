"""The launch files as a ROS user runs them: colcon build, then launch from the install space.

The launch system (``launch``, ``launch_ros``, ``ros2launch``) has no wheels; its sources sit
beside the checkout in ``../shared/vendor/ros2-launch`` (see its VERSIONS). The module builds
the package with colcon into a temporary workspace, installs those sources with pip
``--no-deps`` beside it, and runs the launch files through ``ros2launch.api``, the code path
``ros2 launch`` takes. Skipped with the reason where the sources or colcon are absent.
"""

import os
from pathlib import Path
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT  # noqa: I100

rclpy = pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
VENDOR = ROOT.parent / 'shared' / 'vendor' / 'ros2-launch'
LAUNCH_PACKAGES = ('launch/launch', 'launch/launch_xml', 'launch/launch_yaml',
                   'launch_ros/launch_ros', 'launch_ros/ros2launch')
RUN_LAUNCH = ('import sys; from ros2launch.api import launch_a_launch_file; '
              'sys.exit(launch_a_launch_file(launch_file_path=sys.argv[1], '
              'launch_file_arguments=sys.argv[2:]))')

# a DDS domain of their own: a participant another test left behind (a process that exited
# without shutting rclpy down is seen until its lease ends) cannot answer the launched node's
# lifecycle services in its place
DOMAIN = (int(os.environ.get('ROS_DOMAIN_ID', '10')) - 10 + 45) % 90 + 10

pytestmark = pytest.mark.skipif(not VENDOR.is_dir(),
                                reason=f'the launch sources are not at {VENDOR}')


def run(command, cwd, **kwargs):
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    """Build the package with colcon and install the launch sources; return the run env."""
    pytest.importorskip('colcon_core', reason='colcon-core (the test extra) is not installed')
    top = tmp_path_factory.mktemp('colcon')
    source = top / 'ws' / 'src' / 'rt_llm_node'
    files = subprocess.run(['git', 'ls-files', '-co', '--exclude-standard'], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    if not files:   # not a git checkout: take the tree as it is
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob('*') if p.is_file()
                 and not any(part.startswith('.') for part in p.relative_to(ROOT).parts)]
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, '-m', 'colcon', '--log-base', str(top / 'log'), 'build'],
        cwd=top / 'ws')
    prefix = top / 'ws' / 'install' / 'rt_llm_node'
    copies, site = top / 'launch_src', top / 'site'
    for package in LAUNCH_PACKAGES:   # the vendor folder is read-only: build from copies
        shutil.copytree(VENDOR / package, copies / Path(package).name,
                        ignore=shutil.ignore_patterns('build', '*.egg-info'))
    run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--no-build-isolation',
         '--target', str(site), *[str(copies / Path(p).name) for p in LAUNCH_PACKAGES]],
        cwd=top)
    shutil.copytree(VENDOR / 'stubs' / 'composition_interfaces',
                    site / 'composition_interfaces')
    packages = next(prefix.glob('lib/python*/site-packages'))
    env = dict(os.environ, AMENT_PREFIX_PATH=str(prefix), ROS_DOMAIN_ID=str(DOMAIN),
               PYTHONPATH=os.pathsep.join([str(site), str(packages)]))
    return prefix, env


def launch(prefix, env, name, *arguments):
    return subprocess.Popen([sys.executable, '-c', RUN_LAUNCH,
                             str(prefix / 'share' / 'rt_llm_node' / 'launch' / name),
                             *arguments], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


class Listener:
    """A node of the test's own that counts the actions on /cmd_vel."""

    def __init__(self):
        from geometry_msgs.msg import Twist
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=DOMAIN)
        self.node = rclpy.create_node('launch_test_listener', context=self.context)
        self.count, self.enough, self.last = 0, threading.Event(), None
        self.node.create_subscription(Twist, '/cmd_vel', self._action, 10)
        self.executor = rclpy.executors.SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _action(self, msg):
        self.count += 1
        self.last = msg
        if self.count >= 60:
            self.enough.set()

    def close(self):
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)
        self.thread.join(timeout=5)


def stop(process, timeout=30):
    """Interrupt a launch as Ctrl-C does and return its output; every child must be gone.

    A terminal's Ctrl-C reaches the whole foreground process group, and launch then leaves
    the children to that SIGINT (it signals them itself only after its grace period, with
    SIGTERM): so the group is signalled here, and every process must have exited on the
    SIGINT alone.
    """
    os.killpg(process.pid, signal.SIGINT)
    try:
        log, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert 'escalating to' not in log, log[-3000:]
    return log


def test_the_demo_launches_from_the_install_space_acts_and_stops_on_ctrl_c(installed):
    prefix, env = installed
    assert (prefix / 'lib' / 'rt_llm_node' / 'rt-llm-node').is_file()
    listener = Listener()
    process = launch(prefix, env, 'demo.launch.py')
    try:
        acted = listener.enough.wait(timeout=90)
    finally:
        log = stop(process)
        time.sleep(0.5)   # the stop action is in flight
        listener.close()
    assert acted, f'{listener.count} actions on /cmd_vel in 90 s:\n{log[-3000:]}'
    # the robot is left standing: the node's last command is the stop it published on Ctrl-C
    last = listener.last
    assert (last.linear.x, last.linear.y, last.angular.z) == (0.0, 0.0, 0.0), last
    assert process.returncode == 0, log[-3000:]
    assert 'configured in' in log and 'Traceback' not in log, log[-3000:]
    assert 'process has finished cleanly' in log
    # every process the launch started ended with it
    time.sleep(0.5)
    leftover = subprocess.run(['pgrep', '-s', str(process.pid)], capture_output=True,
                              text=True).stdout.split()
    assert not leftover, f'processes left running: {leftover}'


def test_the_managed_launch_without_autostart_leaves_the_node_unconfigured(installed):
    prefix, env = installed
    params = prefix / 'share' / 'rt_llm_node' / 'config' / 'demo.yaml'
    process = launch(prefix, env, 'rt_llm.launch.py', f'params_file:={params}',
                     'autostart:=false')
    try:
        from lifecycle_msgs.srv import GetState
        context = rclpy.Context()
        rclpy.init(context=context, domain_id=DOMAIN)
        node = rclpy.create_node('launch_test_state', context=context)
        client = node.create_client(GetState, '/rt_llm_node/get_state')
        try:
            assert client.wait_for_service(timeout_sec=60), 'no lifecycle services'
            future = client.call_async(GetState.Request())
            executor = rclpy.executors.SingleThreadedExecutor(context=context)
            executor.add_node(node)
            executor.spin_until_future_complete(future, timeout_sec=10)
            executor.shutdown()
            assert future.result() is not None
            assert future.result().current_state.label == 'unconfigured'
        finally:
            node.destroy_node()
            rclpy.shutdown(context=context)
    finally:
        log = stop(process)
    assert process.returncode == 0 and 'Traceback' not in log, log[-3000:]


@pytest.mark.parametrize('argument,message', [
    ('autostart:=flase', 'Argument "autostart" provided value "flase" is not valid'),
    ('params_file:=/nonexistent/params.yaml', 'params_file'),
])
def test_a_bad_launch_argument_fails_before_any_process_starts(installed, argument, message):
    prefix, env = installed
    process = launch(prefix, env, 'rt_llm.launch.py', argument)
    try:
        log, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0, log[-3000:]
    assert message in log, log[-3000:]
    assert 'process started' not in log, log[-3000:]


def test_a_namespace_sim_time_and_log_level_reach_the_node_and_its_params_section(installed):
    """Under namespace robot1 the demo file's section keyed by the bare node name applies."""
    prefix, env = installed
    params = prefix / 'share' / 'rt_llm_node' / 'config' / 'demo.yaml'
    process = launch(prefix, env, 'rt_llm.launch.py', f'params_file:={params}',
                     'autostart:=false', 'namespace:=robot1', 'use_sim_time:=true',
                     'log_level:=debug')
    try:
        from rcl_interfaces.srv import GetParameters
        context = rclpy.Context()
        rclpy.init(context=context, domain_id=DOMAIN)
        node = rclpy.create_node('launch_test_params', context=context)
        client = node.create_client(GetParameters, '/robot1/rt_llm_node/get_parameters')
        try:
            assert client.wait_for_service(timeout_sec=60), 'no /robot1/rt_llm_node'
            executor = rclpy.executors.SingleThreadedExecutor(context=context)
            executor.add_node(node)
            names = ['use_sim_time', 'kv_capacity_tokens', 'system_prompt']
            values = None
            end = time.monotonic() + 30
            while time.monotonic() < end:   # the section is applied right after start-up
                future = client.call_async(GetParameters.Request(names=names))
                executor.spin_until_future_complete(future, timeout_sec=10)
                values = future.result().values
                if values[1].integer_value == 256:
                    break
                time.sleep(0.2)
            executor.shutdown()
        finally:
            node.destroy_node()
            rclpy.shutdown(context=context)
    finally:
        log = stop(process)
    assert values[0].bool_value is True, 'use_sim_time'
    assert values[1].integer_value == 256, 'the demo section (kv_capacity_tokens 256)'
    assert values[2].string_value == 'go to the object in the task'
    assert '[DEBUG]' in log and "section 'rt_llm_node' applied to /robot1/rt_llm_node" in log
    assert process.returncode == 0 and 'Traceback' not in log, log[-3000:]
