"""Fine-tuning data from bags is what the node feeds the model, token for token.

A bag is replayed through the engine with a real model (the numpy backend) and the cache
recorded at each decision; the model's own actions are then written into a bag as if an
operator had commanded them, and the fine-tuning data built from that bag must hold the same
contexts and actions, tick for tick.
"""

from pathlib import Path
import sys

import numpy as np
import pytest

from rt_llm_node.admission import CostModel
from rt_llm_node.configure import configure_engine
from rt_llm_node.engine import ModelClock
from rt_llm_node.replay import load_params
from rt_llm_node.replay import ReplayError

pytest.importorskip('rosbags', reason='rosbags reads and writes the bags')
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bag_samples import Augment  # noqa: E402,I100
from bag_samples import bag_samples  # noqa: E402
from bag_samples import TeacherBackend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def demo_values(**changes):
    """Return the demo profile without its plan field (a bag holds no aim)."""
    values = load_params(ROOT / 'config' / 'demo.yaml')
    values.update(model_path='', speculative_tokens=0, realtime_priority=0,
                  action_fields=['linear.x', 'angular.z'], action_keys=['v', 'w'],
                  action_min=[-0.2, -1.5], action_max=[0.8, 1.5], action_grammar_min=[],
                  action_grammar_max=[], action_step=[0.1, 0.25], kv_capacity_tokens=160)
    values.update(changes)
    return values


@pytest.fixture(scope='module')
def expert_bag(tmp_path_factory):
    from rt_llm_node.demo.recorder import record_demo_bag
    return record_demo_bag(tmp_path_factory.mktemp('bags') / 'expert', seconds=20.0,
                           seed=1_000_003, commands=True)


def model_run(bag, values):
    """Replay ``bag`` through a real engine; return [(tick ns, context ids, action ids)]."""
    from collections import Counter

    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    from rt_llm_node.bags import input_connections
    from rt_llm_node.bags import open_bag
    from rt_llm_node.replay import bag_ticks
    store = get_typestore(Stores.LATEST)
    engine = configure_engine(values, clock=ModelClock(), log=lambda text: None,
                              cost_model=CostModel())
    grammar, backend = engine.grammar, engine.backend
    decisions, seen = [], []
    choose = backend.argmax

    def recording(allowed=None):   # the cache the model decides on, once a tick
        if not seen:   # to the action's prefix (a token the grammar forced may follow it)
            cache = engine.session.cache
            owner = cache.owner[:cache.length]
            first = int(np.flatnonzero(owner == owner[-1])[0])   # the action segment's
            seen.append(cache.token_ids[:first + len(grammar.prefix_ids)].copy())
        return choose(allowed)
    backend.argmax = recording
    reader = open_bag(bag)
    try:
        connections = input_connections(reader, values, {}, store, print)
        topic_of = {c.topic: t for t, c in connections.items()}
        for tick_ns, snapshot in bag_ticks(reader, topic_of, store, reader.start_time,
                                           reader.end_time, 1 / values['rate_hz'], print,
                                           Counter()):
            seen.clear()
            engine.clock.advance_to(tick_ns / 1e9)
            result = engine.tick(dict(snapshot), tick_ns / 1e9, tick_ns / 1e9 + 1e3)
            if result.action is not None:
                ids = list(result.action.token_ids)
                action = ids[len(grammar.prefix_ids):len(ids) - len(grammar.end_ids)]
                decisions.append((tick_ns, seen[0], action, result.action.values))
    finally:
        reader.close()
    return decisions


def write_commanded(bag, out, decisions):
    """Copy ``bag``'s inputs to ``out`` with ``decisions``' actions as /cmd_vel."""
    from rosbags.rosbag2 import Reader
    from rosbags.rosbag2 import Writer
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    store = get_typestore(Stores.LATEST)
    twist, vector = (store.types[t] for t in ('geometry_msgs/msg/Twist',
                                              'geometry_msgs/msg/Vector3'))
    writer = Writer(out, version=9)
    writer.open()
    with Reader(bag) as reader:
        copies = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store)
                  for c in reader.connections if c.topic != '/cmd_vel'}
        command = writer.add_connection('/cmd_vel', 'geometry_msgs/msg/Twist', typestore=store)
        for connection, stamp, raw in reader.messages():
            if connection.id in copies:
                writer.write(copies[connection.id], stamp, raw)
        for tick_ns, _, _, values in decisions:
            msg = twist(linear=vector(x=values['linear.x'], y=0.0, z=0.0),
                        angular=vector(x=0.0, y=0.0, z=values['angular.z']))
            writer.write(command, tick_ns + 5_000_000,
                         store.serialize_cdr(msg, 'geometry_msgs/msg/Twist'))
    writer.close()
    return out


def gpu_available():
    from rt_llm_node.backends import cuda_available
    return cuda_available()


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif('not gpu_available()',
                                              reason='no CUDA device (CuPy sees none)')]


