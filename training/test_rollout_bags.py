"""DAgger bags: the states a model drove the world into, labelled with the expert's command."""

from pathlib import Path
import sys

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip('rosbags', reason='rosbags writes and reads the bags')


def commands_in(bag):
    """Return the (v, w) of every /cmd_vel message of ``bag``, in order."""
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    from rt_llm_node.bags import open_bag
    store = get_typestore(Stores.LATEST)
    reader = open_bag(bag)
    try:
        connections = [c for c in reader.connections if c.topic == '/cmd_vel']
        out = []
        for c, _, raw in reader.messages(connections=connections):
            msg = store.deserialize_cdr(raw, c.msgtype)
            out.append((msg.linear.x, msg.angular.z))
        return out
    finally:
        reader.close()


def test_a_rollout_bag_holds_the_expert_at_every_state_the_model_reached(tmp_path):
    """The shipped policy drives, the bag relabels the states it reached.

    Recorded again from the executed commands, the world passes through the same states:
    the bag's labels are the expert's commands the episode saw, tick for tick, and they
    differ from what the model executed where it erred.
    """
    from rt_llm_node.demo.evaluate import run_model_episode
    from rt_llm_node.demo.recorder import record_demo_bag
    from rt_llm_node.model import load_model
    from rt_llm_node.model.embedded import default_model_path
    checkpoint = load_model(str(default_model_path()))
    experts = []
    episode = run_model_episode(checkpoint, 20_000, 'meaning', 256, max_ticks=300,
                                observe=lambda msgs, instruction, sectors, expert, model,
                                action: experts.append(expert))
    bag = record_demo_bag(tmp_path / 'rollout', seed=20_000, commands=True,
                          executed=episode['executed'])
    labels = commands_in(bag)
    assert len(labels) == len(episode['executed']) == 300
    assert labels == [(float(v), float(w)) for v, w in experts]
    assert labels != [(float(v), float(w)) for v, w in episode['executed']]
    # more commands than the episode has ticks: not an episode of this seed
    with pytest.raises(ValueError, match='not an episode of this seed'):
        record_demo_bag(tmp_path / 'long', seed=20_000, commands=True,
                        executed=[(0.8, 0.0)] * 5000)
    assert not (tmp_path / 'long').exists(), 'a failed recording leaves no bag'


def test_the_rollout_command_writes_a_bag_an_episode_and_budget(tmp_path, capsys):
    import rollout_bags
    from rt_llm_node.model.embedded import default_model_path
    assert rollout_bags.main(['--model', str(default_model_path()), '--params', '',
                              '--out', str(tmp_path), '--seeds', '20001:20002',
                              '--budgets', '128,256', '--backend', 'numpy',
                              '--workers', '1', '--threads', '2']) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ['.rollout.json', 'meaning128_20001',
                                                          'meaning256_20001']
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(' of 3 goals, agreed ' in line for line in lines)
    for line in lines:
        ticks = int(line.split(', ')[2].split()[0])
        assert len(commands_in(tmp_path / line.split(':')[0])) == ticks
    # --resume: the finished bags stay as they are, only the other episodes run
    stamp = (tmp_path / 'meaning128_20001' / 'metadata.yaml').stat().st_mtime_ns
    common = ['--model', str(default_model_path()), '--params', '', '--out', str(tmp_path),
              '--seeds', '20001:20003', '--budgets', '128,256', '--workers', '1',
              '--backend', 'numpy']
    assert rollout_bags.main([*common, '--resume']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith('2 bags kept, 2 episodes to run') and len(lines) == 3
    assert all(line.startswith(('meaning128_20002', 'meaning256_20002')) for line in lines[1:])
    assert (tmp_path / 'meaning128_20001' / 'metadata.yaml').stat().st_mtime_ns == stamp
    # bags another policy drove are never mixed in, with --resume or without
    for resume in (['--resume'], []):
        assert rollout_bags.main([*common, '--policy', 'recency', *resume]) == 2
        assert 'give another --out' in capsys.readouterr().err
    with pytest.raises(SystemExit):   # held-out seeds are never trained on
        rollout_bags.main(['--model', str(default_model_path()), '--out', str(tmp_path),
                           '--seeds', '999999:1000001'])
    capsys.readouterr()
    # an adapter the workers cannot load: its error, one line, exit 2
    assert rollout_bags.main(['--model', str(default_model_path()), '--params', '',
                              '--adapter', str(tmp_path / 'none'), '--out', str(tmp_path),
                              '--seeds', '20001:20002', '--backend', 'numpy',
                              '--workers', '1']) == 2
    assert capsys.readouterr().err.startswith('rollout_bags: error: ' + str(tmp_path))
