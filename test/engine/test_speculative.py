"""Speculative action decoding: exactly the greedy actions, in fewer forward passes.

The numpy backend's verify must equal decode steps bit for bit (logits, attention mass,
cache); the engine with drafting on must give the same actions, tick for tick, and leave the
same cache (tokens and eviction scores) as with it off: on random models under random action
grammars, and on the shipped demo policy's held-out episodes.
"""

import dataclasses

import numpy as np
import pytest

from rt_llm_node.admission import Admission
from rt_llm_node.admission import CostModel
from rt_llm_node.backends import BackendError
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.codec import StringGrammar
from rt_llm_node.codec import twist_grammar
from rt_llm_node.codec.actions import GrammarError
from rt_llm_node.demo.evaluate import _checkpoint
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.demo.task import SYSTEM_PROMPT
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.engine import ModelClock
from rt_llm_node.engine import TickEngine
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.model.synthetic import random_weights
from rt_llm_node.model.synthetic import write_checkpoint

from conftest import ROOT  # noqa: I100
from conftest import run_ticks


@pytest.fixture(scope='module')
def demo():
    return load_checkpoint(default_model_path())


def random_model(tmp_path, demo, seed):
    """Make a random-weight model of a random small shape with the demo's real tokenizer."""
    rng = np.random.default_rng(seed)
    heads, kv_heads = [(2, 1), (4, 2), (4, 4)][int(rng.integers(3))]
    hidden = int(rng.choice([32, 64, 96]))
    config = dataclasses.replace(
        demo.config, hidden_size=hidden, intermediate_size=int(rng.choice([64, 128, 192])),
        num_layers=int(rng.integers(1, 4)), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads)
    weights = random_weights(config, seed)
    for name in weights:   # larger weights: sharper, more varied logits than the 0.02 init
        if not name.endswith('norm.weight'):
            weights[name] *= 10
    path = write_checkpoint(tmp_path / f'm{seed}', config, weights, demo.tokenizer, 'F32')
    return load_checkpoint(path)


def random_grammar(tokenizer, seed):
    """Make a Twist grammar of 1-3 fields with random ranges and steps, or free text."""
    rng = np.random.default_rng(seed)
    if rng.random() < 0.25:
        return StringGrammar(tokenizer, int(rng.integers(2, 8)))
    names = ['linear.x', 'angular.z', 'linear.y']
    while True:
        fields = []
        for i in range(int(rng.integers(1, 4))):
            step = float(rng.choice([0.05, 0.1, 0.25, 0.5]))
            low = -step * int(rng.integers(0, 12))
            fields.append({'name': names[i], 'key': 'vwy'[i], 'min': low,
                           'max': low + step * int(rng.integers(1, 24)), 'step': step})
        try:
            return twist_grammar(tokenizer, fields)
        except GrammarError:
            continue


def engine_for(checkpoint, grammar, speculative, capacity):
    clock = ModelClock()
    engine = TickEngine(NumpyBackend(checkpoint, capacity), checkpoint.tokenizer, INPUTS,
                        grammar, Admission(CostModel(), margin_ms=0.0), policy='meaning',
                        system_prompt=SYSTEM_PROMPT, clock=clock,
                        speculative_tokens=speculative)
    engine.start()
    return engine, clock


@pytest.mark.parametrize('kv_dtype', ['native', 'int8'])
def test_verify_equals_decode_steps_bit_for_bit(tmp_path, demo, kv_dtype):
    checkpoint = random_model(tmp_path, demo, 3)
    vocab = checkpoint.config.vocab_size
    rng = np.random.default_rng(0)
    verified = NumpyBackend(checkpoint, 96, kv_dtype)
    stepped = NumpyBackend(checkpoint, 96, kv_dtype)
    prompt = rng.integers(0, vocab, 30)
    verified.prefill(prompt)
    stepped.prefill(prompt)
    feed = rng.integers(0, vocab, 7)
    allowed = [None] + [np.sort(rng.choice(vocab, 5, replace=False)) for _ in range(6)]
    predicted = verified.verify(feed, allowed)
    for row, (token, ok) in enumerate(zip(feed, allowed)):
        stepped.decode(token)
        assert predicted[row] == stepped.argmax(ok)
        assert np.array_equal(verified.row_mass(row), stepped.attention_mass())
    assert np.array_equal(verified.logits(), stepped.logits())
    assert np.array_equal(verified.kv.k[:, :37], stepped.kv.k[:, :37])
    assert np.array_equal(verified.kv.v[:, :37], stepped.kv.v[:, :37])
    # rolled back into the verified rows: that row's logits, as after its decode step
    verified.rollback(33)
    stepped.rollback(30)
    for token in feed[:3]:
        stepped.decode(token)
    assert np.array_equal(verified.logits(), stepped.logits())
    assert np.array_equal(verified.attention_mass(), stepped.attention_mass())
    with pytest.raises(BackendError):
        verified.row_mass(3)   # rolled back
    with pytest.raises(BackendError):
        verified.verify(feed[:2], allowed[:1])   # an allowed set a row


