"""TickEngine without ROS, on a model clock: every decision path, deterministic."""

import math
from types import SimpleNamespace

import pytest

from rt_llm_node.admission import Admission
from rt_llm_node.admission import CostModel
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import SYSTEM_PROMPT
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.engine import ModelClock
from rt_llm_node.engine import TickEngine
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path

from conftest import demo_values  # noqa: I100
from conftest import run_ticks


@pytest.fixture(scope='module')
def checkpoint():
    return load_checkpoint(default_model_path())


def make_engine(checkpoint, cost=None, capacity=256):
    clock = ModelClock()
    engine = TickEngine(NumpyBackend(checkpoint, capacity), checkpoint.tokenizer, INPUTS,
                        action_grammar(checkpoint.tokenizer),
                        Admission(cost or CostModel(), margin_ms=0.0), policy='meaning',
                        system_prompt=SYSTEM_PROMPT, clock=clock)
    engine.start()
    return engine, clock


def snapshot(world, now):
    return {topic: (msg, now) for topic, msg in world.observe().items()}


def test_actions_parse_clamp_and_stay_finite_over_many_ticks(checkpoint):
    engine, clock = make_engine(checkpoint, capacity=128)
    world = DemoWorld(5, messages=MessageFactory(ros=False))
    for result in run_ticks(engine, clock, world, 120):
        assert result.action is not None, result.refusal
        v, w = result.action.values['linear.x'], result.action.values['angular.z']
        assert -0.2 <= v <= 0.8 and -1.5 <= w <= 1.5 and math.isfinite(v + w)
        assert engine.session.length <= 128
        world.step(v, w)
    assert engine.session.cache.evicted_tokens > 0


def test_deadline_refusal_leaves_the_cache_untouched(checkpoint):
    engine, clock = make_engine(checkpoint, CostModel(prefill=(40.0, 0.0, 0.0)))
    world = DemoWorld(6, messages=MessageFactory(ros=False))
    length = engine.session.length
    result = engine.tick(snapshot(world, 0.0), 0.0, 1 / 30)
    assert result.refusal.reason == 'deadline'
    assert result.refusal.predicted_ms > result.refusal.available_ms
    assert engine.session.length == length


def test_watchdog_aborts_and_rolls_back(checkpoint):
    # prefill is cheap, each decode step 40 ms: an action of one decode step or more
    # (the demo's takes one: its second field is deferred) cannot finish in 33 ms
    engine, clock = make_engine(checkpoint, CostModel(prefill=(1.0, 0.0, 0.0),
                                                      decode=(40.0, 0.0)))
    engine.recent_decodes.clear()
    engine.typical_decodes = 0  # admission thinks no decode step is needed
    world = DemoWorld(7, messages=MessageFactory(ros=False))
    length, pending = engine.session.length, engine.session.pending
    result = engine.tick(snapshot(world, 0.0), 0.0, 1 / 30)
    assert result.refusal is not None and result.refusal.reason == 'overrun_abort'
    assert engine.session.length == length and engine.session.pending == pending
    assert engine.rendered == {}, 'aborted inputs are rendered again next tick'


class SlowClock(ModelClock):
    """A machine five times slower than its cost model says."""

    def charge(self, ms):
        super().charge(5 * ms)


def test_a_late_tick_raises_the_scale_so_the_next_is_refused_in_time(checkpoint):
    engine = TickEngine(NumpyBackend(checkpoint, 256), checkpoint.tokenizer, INPUTS,
                        action_grammar(checkpoint.tokenizer),
                        Admission(CostModel(prefill=(1.0, 0.0, 0.0), decode=(8.0, 0.0)),
                                  margin_ms=0.0),
                        policy='meaning', system_prompt=SYSTEM_PROMPT, clock=SlowClock())
    engine.start()
    world = DemoWorld(9, messages=MessageFactory(ros=False))
    results = list(run_ticks(engine, engine.clock, world, 3))
    reasons = [r.refusal.reason if r.refusal else 'action' for r in results]
    # tick 0 is admitted (predicted 9 ms: prefill 1, one decode step 8) and runs 5x longer
    # (45 ms): late, so no action, and learned from
    assert reasons[0] == 'overrun_abort' and results[0].record.late
    assert engine.admission.scale >= 4.0
    assert reasons[1:] == ['deadline', 'deadline'], reasons


