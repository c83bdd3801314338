"""rt-llm-replay on real rosbag2 files written by the demo recorder (rosbags, MCAP and sqlite3)."""

import json
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip('rosbags', reason='rosbags reads and writes the bags')

from rosbags.rosbag2 import Reader  # noqa: E402
from rosbags.rosbag2 import StoragePlugin  # noqa: E402
from rosbags.rosbag2 import Writer  # noqa: E402
from rosbags.typesys import get_types_from_msg  # noqa: E402
from rosbags.typesys import get_typestore  # noqa: E402
from rosbags.typesys import Stores  # noqa: E402

from rt_llm_node.demo.recorder import record_demo_bag  # noqa: E402
from rt_llm_node.player import recorded_qos  # noqa: E402
from rt_llm_node.replay import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEMO_PARAMS = str(ROOT / 'config' / 'demo.yaml')
SECONDS = 3.0


@pytest.fixture(scope='module')
def bags(tmp_path_factory):
    root = tmp_path_factory.mktemp('bags')
    return {storage: record_demo_bag(root / storage, SECONDS, seed=1_000_003, storage=storage)
            for storage in ('mcap', 'sqlite3')}


def run(args, capsys):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_model_clock_replays_are_byte_identical(bags, tmp_path, capsys):
    outs = []
    for name in ('a', 'b'):
        code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path / name],
                           capsys)
        assert code == 0, err
        outs.append((tmp_path / name / 'actions.jsonl').read_bytes())
    assert outs[0] == outs[1]
    lines = [json.loads(line) for line in outs[0].decode().splitlines()]
    assert len(lines) == int(SECONDS * 30) - 1 or len(lines) == int(SECONDS * 30)
    assert all(line['decision'] in ('action', 'refusal') for line in lines)
    summary = json.loads((tmp_path / 'a' / 'summary.json').read_text())
    assert summary['ticks'] == len(lines)
    assert summary['actions'] + summary['refusals'] == summary['ticks']
    assert (tmp_path / 'a' / 'timeline.png').stat().st_size > 10000


def test_output_bag_holds_inputs_actions_refusals_and_records(bags, tmp_path, capsys):
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path], capsys)
    assert code == 0, err
    store = get_typestore(Stores.LATEST)
    counts, twists = {}, []
    with Reader(tmp_path / 'replay') as reader:
        for connection, _, raw in reader.messages():
            counts[connection.topic] = counts.get(connection.topic, 0) + 1
            if connection.topic == '/cmd_vel':
                twists.append(store.deserialize_cdr(raw, connection.msgtype))
    lines = (tmp_path / 'actions.jsonl').read_text().splitlines()
    assert counts['/scan'] >= len(lines) - 1 and counts['/rt_llm_node/tick_record'] == len(lines)
    assert len(twists) == len(lines)  # an action, or the stop sent after a refusal
    first = json.loads(lines[0])
    if first['decision'] == 'action':
        assert twists[0].angular.z == pytest.approx(first['values']['angular.z'])
    assert all(np.isfinite(t.linear.x) and -0.2 <= t.linear.x <= 0.8 for t in twists)


@pytest.mark.parametrize('storage', ['mcap', 'sqlite3'])
def test_bags_carry_the_offered_qos_and_replays_keep_it(bags, storage, tmp_path, capsys):
    """The recorder writes the QoS the demo world offers, as ros2 bag record does.

    --live publishes with it, and the replay's output bag keeps it for its copies of the inputs.
    """
    sensor = {'reliable': False, 'transient_local': False, 'depth': 5}
    expected = {'/scan': sensor, '/odom': sensor, '/detections': sensor,
                '/instruction': {'reliable': True, 'transient_local': True, 'depth': 10}}
    with Reader(bags[storage]) as reader:
        assert {c.topic: recorded_qos(c) for c in reader.connections} == expected
    code, _, err = run([bags[storage], '--params', DEMO_PARAMS, '--out', tmp_path, '--end',
                        '0.5'], capsys)
    assert code == 0, err
    with Reader(tmp_path / 'replay') as reader:
        copied = {c.topic: recorded_qos(c) for c in reader.connections if c.topic in expected}
    assert copied == expected


def test_sqlite3_bags_replay_too(bags, tmp_path, capsys):
    code, out, err = run([bags['sqlite3'], '--params', DEMO_PARAMS, '--out', tmp_path,
                          '--start', '1', '--end', '2.5'], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / 'summary.json').read_text())['ticks'] == 46


