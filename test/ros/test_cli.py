"""The console scripts as processes: rt-llm-node --autostart, rt-llm-demo-world."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT  # noqa: I100


def test_autostart_console_script_configures_activates_and_stops_on_sigint(tmp_path):
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    params = tmp_path / 'params.yaml'
    params.write_text(open(os.path.join(ROOT, 'config', 'demo.yaml')).read().replace(
        'backend: auto', 'backend: numpy'))
    out = tmp_path / 'peer.json'
    script = os.path.join(ROOT, 'test', 'peer_process.py')
    recorder = subprocess.Popen([sys.executable, script, 'recorder', '60', str(out)])
    node = subprocess.Popen([sys.executable, '-m', 'rt_llm_node.node', '--autostart',
                             '--ros-args', '--params-file', str(params)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(4.0)
            break
        time.sleep(4.0)
    finally:
        node.send_signal(signal.SIGINT)
        log, _ = node.communicate(timeout=30)
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=30)
    assert node.returncode == 0, log
    assert 'configured in' in log and 'Traceback' not in log, log
    import json
    record = json.loads(out.read_text())
    # no world runs: every tick is refused for stale (missing) inputs, on time, explicitly
    assert {r[2] for r in record['refusals']} == {'stale_input'}, record['refusals'][:3]
    assert len(record['refusals']) > 10


def test_demo_world_console_script_runs_and_records_on_sigint(tmp_path):
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    record = tmp_path / 'world.json'
    world = subprocess.Popen([sys.executable, '-m', 'rt_llm_node.demo.world_node', '--seed',
                              '1000046', '--record', str(record)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(4.0)
    finally:
        world.send_signal(signal.SIGINT)
        log, _ = world.communicate(timeout=30)
    assert world.returncode == 0 and 'Traceback' not in log, log
    import json
    layout = json.loads(record.read_text())
    # the world stepped at its rate and wrote what it did on the way out
    assert len(layout['trajectory']) > 30 and layout['objects'], layout.keys()