def test_prefill_verify_equals_prefill_then_decode_steps(tmp_path, demo):
    """The fused call: the prefill's greedy token and rows, then each draft's, as if stepped."""
    checkpoint = random_model(tmp_path, demo, 2)
    vocab = checkpoint.config.vocab_size
    rng = np.random.default_rng(3)
    fused, stepped = NumpyBackend(checkpoint, 96), NumpyBackend(checkpoint, 96)
    for backend in (fused, stepped):
        backend.prefill(np.full(10, 5))
    ids, drafts = rng.integers(0, vocab, 20), rng.integers(0, vocab, 5)
    allowed = [np.sort(rng.choice(vocab, 6, replace=False)) for _ in range(5)] + [None]
    predicted = fused.prefill_verify(ids, drafts, allowed)
    stepped.prefill(ids)
    masses, logits = [stepped.attention_mass()], [stepped.logits()]
    assert predicted[0] == stepped.argmax(allowed[0])
    for row, token in enumerate(drafts, 1):
        stepped.decode(token)
        assert predicted[row] == stepped.argmax(allowed[row])
        masses.append(stepped.attention_mass())
        logits.append(stepped.logits())
    assert len(predicted) == 6 and fused.length == 35
    for row in range(6):
        assert np.array_equal(fused.row_mass(row), masses[row])
    assert np.array_equal(fused.kv.k[:, :35], stepped.kv.k[:, :35])
    fused.rollback(30)   # the prefill's end: what the prefill left
    assert np.array_equal(fused.logits(), logits[0])
    assert np.array_equal(fused.attention_mass(), masses[0])
    fused.prefill_verify(ids[:1], drafts[:2], allowed[:3])   # a one-token prefill too
    assert fused.length == 33
    for bad, match in (((ids, [], [None]), 'at least one draft'),
                       ((ids, drafts, [None]), 'allowed sets'),
                       ((np.ones(70, np.int64), drafts, [None] * 6), 'do not fit')):
        with pytest.raises(BackendError, match=match):
            fused.prefill_verify(*bad)
    assert fused.length == 33


@pytest.mark.parametrize('seed', range(6))
def test_random_models_and_grammars_act_the_same_with_drafts(tmp_path, demo, seed):
    checkpoint = random_model(tmp_path, demo, seed)
    grammar = random_grammar(checkpoint.tokenizer, seed)
    runs = {}
    for speculative in (0, 2, 4, 8):
        engine, clock = engine_for(checkpoint, grammar, speculative, capacity=192)
        world = DemoWorld(seed, messages=MessageFactory(ros=False))
        actions, passes, accepted, fused = [], 0, 0, 0
        for result in run_ticks(engine, clock, world, 90):
            actions.append(None if result.action is None else result.action.token_ids)
            passes += result.record.n_decode
            accepted += result.record.accepted
            fused += result.record.fused
            world.step(0.1, 0.0)
        assert (fused > 0) == (speculative > 0), 'drafts verified beside the prefill'
        cache = engine.session.cache
        runs[speculative] = (actions, cache.token_ids[:cache.length].copy(),
                             cache.mass[:cache.length].copy(), cache.evicted_tokens, passes,
                             accepted)
    plain = runs[0]
    assert plain[3] > 0, 'the run should have evicted (the cache is small)'
    for speculative, run in runs.items():
        assert run[0] == plain[0], f'speculative_tokens={speculative}: other actions'
        assert np.array_equal(run[1], plain[1]) and np.array_equal(run[2], plain[2])
        assert run[3] == plain[3]
        assert run[4] <= plain[4]
        assert speculative == 0 or run[5] > 0, 'no draft was ever kept'