def test_expect_passes_on_the_same_inputs_and_fails_on_a_changed_schema(
        bags, tmp_path, capsys):
    golden = tmp_path / 'golden'
    assert run([bags['mcap'], '--params', DEMO_PARAMS, '--out', golden], capsys)[0] == 0
    code, out, _ = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path / 'same',
                        '--expect', golden], capsys)
    assert code == 0 and 'same decisions' in out
    changed = tmp_path / 'changed.yaml'
    changed.write_text(Path(DEMO_PARAMS).read_text().replace(
        'action_max: [180.0, 0.8, 1.5]', 'action_max: [180.0, 0.8, 0.5]'))
    code, out, _ = run([bags['mcap'], '--params', changed, '--out', tmp_path / 'new',
                        '--expect', golden], capsys)
    assert code == 1
    assert 'differences against' in out and 'action values' in out and 'tick ' in out


def test_a_changed_eviction_policy_fails_expect(bags, tmp_path, capsys):
    small = tmp_path / 'small.yaml'
    small.write_text(Path(DEMO_PARAMS).read_text().replace('kv_capacity_tokens: 256',
                                                           'kv_capacity_tokens: 128'))
    golden = tmp_path / 'golden'
    assert run([bags['mcap'], '--params', small, '--out', golden], capsys)[0] == 0
    other = tmp_path / 'recency.yaml'
    other.write_text(small.read_text().replace('eviction_policy: meaning',
                                               'eviction_policy: recency'))
    code, out, _ = run([bags['mcap'], '--params', other, '--out', tmp_path / 'new',
                        '--expect', golden], capsys)
    assert code == 1, 'evicting by age instead of meaning changed no decision'
    assert 'differences against' in out


def test_truncated_mcap_is_a_clear_error(bags, tmp_path, capsys):
    import shutil
    broken = tmp_path / 'broken'
    shutil.copytree(bags['mcap'], broken)
    mcap = next(broken.glob('*.mcap'))
    mcap.write_bytes(mcap.read_bytes()[:mcap.stat().st_size // 2])
    code, _, err = run([broken, '--params', DEMO_PARAMS, '--out', tmp_path / 'o'], capsys)
    assert code == 2 and 'rt-llm-replay: error' in err and 'Traceback' not in err


def test_corrupt_sqlite3_is_a_clear_error(bags, tmp_path, capsys):
    import shutil
    broken = tmp_path / 'broken'
    shutil.copytree(bags['sqlite3'], broken)
    db = next(broken.glob('*.db3'))
    db.write_bytes(b'this is not sqlite' * 100)
    code, _, err = run([broken, '--params', DEMO_PARAMS, '--out', tmp_path / 'o'], capsys)
    assert code == 2 and 'rt-llm-replay: error' in err


def test_bytes_flipped_mid_file_are_a_clear_error_not_a_traceback(bags, tmp_path, capsys):
    import shutil
    for seed in range(3):   # a few places: a chunk header, compressed data, an index
        broken = tmp_path / f'flipped{seed}'
        shutil.copytree(bags['mcap'], broken)
        mcap = next(broken.glob('*.mcap'))
        data = bytearray(mcap.read_bytes())
        start = len(data) // 4 + seed * len(data) // 5
        data[start:start + 4096] = bytes(b ^ 0xFF for b in data[start:start + 4096])
        mcap.write_bytes(bytes(data))
        code, _, err = run([broken, '--params', DEMO_PARAMS, '--out', tmp_path / f'o{seed}'],
                           capsys)
        assert 'Traceback' not in err, err
        assert code == 2 and 'rt-llm-replay: error' in err or code == 0, (code, err)


def test_a_sqlite3_row_whose_data_is_text_is_skipped_with_a_warning(bags, tmp_path, capsys):
    import shutil
    import sqlite3
    bag = tmp_path / 'text'
    shutil.copytree(bags['sqlite3'], bag)
    db = sqlite3.connect(next(bag.glob('*.db3')))
    topic = db.execute("SELECT id FROM topics WHERE name = '/scan'").fetchone()[0]
    row = db.execute('SELECT id FROM messages WHERE topic_id = ? LIMIT 1 OFFSET 5',
                     (topic,)).fetchone()[0]
    db.execute("UPDATE messages SET data = 'not bytes' WHERE id = ?", (row,))
    db.commit()
    db.close()
    code, _, err = run([bag, '--params', DEMO_PARAMS, '--out', tmp_path / 'o'], capsys)
    assert code == 0 and 'Traceback' not in err, err
    assert '/scan: a message stored as str, not bytes: skipped' in err


def test_a_failed_replay_leaves_an_earlier_output_whole(bags, tmp_path, capsys):
    out = tmp_path / 'golden'
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', out], capsys)
    assert code == 0, err
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob('*') if p.is_file()}
    import shutil
    broken = tmp_path / 'broken'
    shutil.copytree(bags['mcap'], broken)
    mcap = next(broken.glob('*.mcap'))
    data = bytearray(mcap.read_bytes())
    start = len(data) // 4   # corrupt data that only the replay's reading finds
    data[start:start + 4096] = bytes(b ^ 0xFF for b in data[start:start + 4096])
    mcap.write_bytes(bytes(data))
    code, _, err = run([broken, '--params', DEMO_PARAMS, '--out', out], capsys)
    assert code == 2 and 'the bag is corrupt' in err, err
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob('*') if p.is_file()}
    assert after == before, 'the earlier replay was changed by the failed one'
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith('.golden')] == []