class HostClock(ModelClock):
    """A machine ``factor`` times as fast as its cost model says (0.2: five times faster)."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def charge(self, ms):
        super().charge(self.factor * ms)


def probing_engine(checkpoint, factor):
    # predicted 41 ms a tick (prefill 1, one decode step 40) against 33 ms: refused, unless
    # the model is 4x too pessimistic (min_scale 0.25: 10.25 ms)
    engine = TickEngine(NumpyBackend(checkpoint, 256), checkpoint.tokenizer, INPUTS,
                        action_grammar(checkpoint.tokenizer),
                        Admission(CostModel(prefill=(1.0, 0.0, 0.0), decode=(40.0, 0.0)),
                                  margin_ms=0.0, probe_ticks=5, min_scale=0.25),
                        policy='meaning', system_prompt=SYSTEM_PROMPT,
                        clock=HostClock(factor))
    engine.start()
    return engine


def drive(engine, world, n):
    results = []
    for result in run_ticks(engine, engine.clock, world, n):
        results.append(result)
        if result.action is not None:
            world.step(result.action.values['linear.x'], result.action.values['angular.z'])
    return results


def test_a_probe_unlocks_a_cost_model_calibrated_on_a_slow_host(checkpoint):
    engine = probing_engine(checkpoint, 0.2)   # the host is 5x faster than calibrated
    results = drive(engine, DemoWorld(11, messages=MessageFactory(ros=False)), 12)
    reasons = [r.refusal.reason if r.refusal else 'action' for r in results]
    assert reasons == ['deadline'] * 5 + ['action'] * 7, reasons
    assert [r.record.probe for r in results] == [False] * 5 + [True] + [False] * 6
    assert engine.admission.floor == pytest.approx(0.25), 'never below min_scale'
    for r in results[5:]:
        assert r.record.total_ms <= 1e3 / 30 and not r.record.late


def test_a_probe_that_would_overrun_is_aborted_and_the_next_waits_twice_as_long(checkpoint):
    engine = probing_engine(checkpoint, 1.0)   # the model was right
    results = drive(engine, DemoWorld(12, messages=MessageFactory(ros=False)), 40)
    reasons = [r.refusal.reason if r.refusal else 'action' for r in results]
    probes = [i for i, r in enumerate(results) if r.record.probe]
    assert probes == [5, 16, 37], probes          # after 5, then 10, then 20 refusals
    assert all(reasons[i] == 'overrun_abort' for i in probes), reasons
    assert reasons.count('action') == 0 and not any(r.record.late for r in results)
    assert engine.admission.floor == 1.0


def test_no_probes_under_the_model_clock(checkpoint):
    from rt_llm_node.configure import configure_engine
    values = demo_values(backend='numpy', admission_probe_ticks=5)
    engine = configure_engine(values, clock=ModelClock(), log=lambda text: None,
                              cost_model=CostModel(prefill=(50.0, 0.0, 0.0)))
    assert engine.admission.probe_ticks == 0


def test_stale_and_malformed_inputs_are_refusals_not_crashes(checkpoint):
    engine, clock = make_engine(checkpoint)
    world = DemoWorld(8, messages=MessageFactory(ros=False))
    snap = snapshot(world, 0.0)
    clock.advance_to(1.0)
    result = engine.tick(snap, 1.0, 1.0 + 1 / 30)
    assert result.refusal.reason == 'stale_input' and '/scan' in result.refusal.detail
    snap.update(snapshot(world, 1.0))
    bad = snap['/odom'][0]
    bad.pose.pose.position.x = float('nan')
    result = engine.tick(snap, 1.0, 1.0 + 1 / 30)
    assert result.refusal.reason == 'input_error' and 'position.x' in result.refusal.detail
    snap['/odom'] = (SimpleNamespace(pose=None), 1.0)
    result = engine.tick(snap, 1.0, 1.0 + 1 / 30)
    assert result.refusal.reason == 'input_error'
    snap.update(snapshot(world, 1.0))
    snap['/detections'] = (SimpleNamespace(data='x' * 100000), 1.0)
    result = engine.tick(snap, 1.0, 1.0 + 1 / 30)
    assert result.action is not None, 'an oversized string is capped, not fatal'


def test_not_started_engine_refuses_not_ready(checkpoint):
    clock = ModelClock()
    engine = TickEngine(NumpyBackend(checkpoint, 64), checkpoint.tokenizer, INPUTS,
                        action_grammar(checkpoint.tokenizer), Admission(CostModel()),
                        clock=clock)
    assert engine.tick({}, 0.0, 0.03).refusal.reason == 'not_ready'


def test_one_long_action_does_not_keep_later_ticks_refused(checkpoint):
    # decode steps of 5 ms: 7 of them (a rare 9-token action) cannot fit in 33 ms, 2 can
    from rt_llm_node.engine import DECODE_WINDOW
    engine, clock = make_engine(checkpoint, CostModel(prefill=(2.0, 0.0, 0.0),
                                                      decode=(5.0, 0.0)))
    engine.recent_decodes.append((engine.index, 7, 7, False))   # just seen: a long action
    world = DemoWorld(8, messages=MessageFactory(ros=False))
    decisions = []
    for result in run_ticks(engine, clock, world, DECODE_WINDOW + 20):
        decisions.append(result.refusal.reason if result.refusal else 'action')
        world.step(0.0, 0.0)
    assert decisions[0] == 'deadline'
    assert 'action' in decisions[DECODE_WINDOW:], 'the long action was never forgotten'


def test_joint_trajectory_actions_are_bounded_by_the_measured_joints():
    """An arm's targets: within the limits and a step of the measured positions.

    A JointTrajectory needs a joint-state input; without one configure refuses.
    """
    from rt_llm_node.configure import configure_engine
    from rt_llm_node.configure import ConfigurationError
    arm = {'action_type': 'trajectory_msgs/msg/JointTrajectory',
           'action_fields': ['shoulder', 'elbow'], 'action_min': [-1.0, 0.0],
           'action_max': [1.0, 2.0], 'action_step': [0.5, 0.25], 'action_grammar_min': [],
           'action_grammar_max': [], 'joint_max_step': [0.3]}
    with pytest.raises(ConfigurationError, match='JointState'):
        configure_engine(demo_values(backend='numpy', **arm), clock=ModelClock(),
                         log=lambda text: None, cost_model=CostModel())
    values = demo_values(backend='numpy', **arm)
    for key, value in (('input_topics', '/joint_states'),
                       ('input_types', 'sensor_msgs/msg/JointState'),
                       ('input_max_age_s', 0.2), ('input_kinds', 'observation'),
                       ('input_prefixes', 'joints'), ('input_max_tokens', 24)):
        values[key] = values[key] + [value]
    clock = ModelClock()
    engine = configure_engine(values, clock=clock, log=lambda text: None,
                              cost_model=CostModel())
    assert [f.key for f in engine.grammar.fields] == ['j0', 'j1']
    world = DemoWorld(9, messages=MessageFactory(ros=False))
    measured = [0.6, 1.0]
    for i in range(20):
        now = i / 30
        clock.advance_to(now)
        snap = snapshot(world, now)
        snap['/joint_states'] = (SimpleNamespace(name=['shoulder', 'elbow'],
                                                 position=measured), now)
        result = engine.tick(snap, now, now + 1 / 30)
        assert result.action is not None, result.refusal
        shoulder, elbow = result.action.values['shoulder'], result.action.values['elbow']
        assert -1.0 <= shoulder <= 1.0 and abs(shoulder - measured[0]) <= 0.3 + 1e-9
        assert 0.0 <= elbow <= 2.0 and abs(elbow - measured[1]) <= 0.3 + 1e-9
        measured = [shoulder, elbow]
    now = 20 / 30
    clock.advance_to(now)
    snap = snapshot(world, now)
    snap['/joint_states'] = (SimpleNamespace(name=['shoulder'], position=[0.0]), now)
    result = engine.tick(snap, now, now + 1 / 30)
    assert result.refusal.reason == 'input_error' and 'elbow' in result.refusal.detail


def test_a_blind_scan_or_an_empty_instruction_is_refused_every_tick_never_driven(checkpoint):
    engine, clock = make_engine(checkpoint)
    world = DemoWorld(8, messages=MessageFactory(ros=False))
    snap = {}
    for kind in ('blind', 'no task'):
        results = []
        for i in range(30):
            now = clock.now() + 1 / 30
            clock.advance_to(now)
            snap.update(snapshot(world, now))
            if kind == 'blind':
                snap['/scan'][0].ranges = [float('nan')] * len(snap['/scan'][0].ranges)
            else:
                snap['/instruction'] = (SimpleNamespace(data='  \x00 '), now)
            results.append(engine.tick(snap, now, now + 1 / 30))
        assert all(r.action is None for r in results), kind
        assert {r.refusal.reason for r in results} == {'input_error'}, kind
        detail = results[-1].refusal.detail
        assert ('sees nothing usable' if kind == 'blind' else 'empty instruction') in detail


def stamped(msg, seconds):
    msg.header = SimpleNamespace(stamp=SimpleNamespace(sec=int(seconds),
                                                       nanosec=int(seconds % 1 * 1e9)))
    return msg


def test_staleness_uses_the_header_stamp_with_a_tolerance_and_says_which_clock(checkpoint):
    from rt_llm_node.engine import header_stamp_lag
    engine, clock = make_engine(checkpoint)
    world = DemoWorld(8, messages=MessageFactory(ros=False))
    ros_now = 1_796_000_000.0   # the robot's ROS time when the messages arrive
    clock.advance_to(1.0)
    snap = snapshot(world, 1.0)
    assert engine.tick(snap, 1.0, 1.0 + 1 / 30).action is not None, 'fresh, no stamps'
    for stamp, expected in ((0.0, None), (ros_now - 0.1, None),       # unset; 100 ms old
                            (86400.0, 'ms old by its header stamp'),   # stamped in 1970
                            (2_147_483_000.0, 'in the future')):       # stamped in 2038
        snap = {topic: (msg, 1.0) for topic, (msg, _) in snapshot(world, 1.0).items()}
        scan = stamped(snap['/scan'][0], stamp)
        snap['/scan'] = (scan, 1.0, header_stamp_lag(scan, ros_now))
        result = engine.tick(snap, 1.0, 1.0 + 1 / 30)
        if expected is None:
            assert result.action is not None, (stamp, result.refusal)
        else:
            assert result.refusal.reason == 'stale_input', stamp
            assert expected in result.refusal.detail and '/scan' in result.refusal.detail
    # a clock offset within the tolerance is not staleness
    snap = {topic: (msg, 1.0) for topic, (msg, _) in snapshot(world, 1.0).items()}
    scan = stamped(snap['/scan'][0], ros_now + 0.3)   # 0.3 s ahead: within 0.5
    snap['/scan'] = (scan, 1.0, header_stamp_lag(scan, ros_now))
    assert engine.tick(snap, 1.0, 1.0 + 1 / 30).action is not None
    # by arrival as before: the refusal says so
    clock.advance_to(5.0)
    result = engine.tick(snapshot(world, 1.0), 5.0, 5.0 + 1 / 30)
    assert result.refusal.reason == 'stale_input' and 'by arrival' in result.refusal.detail


def test_input_caps_the_cache_cannot_hold_are_refused_at_configure():
    from rt_llm_node.configure import configure_engine
    from rt_llm_node.configure import ConfigurationError
    values = demo_values(backend='numpy', kv_capacity_tokens=64,
                         input_max_tokens=[16, 24, 400])
    with pytest.raises(ConfigurationError, match='kv_capacity_tokens = 64 cannot hold'):
        configure_engine(values, clock=ModelClock(), log=lambda text: None,
                         cost_model=CostModel())


@pytest.mark.parametrize('weight_format, kv_dtype', [('native', 'int8'), ('int4', 'native')])
def test_a_gguf_model_runs_the_tick_as_configured(tmp_path, weight_format, kv_dtype):
    """A GGUF model_path, an int8 cache or on-load int4 weights: configure and tick as usual."""
    pytest.importorskip('gguf', reason='the gguf package reads GGUF files')
    from gguf_models import write_gguf
    from rt_llm_node.configure import configure_engine
    kind = 'Q4_K' if weight_format == 'native' else 'F16'   # int4 quantizes float matrices
    path = write_gguf(tmp_path / 'model.gguf', 'qwen2', kind)
    lines = []
    values = demo_values(backend='numpy', model_path=str(path), weight_format=weight_format,
                         kv_dtype=kv_dtype)
    engine = configure_engine(values, clock=ModelClock(), log=lines.append)
    assert engine.backend.kv_dtype == kv_dtype
    weights = next(line for line in lines if 'weights' in line)
    assert ('Q4_K' if weight_format == 'native' else 'int4') in weights, weights
    assert any(f'({kv_dtype}, ' in line for line in lines), lines
    # at 10 Hz: a random model's ticks on numpy take most of a 33 ms period on a busy host,
    # and what is checked here is the configuration, not the speed
    world = DemoWorld(3, messages=MessageFactory(ros=False))
    results = []
    for result in run_ticks(engine, engine.clock, world, 20, rate_hz=10.0):
        results.append(result)
        if result.action is not None:
            world.step(result.action.values['linear.x'], result.action.values['angular.z'])
    grammar = engine.grammar
    assert sum(r.action is not None for r in results) >= 10, [r.refusal for r in results]
    for r in results:
        assert (r.action is None) != (r.refusal is None)
        if r.action is not None:   # a random model's action: parsed, within the limits
            for field in grammar.fields:
                value = r.action.values[field.name]
                assert math.isfinite(value) and field.minimum <= value <= field.maximum