def test_the_demo_policy_acts_the_same_in_fewer_passes():
    path = default_model_path()
    checkpoint = _checkpoint(str(path))
    kwargs = {'inputs': model_inputs(path), 'aim': model_aim(path), 'max_ticks': 200}
    plain_passes, spec_passes = [], []
    drafted = accepted = 0
    for seed in range(HELD_OUT_SEED0, HELD_OUT_SEED0 + 3):
        plain = run_model_episode(checkpoint, seed, 'meaning', 256, **kwargs)
        spec = run_model_episode(checkpoint, seed, 'meaning', 256, speculative_tokens=4,
                                 **kwargs)
        assert spec['actions'] == plain['actions'] and spec['executed'] == plain['executed']
        plain_passes += plain['passes']
        spec_passes += spec['passes']
        drafted += spec['drafted']
        accepted += spec['accepted']
    assert drafted > 0 and accepted > 0
    assert np.mean(spec_passes) < np.mean(plain_passes)


def test_admission_plans_the_quantile_of_recent_passes(demo):
    """With drafts, a tick is priced by the passes recent actions took, not tokens fed."""
    from rt_llm_node.demo.task import action_grammar
    grammar = action_grammar(demo.tokenizer, model_aim(default_model_path()))
    engine, clock = engine_for(demo, grammar, 4, 256)
    engine.admission.model = CostModel(prefill=(0.5, 0.01, 0.0), decode=(0.3, 0.0),
                                       verify=(0.25, 0.02, 0.0))
    assert engine.expected_passes(0) is None   # nothing measured yet: plan tokens as steps
    world = DemoWorld(HELD_OUT_SEED0, messages=MessageFactory(ros=False))
    results = []
    for result in run_ticks(engine, clock, world, 90):
        results.append(result)
        world.step(*(result.action.values[f] for f in ('linear.x', 'angular.z'))
                   if result.action else (0.0, 0.0))
    speculated = [(n, p) for _, n, p, drafted in engine.recent_decodes if drafted]
    passes = [p for _, p in speculated]
    assert passes and sum(passes) < sum(n for n, _ in speculated)   # drafts were kept
    expected = int(np.quantile(passes, engine.admission.quantile, method='higher'))
    assert engine.expected_passes(90) == expected <= engine.expected_decodes(90)
    # each planned pass priced as the dearer of a step and a verify pass of 5 tokens
    model = engine.admission.model
    assert model.tick_ms(0, 100, 2, pass_tokens=5) == pytest.approx(
        2 * max(model.decode_ms(100), model.verify_ms(5, 100)))
    assert all(not r.record.late for r in results)
    plain, _ = engine_for(demo, grammar, 0, 256)
    assert plain.expected_passes(0) is None


def test_drafts_are_capped_by_what_the_backend_verifies_in_a_pass(demo):
    """A backend that verifies at most k tokens a pass gets at most k - 1 drafts a pass."""
    from rt_llm_node.backends import verify_limit
    backend = NumpyBackend(demo, 64)
    assert verify_limit(backend) == 64
    backend.verify_tokens = 3
    engine = TickEngine(backend, demo.tokenizer, INPUTS, twist_grammar(demo.tokenizer, [
        {'name': 'linear.x', 'key': 'v', 'min': -1.0, 'max': 1.0, 'step': 0.1}]),
        Admission(CostModel(), margin_ms=0.0), speculative_tokens=8)
    assert engine.speculative_tokens == 2
    backend.verify_tokens = 0
    assert TickEngine(backend, demo.tokenizer, INPUTS, engine.grammar,
                      Admission(CostModel(), margin_ms=0.0),
                      speculative_tokens=8).speculative_tokens == 0