def test_missing_bag_and_missing_topics_are_clear_errors(bags, tmp_path, capsys):
    code, _, err = run([tmp_path / 'nope', '--out', tmp_path / 'o'], capsys)
    assert code == 2 and 'no such bag' in err
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path / 'o',
                        '--topics', '/scan:=/front_scan'], capsys)
    assert code == 2 and '/front_scan (for input /scan) is not in the bag' in err


@pytest.mark.parametrize('bad, says', [
    (['--tolerance', 'nan'], 'the tolerance must be'), (['--tolerance', '-1'], 'the tolerance'),
    (['--start', 'nan'], '--start and --end'), (['--end', 'inf'], '--start and --end'),
    (['--start', '-2'], '--start and --end'), (['--live', '--rate', 'nan'], '--rate'),
    (['--live', '--delay', 'inf'], '--delay'), (['--topics', '/scan:=/a:=/b'], '--topics'),
    (['--topics', ':=/scan'], '--topics'), (['--topics', '/scan:='], '--topics')])
def test_arguments_out_of_range_are_one_error_line(bags, tmp_path, capsys, bad, says):
    out = tmp_path / 'o'
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', out, *bad], capsys)
    assert code == 2 and err.startswith('rt-llm-replay: error: ') and says in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def write_bag_with_extra_topic(path, source, version, storage, custom_def, with_definition):
    """Copy ``source`` and add /note of a custom type that the default typestore lacks."""
    store = get_typestore(Stores.LATEST)
    store.register(get_types_from_msg(custom_def, 'rt_test_msgs/msg/Note'))
    with Reader(source) as reader, Writer(path, version=version,
                                          storage_plugin=storage) as writer:
        conns = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store)
                 for c in reader.connections}
        extra = {} if with_definition else {'msgdef': '', 'rihs01': 'RIHS01_' + '0' * 64}
        note = writer.add_connection('/note', 'rt_test_msgs/msg/Note', typestore=store, **extra)
        for connection, stamp, raw in reader.messages():
            writer.write(conns[connection.id], stamp, raw)
            if connection.topic == '/odom':
                msg = store.types['rt_test_msgs/msg/Note'](text='hello', level=3)
                writer.write(note, stamp, store.serialize_cdr(msg, 'rt_test_msgs/msg/Note'))
    return path


def test_mcap_definitions_teach_the_typestore_new_types(bags, tmp_path, capsys):
    bag = write_bag_with_extra_topic(tmp_path / 'bag', bags['mcap'], 9, StoragePlugin.MCAP,
                                     'string text\nint32 level\n', True)
    code, _, err = run([bag, '--params', DEMO_PARAMS, '--out', tmp_path / 'o'], capsys)
    assert code == 0, err
    assert 'rt_test_msgs/msg/Note registered from the bag' in err
    with Reader(tmp_path / 'o' / 'replay') as reader:
        assert '/note' in reader.topics