@pytest.mark.parametrize('policy,spelling,backend', [
    ('meaning', 'digits', 'numpy'), ('recency', 'compact', 'numpy'),
    ('meaning', 'compact', 'numpy'),
    pytest.param('meaning', 'compact', 'cuda', marks=ON_GPU),   # its attention, its passes
])
def test_samples_are_what_the_engine_fed_the_model(expert_bag, tmp_path, policy, spelling,
                                                   backend):
    values = demo_values(eviction_policy=policy, action_spelling=spelling, backend=backend)
    decisions = model_run(expert_bag, values)
    assert len(decisions) > 500
    commanded = write_commanded(expert_bag, tmp_path / 'commanded', decisions)
    from rt_llm_node.model import load_model
    from rt_llm_node.model.embedded import default_model_path
    tokenizer = load_model(str(default_model_path())).tokenizer
    model = None
    if policy == 'meaning':   # it evicts by attention: the model's, run beside the teacher
        from rt_llm_node.backends import make_backend
        from rt_llm_node.configure import action_grammar
        from rt_llm_node.configure import verify_tokens
        grammar = action_grammar(values, tokenizer)
        model = make_backend(backend, load_model(str(default_model_path())),
                             values['kv_capacity_tokens'],
                             verify_tokens=verify_tokens(0, grammar))
    samples = bag_samples(commanded, values, tokenizer, model, log=lambda text: None)
    assert [s.tick_ns for s in samples] == [d[0] for d in decisions]
    for sample, (tick_ns, context, action, _) in zip(samples, decisions):
        assert np.array_equal(sample.context, context), f'tick {tick_ns}: another context'
        assert sample.action.tolist() == action
    lengths = [len(s.context) for s in samples]
    assert max(lengths) <= values['kv_capacity_tokens'] and min(lengths) < max(lengths)


def test_expert_samples_and_bags_that_cannot_teach(expert_bag, tmp_path):
    from rt_llm_node.demo.recorder import record_demo_bag
    from rt_llm_node.model import load_model
    from rt_llm_node.model.embedded import default_model_path
    tokenizer = load_model(str(default_model_path())).tokenizer
    values = demo_values()
    samples = bag_samples(expert_bag, values, tokenizer, log=lambda text: None)
    assert len(samples) >= 590   # 600 ticks, a stale or unlabelled one at most here and there
    system = tokenizer.encode(values['system_prompt'] + '\n').ids
    prefix = tokenizer.encode('act').ids
    for sample in samples:
        assert sample.context[:len(system)].tolist() == system
        assert sample.context[-len(prefix):].tolist() == prefix
    texts = {tokenizer.decode(s.action.tolist()) for s in samples}
    assert len(texts) > 5, 'the expert steers: several commands'
    bare = record_demo_bag(tmp_path / 'bare', seconds=2.0)
    with pytest.raises(ReplayError, match='/cmd_vel'):
        bag_samples(bare, values, tokenizer, log=lambda text: None)
    with pytest.raises(ReplayError, match='plan fields'):
        bag_samples(expert_bag, load_params(ROOT / 'config' / 'demo.yaml'), tokenizer,
                    log=lambda text: None)


def test_augmented_history_changes_the_shown_actions_only(expert_bag):
    from rt_llm_node.configure import action_grammar
    from rt_llm_node.model import load_model
    from rt_llm_node.model.embedded import default_model_path
    tokenizer = load_model(str(default_model_path())).tokenizer
    values = demo_values()
    clean = bag_samples(expert_bag, values, tokenizer, log=lambda text: None)
    augment = Augment(noise=(0.2, 0.6), hold_rate=0.05)
    noisy = bag_samples(expert_bag, values, tokenizer, log=lambda text: None,
                        augment=augment, seed=3)
    again = bag_samples(expert_bag, values, tokenizer, log=lambda text: None,
                        augment=augment, seed=3)
    assert [s.tick_ns for s in noisy] == [s.tick_ns for s in clean]
    assert all(np.array_equal(a.action, b.action) for a, b in zip(clean, noisy)), \
        'labels stay the recorded commands'
    assert all(np.array_equal(a.context, b.context) for a, b in zip(noisy, again))
    grammar = action_grammar(values, tokenizer)
    first, second = grammar.fields
    value_ids = {t for v in first.values for w in second.values
                 for t in tokenizer.encode(grammar.render({first.name: v, second.name: w})).ids}
    changed = 0
    for a, b in zip(clean, noisy):
        assert len(a.context) == len(b.context)
        differ = a.context != b.context
        changed += bool(differ.any())
        assert set(a.context[differ].tolist()) <= value_ids, 'only action values differ'
    assert changed > 0.8 * len(clean), 'most contexts show another history'
    with pytest.raises(ValueError, match='one per action field'):
        bag_samples(expert_bag, values, tokenizer, log=lambda text: None,
                    augment=Augment(noise=(0.2,)))
    # a restart empties the cache: the next decision sees no earlier action
    restarted = bag_samples(expert_bag, values, tokenizer, log=lambda text: None,
                            augment=Augment(restart_s=2.0), seed=3)
    assert all(np.array_equal(a.action, b.action) for a, b in zip(clean, restarted))
    prefix = tokenizer.encode('act').ids

    def actions_shown(context):
        return sum(context[i:i + len(prefix)].tolist() == prefix
                   for i in range(len(context) - len(prefix)))
    # without restarts: the bag's first tick and the first after each new goal (the meaning
    # policy drops the superseded history)
    before = [actions_shown(s.context) for s in clean].count(0)
    fresh = [actions_shown(s.context) for s in restarted].count(0) - before
    assert 4 <= fresh <= 25, f'about one restart in 2 s of a 20 s bag, not {fresh}'
    with pytest.raises(ValueError, match='out of range'):
        bag_samples(expert_bag, values, tokenizer, log=lambda text: None,
                    augment=Augment(hold_rate=2.0))