def test_the_gpu_benchmarks_draft_loop_chooses_the_greedy_tokens(tmp_path, demo):
    """benchmarks/bench_cuda.py's tick with drafts gives plain greedy decoding's tokens.

    With them verified after the prefill and beside it. Run here on the numpy backend (its
    verify has the same contract as the GPU's).
    """
    import sys
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    from bench_cuda import action
    from bench_cuda import fused_action
    checkpoint = random_model(tmp_path, demo, 4)
    vocab = checkpoint.config.vocab_size
    rng = np.random.default_rng(5)
    allowed = np.sort(rng.choice(vocab, 24, replace=False))
    prompts = [rng.integers(0, vocab, 20) for _ in range(6)]
    plain, drafted, fused = (NumpyBackend(checkpoint, 96) for _ in range(3))
    last, kept, kept_fused = [], 0, 0
    for prompt in prompts + prompts[::-1] + [prompts[0]] * 2:
        for backend in (plain, drafted, fused):
            backend.rollback(0)
        for backend in (plain, drafted):
            backend.prefill(prompt)
        want = action(plain, allowed, 0, [])
        got = action(drafted, allowed, 5, last)
        if last:   # the last action verified beside the prefill
            beside = fused_action(fused, prompt, allowed, 5, last)
        else:
            fused.prefill(prompt)
            beside = action(fused, allowed, 5, last)
        assert got[0] == want[0] == beside[0]
        assert want[1] == 6 and got[1] <= 6 and beside[1] <= 6
        for backend in (drafted, fused):
            assert np.array_equal(backend.kv.k[:, :26], plain.kv.k[:, :26])
        last, kept, kept_fused = got[0], kept + got[3], kept_fused + beside[3]
    assert kept_fused > 0   # the repeated prompt: its whole action drafted right
    assert beside[1] == 0 and beside[3] == 6
    assert kept > 0


def test_a_wrong_first_draft_backs_off_to_drafting_after_the_prefill(demo):
    """A fused pass that keeps nothing: the next FUSE_BACKOFF ticks draft after the prefill."""
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.engine import FUSE_BACKOFF
    grammar = action_grammar(demo.tokenizer, model_aim(default_model_path()))
    runs = {}
    for speculative in (0, 4):
        engine, clock = engine_for(demo, grammar, speculative, 256)
        world = DemoWorld(HELD_OUT_SEED0, messages=MessageFactory(ros=False))
        records, actions = [], []
        for i, result in enumerate(run_ticks(engine, clock, world, 30)):
            records.append(result.record)
            actions.append(None if result.action is None else result.action.token_ids)
            world.step(*(result.action.values[f] for f in ('linear.x', 'angular.z'))
                       if result.action else (0.0, 0.0))
            if i == 9 and speculative:   # the next tick's first draft: a token it will not choose
                first = engine.last_action_ids[0]
                engine.last_action_ids = [int(next(t for t in grammar.allowed(grammar.start())
                                                   if t != first))]
        runs[speculative] = records, actions
    assert runs[4][1] == runs[0][1]   # the same actions all the same
    records = runs[4][0]
    assert records[10].fused   # its one draft wrong (the later passes of the tick draft anew)
    assert not any(r.fused for r in records[11:11 + FUSE_BACKOFF])
    assert any(r.verify_passes for r in records[11:11 + FUSE_BACKOFF])   # drafts after it
    assert records[11 + FUSE_BACKOFF].fused


def test_speculation_never_refuses_a_tick_that_plain_decoding_acts_on(demo):
    """Verify passes priced far above the decode steps they stand for (a slow device).

    Speculation must then decode plainly rather than refuse: every tick acts as with
    speculation off, with the same actions.
    """
    from rt_llm_node.demo.task import action_grammar
    cost = CostModel(prefill=(1.0, 0.01, 0.0), decode=(1.5, 0.0), compact=(0.1, 0.0),
                     verify=(40.0, 1.0, 0.0), fused=(40.0, 1.0, 0.0))

    grammar = action_grammar(demo.tokenizer, model_aim(default_model_path()))

    def decisions(speculative):
        engine, clock = engine_for(demo, grammar, 3 if speculative else 0, 256)
        engine.admission.model = cost
        world = DemoWorld(HELD_OUT_SEED0 + 3, messages=MessageFactory(ros=False))
        out = []
        for result in run_ticks(engine, clock, world, 60):
            out.append(result.refusal.reason if result.action is None
                       else tuple(result.action.token_ids))
            world.step(0.2, 0.1)
        return out
    plain, speculating = decisions(False), decisions(True)
    assert all(isinstance(d, tuple) for d in plain), plain
    assert speculating == plain