def test_unknown_types_without_definition_are_skipped_with_a_warning(bags, tmp_path, capsys):
    bag = write_bag_with_extra_topic(tmp_path / 'bag', bags['sqlite3'], 8,
                                     StoragePlugin.SQLITE3, 'string text\nint32 level\n',
                                     False)
    code, _, err = run([bag, '--params', DEMO_PARAMS, '--out', tmp_path / 'o'], capsys)
    assert code == 0, err
    assert 'skipping /note: unknown message type rt_test_msgs/msg/Note' in err
    code, _, err = run([bag, '--params', DEMO_PARAMS, '--out', tmp_path / 'o2',
                        '--topics', '/detections:=/note'], capsys)
    assert code == 2 and '/note has type rt_test_msgs/msg/Note' in err


def test_undecodable_messages_are_skipped_not_fatal(bags, tmp_path, capsys):
    store = get_typestore(Stores.LATEST)
    bag = tmp_path / 'bag'
    with Reader(bags['mcap']) as reader, Writer(bag, version=9,
                                                storage_plugin=StoragePlugin.MCAP) as writer:
        conns = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store)
                 for c in reader.connections}
        for i, (connection, stamp, raw) in enumerate(reader.messages()):
            if connection.topic == '/scan' and i % 7 == 0:
                raw = raw[:12]   # cut short: not a LaserScan any more
            writer.write(conns[connection.id], stamp, raw)
    code, _, err = run([bag, '--params', DEMO_PARAMS, '--out', tmp_path / 'o'], capsys)
    assert code == 0, err
    assert '/scan: undecodable message skipped' in err
    assert json.loads((tmp_path / 'o' / 'summary.json').read_text())['skipped_messages']['/scan']


def test_bad_params_and_cost_model_are_clear_errors(bags, tmp_path, capsys):
    bad = tmp_path / 'bad.yaml'
    bad.write_text('rt_llm_node:\n  ros__parameters:\n    rate_hz: -5.0\n')
    code, _, err = run([bags['mcap'], '--params', bad, '--out', tmp_path / 'o'], capsys)
    assert code == 2 and 'rate_hz' in err
    typo = tmp_path / 'typo.yaml'
    typo.write_text('rt_llm_node:\n  ros__parameters:\n    rate_hzz: 30.0\n')
    code, _, err = run([bags['mcap'], '--params', typo, '--out', tmp_path / 'o'], capsys)
    assert code == 2 and 'unknown parameters rate_hzz' in err
    cost = tmp_path / 'cost_model.json'
    cost.write_text('{"prefill": 3}')
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path / 'o',
                        '--cost-model', cost], capsys)
    assert code == 2 and 'not a cost model' in err


@pytest.mark.parametrize('qos', ['recorded', 'not recorded'])
def test_live_mode_publishes_to_a_real_subscriber(bags, qos, tmp_path):
    rclpy = pytest.importorskip('rclpy', reason='rclpy is needed for --live')
    from rclpy.qos import qos_profile_sensor_data
    from rclpy.qos import QoSProfile
    from sensor_msgs.msg import LaserScan
    from std_msgs.msg import String
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('replay_listener', context=context)
    got = {'scan': 0, 'instruction': []}
    # sensor QoS as published (best effort), with a history deep enough that a test process
    # slowed by a busy machine does not drop scans from its queue before it takes them
    scan_qos = QoSProfile(depth=200, reliability=qos_profile_sensor_data.reliability,
                          durability=qos_profile_sensor_data.durability)
    node.create_subscription(LaserScan, '/scan',
                             lambda m: got.__setitem__('scan', got['scan'] + 1), scan_qos)
    # the node's own QoS for an instruction (reliable, transient local): a volatile
    # publisher would not match it
    from rt_llm_node.qos import INSTRUCTION_QOS
    node.create_subscription(String, '/instruction',
                             lambda m: got['instruction'].append(m.data), INSTRUCTION_QOS)
    executor = rclpy.executors.SingleThreadedExecutor(context=context)
    executor.add_node(node)
    try:
        # --delay 4: time for DDS discovery before the first message (with 2 s a busy 2-core
        # machine matched /scan late now and then and the first quarter of the scans was lost)
        bag = bags['mcap']
        if qos == 'not recorded':   # an older bag: sensor QoS by type, the rest the node's
            bag = write_bag_with_extra_topic(tmp_path / 'bag', bag, 9, StoragePlugin.MCAP,
                                             'string text\nint32 level\n', True)
        proc = subprocess.Popen([sys.executable, '-m', 'rt_llm_node.replay', str(bag),
                                 '--live', '--delay', '4'], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        while proc.poll() is None:
            executor.spin_once(timeout_sec=0.05)
        for _ in range(20):
            executor.spin_once(timeout_sec=0.05)
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        assert 'published' in out
        assert ('no QoS recorded' in err) == (qos == 'not recorded'), err
        assert got['instruction'] and got['instruction'][0].startswith('go to the ')
        assert got['scan'] >= 0.8 * SECONDS * 30, got   # best effort over loopback
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_wall_clock_replay_runs_and_reports_real_latency(bags, tmp_path, capsys):
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path,
                        '--clock', 'wall', '--end', '1.5'], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / 'summary.json').read_text())
    assert summary['clock'] == 'wall' and summary['ticks'] == 46
    assert summary['latency_ms']['p50'] > 0.1   # measured, not predicted


