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


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_active_publishes_a_stop_before_the_node_exits(tmp_path, sig):
    """A signal to a moving robot's node leaves a stop as the last command on the wire.

    SIGINT is Ctrl-C, SIGTERM what a process manager sends; the node exits 0 and no thread
    publishes after the context is gone.
    """
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    from conftest import ActionListener
    from conftest import wait_until
    params = tmp_path / 'params.yaml'
    params.write_text(open(os.path.join(ROOT, 'config', 'demo.yaml')).read().replace(
        'backend: auto', 'backend: numpy'))
    world = subprocess.Popen([sys.executable, os.path.join(ROOT, 'test', 'peer_process.py'),
                              'world', '120'])
    listener = ActionListener()
    node = subprocess.Popen([sys.executable, '-m', 'rt_llm_node.node', '--autostart',
                             '--ros-args', '--params-file', str(params)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(listener.moving, timeout=60.0, what='the robot moving')
        node.send_signal(sig)
        log, _ = node.communicate(timeout=30)
        wait_until(lambda: listener.actions[-1][1:] == (0.0, 0.0), timeout=3.0,
                   what=f'a stop as the last action (last: {listener.actions[-1][1:]})')
    finally:
        if node.poll() is None:
            node.kill()
        world.send_signal(signal.SIGINT)
        world.wait(timeout=30)
        listener.close()
    assert node.returncode == 0, log
    assert 'Traceback' not in log and 'RCLError' not in log, log


def test_a_sigterm_ends_a_teardown_that_hangs(tmp_path):
    """SIGINT, then SIGTERM as launch escalates: the second ends a stuck teardown at once.

    The first signal only asks the spin to end, so that the node can still publish on its way
    out; a teardown that never returns (here ``finish`` sleeps) would otherwise outlive every
    signal but SIGKILL.
    """
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    flag = tmp_path / 'finishing'
    code = ('import sys, time, rclpy\n'
            'from pathlib import Path\n'
            'from rt_llm_node.spin import spin_until_shutdown\n'
            'def finish(node):\n'
            f'    Path({str(flag)!r}).touch()\n'
            '    time.sleep(60)\n'
            "sys.exit(spin_until_shutdown('stuck', [], lambda: rclpy.create_node('stuck'), "
            'finish=finish))\n')
    proc = subprocess.Popen([sys.executable, '-c', code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3.0)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert flag.exists(), 'the spin did not end on SIGINT'
        proc.send_signal(signal.SIGINT)   # a second Ctrl-C does not cut the teardown short
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, log)


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


def run_node(tmp_path, yaml_text, seconds=None):
    """Start rt-llm-node --autostart on a parameters file; return (exit code, output)."""
    params = tmp_path / 'params.yaml'
    params.write_text(yaml_text)
    node = subprocess.Popen([sys.executable, '-m', 'rt_llm_node.node', '--autostart',
                             '--ros-args', '--params-file', str(params)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if seconds is not None:
            try:
                node.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                node.send_signal(signal.SIGINT)
        log, _ = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
    return node.returncode, log


DEMO_YAML = open(os.path.join(ROOT, 'config', 'demo.yaml')).read().replace(
    'backend: auto', 'backend: numpy')


def test_yaml_as_users_write_it_is_accepted_and_typos_are_named(tmp_path):
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    text = DEMO_YAML.replace('rate_hz: 30.0', 'rate_hz: 30').replace(
        '  ros__parameters:\n', '  ros__parameters:\n    rate_hzz: 20.0\n    on_refusl: hold\n')
    assert 'rate_hz: 30\n' in text and 'rate_hzz' in text
    code, log = run_node(tmp_path, text, seconds=8)
    assert code == 0 and 'Traceback' not in log, log
    assert 'configured in' in log, log
    assert "'rate_hzz' is not a parameter of this node (did you mean 'rate_hz'?)" in log, log
    assert "'on_refusl' is not a parameter of this node (did you mean 'on_refusal'?)" in log


@pytest.mark.parametrize('change,message', [
    (('kv_capacity_tokens: 256', 'kv_capacity_tokens: 256.0'),
     'kv_capacity_tokens = 256.0 must be an integer in [32, 131072]'),
    (('rate_hz: 30.0', 'rate_hz: 1000.0'), 'Parameter rate_hz out of range Min: 1.0, Max: 200.0'),
    (('rate_hz: 30.0', 'rate_hz: [30.0'), 'error:'),    # a YAML syntax error
])
def test_a_bad_parameters_file_is_one_line_and_a_nonzero_exit(tmp_path, change, message):
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    assert change[0] in DEMO_YAML
    code, log = run_node(tmp_path, DEMO_YAML.replace(change[0], change[1]), seconds=60)
    assert code == 2, log
    assert message in log and 'Traceback' not in log, log
    assert len([line for line in log.splitlines() if 'error' in line.lower()]) <= 3, log


def test_a_parameters_file_for_another_node_name_is_reported(tmp_path):
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    code, log = run_node(tmp_path, DEMO_YAML.replace('rt_llm_node:\n', 'rt_llm_nod:\n', 1),
                         seconds=8)
    assert code == 0, log
    assert 'set no parameter of /rt_llm_node' in log, log


def test_the_demo_refuses_what_it_cannot_run_before_starting_anything(tmp_path, capsys):
    """rt-llm-demo: a length, a profile or an output it cannot use is one line and exit 2."""
    pytest.importorskip('rclpy', reason='rclpy (the ros extra) is not installed')
    from rt_llm_node.demo.run import main
    for seconds in ('0', 'nan', '1e9'):
        with pytest.raises(SystemExit) as stopped:
            main(['--seconds', seconds])
        assert stopped.value.code == 2 and '--seconds must be' in capsys.readouterr().err
    (tmp_path / 'note.yaml').write_text('just: a note\n')
    blocked = tmp_path / 'file'
    blocked.write_text('')
    for args, says in ((['--params', str(tmp_path / 'note.yaml')], 'no "<node>: ros__p'),
                       (['--params', str(tmp_path / 'none.yaml')], 'not found'),
                       (['--out', str(blocked / 'demo.png')], '--out')):
        assert main(['--seconds', '1', *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith('rt-llm-demo: error: ') and says in err, err