def test_the_teacher_backend_keeps_slots_like_a_backend():
    backend = TeacherBackend(8, 100)
    backend.teach([7, 8, 9])
    backend.prefill([1, 2, 3])
    assert backend.argmax() == 7 and backend.contexts[-1].tolist() == [1, 2, 3]
    assert backend.verify([7, 8], None).tolist() == [8, 9]
    backend.rollback(5)
    backend.compact([0, 2, 4])
    assert backend.ids[:backend.length].tolist() == [1, 3, 8]
    from rt_llm_node.backends import BackendError
    with pytest.raises(BackendError):
        backend.prefill(range(6))
    with pytest.raises(BackendError, match='not allowed'):
        backend.teach([5])
        backend.prefill([1])
        backend.argmax(np.array([1, 2]))


def test_the_fine_tuning_command_trains_scores_and_writes_an_adapter(expert_bag, tmp_path):
    """finetune.py end to end on the CPU: the shipped demo model, an expert bag, a held-out one.

    The adapter it writes loads into the node's model (merged, as adapter_path does), the
    held-out score is kept for every --eval-every and at the end, and the learning rate's
    schedule warms up and ends annealed.
    """
    pytest.importorskip('peft', reason='peft trains the adapter')
    pytest.importorskip('torch', reason='torch trains the adapter')
    import json

    import finetune
    from rt_llm_node.demo.recorder import record_demo_bag
    from rt_llm_node.model import load_model
    from rt_llm_node.model.embedded import default_model_path
    values = demo_values(model_path=str(default_model_path()))
    params = tmp_path / 'params.yaml'
    params.write_text(json.dumps({'rt_llm_node': {'ros__parameters': values}}))
    held = record_demo_bag(tmp_path / 'held', seconds=4.0, seed=1_000_004, commands=True)
    out = tmp_path / 'adapter'
    finetune.main(['--params', str(params), '--bags', str(expert_bag), '--holdout', str(held),
                   '--out', str(out), '--steps', '4', '--batch', '4', '--rank', '2',
                   '--device', 'cpu', '--dtype', 'float32', '--attention', 'none',
                   '--eval-every', '2', '--eval-samples', '16', '--history-noise', '0.2,0.6',
                   '--capacities', '160,320'])
    record = json.loads((out / 'training.json').read_text())
    assert record['steps'] == 4 and record['history_noise'] == [0.2, 0.6]
    # every bag at each budget: the same ticks, and more history in the larger cache
    assert record['capacities'] == [160, 320]
    assert sorted(record['bags']) == ['expert@160', 'expert@320']
    assert record['bags']['expert@160'] == record['bags']['expert@320'] > 500
    assert record['samples'] == 2 * record['bags']['expert@160']
    small, large = (bag_samples(expert_bag, demo_values(kv_capacity_tokens=capacity),
                                load_model(str(default_model_path())).tokenizer, log=print)
                    for capacity in (160, 320))
    assert max(len(s.context) for s in small) <= 160 < max(len(s.context) for s in large)
    for bad in (['--capacities', '160,x'], ['--steps', '0'], ['--lr', 'nan'], ['--rank', '0'],
                ['--alpha', 'inf'], ['--max-minutes', '-1'], ['--targets', 'q_proj,qkv']):
        with pytest.raises(SystemExit):
            finetune.main(['--params', str(params), '--bags', str(expert_bag), '--out',
                           str(out), *bad])
    holdout = record['holdout']
    assert holdout['bags'] == ['held'] and holdout['samples'] == 16
    assert [step for step, _, _ in holdout['curve']] == [2, 4]
    assert 0.0 <= holdout['exact'] <= holdout['token_accuracy'] <= 1.0
    base = load_model(str(default_model_path()))
    merged = load_model(str(default_model_path()), adapter=str(out))
    assert any(not np.array_equal(merged.float32(name), base.float32(name))
               for name in base.tensors), 'the adapter changes the model'
    # warm-up from 1/25 of the peak, the peak at 5% of the run, 1e-4 of it at the end
    assert finetune.lr_factor(0.0) == pytest.approx(0.04)
    assert finetune.lr_factor(0.05) == pytest.approx(1.0)
    assert finetune.lr_factor(1.0) == pytest.approx(1e-4)
    assert finetune.lr_factor(0.5) < finetune.lr_factor(0.3)