def test_wall_clock_replay_draws_its_timeline_too(bags, tmp_path, capsys):
    """A wall-clock replay starts the plotter only after its last tick; the PNG still comes."""
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path,
                        '--clock', 'wall', '--end', '0.5'], capsys)
    assert code == 0, err
    assert (tmp_path / 'timeline.png').stat().st_size > 10000


def test_a_timeline_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path):
    """The plotter child fails for real (its folder is gone); the parent warns and goes on."""
    from types import SimpleNamespace
    from rt_llm_node.timeline import TimelinePlotter
    records = [SimpleNamespace(stamp=i / 30, total_ms=2.0, predicted_ms=3.0,
                               decision='refusal' if i == 3 else 'action',
                               reason='deadline' if i == 3 else '', cache_length=10 + i)
               for i in range(10)]
    warnings = []
    TimelinePlotter().draw(records, 33.3, 3.0, tmp_path / 'gone' / 'timeline.png',
                           warnings.append)
    assert len(warnings) == 1 and 'timeline.png not drawn' in warnings[0], warnings
    TimelinePlotter().draw(records, 33.3, 3.0, tmp_path / 'timeline.png', warnings.append)
    assert len(warnings) == 1 and (tmp_path / 'timeline.png').stat().st_size > 10000


def test_a_late_start_still_knows_the_instruction_sent_at_the_beginning(tmp_path, capsys):
    source = record_demo_bag(tmp_path / 'long', 14.0, seed=1_000_005)
    store = get_typestore(Stores.LATEST)
    bag = tmp_path / 'one_instruction'   # only the first goal's instruction, at t = 0
    with Reader(source) as reader, Writer(bag, version=9,
                                          storage_plugin=StoragePlugin.MCAP) as writer:
        conns = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store)
                 for c in reader.connections}
        seen = 0
        for connection, stamp, raw in reader.messages():
            if connection.topic == '/instruction':
                seen += 1
                if seen > 1:
                    continue
            writer.write(conns[connection.id], stamp, raw)
    code, _, err = run([bag, '--params', DEMO_PARAMS, '--out', tmp_path / 'o',
                        '--start', '12.5', '--end', '13.5'], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / 'o' / 'summary.json').read_text())
    assert summary['ticks'] == 31
    assert 'stale_input' not in summary['refusals_by_reason'], summary


def test_speculative_decoding_replays_the_same_decisions_in_fewer_passes(bags, tmp_path,
                                                                         capsys):
    """The demo profile with speculative_tokens 4 and 0: the same decisions."""
    import yaml
    paths = {}
    for name, tokens in (('spec', 4), ('plain', 0)):
        params = yaml.safe_load(Path(DEMO_PARAMS).read_text())
        params['rt_llm_node']['ros__parameters']['speculative_tokens'] = tokens
        paths[name] = tmp_path / f'{name}.yaml'
        paths[name].write_text(yaml.safe_dump(params))
    runs = {}
    for name, path in paths.items():
        code, _, err = run([bags['mcap'], '--params', path, '--out', tmp_path / name], capsys)
        assert code == 0, err
        lines = (tmp_path / name / 'actions.jsonl').read_text().splitlines()
        decisions = [(d['decision'], d.get('values'), d.get('reason'))
                     for d in map(json.loads, lines)]
        runs[name] = (decisions,
                      json.loads((tmp_path / name / 'summary.json').read_text()))
    (spec, spec_summary), (plain, plain_summary) = runs['spec'], runs['plain']
    assert spec == plain
    assert plain_summary['drafted'] == 0 and plain_summary['verify_passes'] == 0
    assert spec_summary['drafted_kept'] > 0 and spec_summary['verify_passes'] > 0
    # the action's drafts verified beside the prefill (the numpy backend has the call)
    assert plain_summary['fused_passes'] == 0 < spec_summary['fused_passes']
    assert spec_summary['forward_passes_per_action'] < plain_summary['forward_passes_per_action']
    # the bag's instructions, each placed after the system prompt (the demo profile's cache)
    assert plain_summary['instructions_prefilled'] >= 1


def test_a_replay_can_start_warm_from_a_state_folder(bags, tmp_path, capsys):
    """--state-dir: the second replay restores the prompt's KV state, and decides the same."""
    outputs = []
    for name in ('cold', 'warm'):
        code, out, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path / name,
                              '--state-dir', str(tmp_path / 'state')], capsys)
        assert code == 0, err
        outputs.append((tmp_path / name / 'actions.jsonl').read_bytes())
        restored = 'KV state restored' in out + err
        assert restored == (name == 'warm'), out + err
    assert outputs[0] == outputs[1]
    assert list((tmp_path / 'state').glob('prefix-*.safetensors'))


def test_a_bag_that_holds_the_nodes_own_outputs_replays_as_one_without_them(
        bags, tmp_path, capsys):
    """ros2 bag record -a beside the node: the bag holds /cmd_vel and the refusals too.

    A replay's output bag is such a bag. Replaying it takes its inputs, ignores the recorded
    outputs (named in a warning and the summary) and decides as the first replay did.
    """
    first = tmp_path / 'first'
    assert run([bags['mcap'], '--params', DEMO_PARAMS, '--out', first], capsys)[0] == 0
    code, out, err = run([first / 'replay', '--params', DEMO_PARAMS, '--out', tmp_path / 'again',
                          '--expect', first], capsys)
    assert code == 0, err
    assert 'Traceback' not in err and 'same decisions' in out
    assert '/cmd_vel' in err and 'not replayed as input' in err
    summary = json.loads((tmp_path / 'again' / 'summary.json').read_text())
    assert summary['recorded_outputs_ignored'] == ['/cmd_vel', '/rt_llm_node/refusal',
                                                   '/rt_llm_node/tick_record']


def test_a_tighter_limit_clamps_the_replayed_actions_and_never_reverses_one(
        bags, tmp_path, capsys):
    golden = tmp_path / 'golden'
    assert run([bags['mcap'], '--params', DEMO_PARAMS, '--out', golden], capsys)[0] == 0
    tight = tmp_path / 'tight.yaml'
    tight.write_text(Path(DEMO_PARAMS).read_text().replace(
        'action_max: [180.0, 0.8, 1.5]', 'action_max: [180.0, 0.5, 0.25]'))
    assert run([bags['mcap'], '--params', tight, '--out', tmp_path / 'new'], capsys)[0] == 0
    before = [json.loads(line) for line in (golden / 'actions.jsonl').read_text().splitlines()]
    after = [json.loads(line) for line in
             (tmp_path / 'new' / 'actions.jsonl').read_text().splitlines()]
    assert [b['decision'] for b in before] == [a['decision'] for a in after]
    clamped = 0
    for b, a in zip(before, after):
        if b['decision'] != 'action':
            continue
        want = {'_aim': b['values']['_aim'], 'linear.x': min(b['values']['linear.x'], 0.5),
                'angular.z': min(b['values']['angular.z'], 0.25)}
        assert a['values'] == pytest.approx(want), (b, a)
        clamped += a['values'] != b['values']
        if a['values'] != b['values']:
            assert a['decoded'] == b['values'], 'what the model chose stays on record'
    assert clamped, 'the bag never reached the tighter limit: the test shows nothing'


def test_params_files_keyed_as_ros_users_key_them_are_honoured(bags, tmp_path, capsys):
    text = Path(DEMO_PARAMS).read_text()
    for i, key in enumerate(('/robot1/rt_llm_node', '/**', 'rt_llm_node')):
        params = tmp_path / f'{i}.yaml'
        params.write_text(text.replace('rt_llm_node:\n', f"'{key}':\n", 1))
        code, _, err = run([bags['mcap'], '--params', params, '--out', tmp_path / f'out{i}',
                            '--end', '1'], capsys)
        assert code == 0, (key, err)
    other = tmp_path / 'other.yaml'
    other.write_text(text.replace('rt_llm_node:\n', 'planner:\n', 1))
    code, _, err = run([bags['mcap'], '--params', other, '--out', tmp_path / 'o'], capsys)
    assert code == 2 and 'looked for' in err and 'planner' in err and '/**' in err


def test_every_failure_is_exit_2_with_one_line_never_a_traceback(bags, tmp_path, capsys):
    golden = tmp_path / 'golden'
    golden.mkdir()
    (golden / 'actions.jsonl').write_text('{"tick": 0}\n')   # a golden of another tool
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', tmp_path / 'o',
                        '--expect', golden, '--end', '0.5'], capsys)
    assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) >= 1
    assert err.strip().splitlines()[-1].startswith('rt-llm-replay: error:')


def test_an_out_folder_is_replaced_only_when_it_holds_an_earlier_replay(bags, tmp_path, capsys):
    args = [bags['mcap'], '--params', DEMO_PARAMS, '--end', '0.5']
    out = tmp_path / 'out'
    assert run(args + ['--out', out], capsys)[0] == 0
    assert json.loads((out / 'rt-llm-output.json').read_text())['tool'] == 'rt-llm-replay'
    assert run(args + ['--out', out], capsys)[0] == 0, 'an earlier replay: replaced'
    mine = out / 'notes.txt'   # a user's file beside an earlier replay
    mine.write_text('keep me')
    code, _, err = run(args + ['--out', out], capsys)
    assert code == 2 and 'notes.txt' in err and '--force' in err
    assert len(err.strip().splitlines()) == 1 and mine.read_text() == 'keep me'
    code, _, err = run(args + ['--out', out, '--force'], capsys)
    assert code == 0, err
    assert mine.read_text() == 'keep me' and (out / 'actions.jsonl').exists()
    theirs = tmp_path / 'theirs'   # a folder of something else, with a clashing name
    theirs.mkdir()
    (theirs / 'summary.json').write_text('{"mine": true}')
    code, _, err = run(args + ['--out', theirs, '--force'], capsys)
    assert code == 2 and 'summary.json' in err
    assert (theirs / 'summary.json').read_text() == '{"mine": true}'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')], 'no leftovers'


def test_a_file_as_out_is_an_error_and_stays_as_it_was(bags, tmp_path, capsys):
    target = tmp_path / 'report.txt'
    target.write_text('a file')
    code, _, err = run([bags['mcap'], '--params', DEMO_PARAMS, '--out', target], capsys)
    assert code == 2 and 'not a folder' in err and target.read_text() == 'a file'
    assert [p.name for p in tmp_path.iterdir()] == ['report.txt']


def test_the_recorder_replaces_its_own_bag_and_refuses_a_foreign_folder(tmp_path, capsys):
    from rt_llm_node.demo.recorder import main as record
    bag = tmp_path / 'bag'
    assert record([str(bag), '--seconds', '0.3']) == 0
    assert record([str(bag), '--seconds', '0.3']) == 0
    other = tmp_path / 'photos'
    other.mkdir()
    (other / 'cat.jpg').write_bytes(b'\xff\xd8')
    assert record([str(other), '--seconds', '0.3']) == 2
    assert 'cat.jpg' in capsys.readouterr().err and (other / 'cat.jpg').exists()


ARM_JOINTS = ['shoulder_pan_joint', 'shoulder_lift_joint', 'elbow_joint']
ARM_PARAMS = """/**:
  ros__parameters:
    input_topics: ["/instruction", "joint_states"]
    input_types: ["std_msgs/msg/String", "sensor_msgs/msg/JointState"]
    input_kinds: ["instruction", "observation"]
    input_max_age_s: [1000000000.0, 0.1]
    input_prefixes: ["task", "joints"]
    input_max_tokens: [16, 48]
    action_topic: arm_controller/joint_trajectory
    action_type: trajectory_msgs/msg/JointTrajectory
    action_fields: [shoulder_pan_joint, shoulder_lift_joint, elbow_joint]
    action_min: [-1.5, -2.0, -2.5]
    action_max: [1.5, 0.0, 2.5]
    action_step: [0.05, 0.05, 0.05]
    joint_max_step: [0.03]
"""


def arm_state(k):
    """Return the (names, positions) an arm reports at its k-th state, damaged in places.

    States 10-19: a NaN position; 30-34: one position short; 40-44: the joints in another
    order (positions by name, as joint_state_broadcaster may send them); 50-54: infinity.
    """
    names = list(ARM_JOINTS)
    positions = [0.5 * np.sin(k / 30), -1.0 + 0.3 * np.cos(k / 20), 0.8 * np.sin(k / 15)]
    if 10 <= k < 20:
        positions[1] = float('nan')
    elif 30 <= k < 35:
        positions = positions[:2]
    elif 40 <= k < 45:
        names, positions = [names[i] for i in (2, 0, 1)], [positions[i] for i in (2, 0, 1)]
    elif 50 <= k < 55:
        positions[0] = float('inf')
    return names, positions


def write_arm_bag(path, seconds, storage='mcap'):
    """Write an arm recorded at the root namespace: an instruction, then its joints at 30 Hz."""
    store = get_typestore(Stores.LATEST)
    types = store.types
    start = 1_700_000_000 * 10**9
    plugin = {'mcap': StoragePlugin.MCAP, 'sqlite3': StoragePlugin.SQLITE3}[storage]
    with Writer(path, version=9, storage_plugin=plugin) as writer:
        task = writer.add_connection('/instruction', 'std_msgs/msg/String', typestore=store)
        joints = writer.add_connection('/joint_states', 'sensor_msgs/msg/JointState',
                                       typestore=store)
        writer.write(task, start, store.serialize_cdr(types['std_msgs/msg/String'](
            data='wave the arm'), 'std_msgs/msg/String'))
        for k in range(int(seconds * 30)):
            t = start + 5_000_000 + k * 33_333_333
            stamp = types['builtin_interfaces/msg/Time'](sec=t // 10**9, nanosec=t % 10**9)
            names, positions = arm_state(k)
            msg = types['sensor_msgs/msg/JointState'](
                header=types['std_msgs/msg/Header'](stamp=stamp, frame_id=''), name=names,
                position=np.array(positions), velocity=np.zeros(0), effort=np.zeros(0))
            writer.write(joints, t, store.serialize_cdr(msg, 'sensor_msgs/msg/JointState'))


def test_an_arms_bag_replays_on_its_relative_topics_each_target_a_bounded_step(tmp_path, capsys):
    """The README's arm profile (relative topics) on a bag recorded at the root namespace.

    Every target is at most joint_max_step from the joint state its tick measured, matched by
    joint name; a state with a NaN, an infinity or a missing position is an input error.
    """
    bag, params, out = tmp_path / 'arm', tmp_path / 'arm.yaml', tmp_path / 'out'
    write_arm_bag(bag, 2.0)
    params.write_text(ARM_PARAMS)
    code, _, err = run([bag, '--params', params, '--out', out], capsys)
    assert code == 0, err
    store = get_typestore(Stores.LATEST)
    measured, sent = [], []   # (log time, {joint: position}); each trajectory's target
    with Reader(out / 'replay') as reader:
        for connection, t, raw in reader.messages():
            msg = store.deserialize_cdr(raw, connection.msgtype)
            if connection.topic == '/joint_states':
                measured.append((t, dict(zip(msg.name, msg.position)), len(msg.position)))
            elif connection.topic == '/arm_controller/joint_trajectory' and msg.points:
                assert list(msg.joint_names) == ARM_JOINTS
                sent.append(np.asarray(msg.points[0].positions))
    ticks = [json.loads(line) for line in (out / 'actions.jsonl').read_text().splitlines()]
    acted = [tick for tick in ticks if tick['decision'] == 'action']
    assert len(sent) == len(acted) >= 30
    assert sum(tick.get('reason') == 'input_error' for tick in ticks) >= 20   # the damaged
    targets = iter(sent)
    for tick in ticks[1:]:   # tick 0 comes before the first joint state
        # what the tick measured: the newest state at its start
        _, state, count = [m for m in measured if m[0] <= tick['stamp_ns']][-1]
        damaged = count < len(ARM_JOINTS) or not np.isfinite(list(state.values())).all()
        if damaged:
            assert tick['decision'] == 'refusal' and tick['reason'] == 'input_error', tick
            continue
        assert tick['decision'] == 'action', tick
        target, reached = next(targets), np.array([state[j] for j in ARM_JOINTS])
        assert np.abs(target - reached).max() <= 0.03 + 1e-9, (tick, target, state)
        assert np.allclose(target, [tick['values'][j] for j in ARM_JOINTS], atol=1e-6)
