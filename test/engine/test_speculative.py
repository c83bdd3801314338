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


@pytest.mark.parametrize('seed', range(6))
def test_random_models_and_grammars_act_the_same_with_drafts(tmp_path, demo, seed):
    checkpoint = random_model(tmp_path, demo, seed)
    grammar = random_grammar(checkpoint.tokenizer, seed)
    runs = {}
    for speculative in (0, 2, 4, 8):
        engine, clock = engine_for(checkpoint, grammar, speculative, capacity=192)
        world = DemoWorld(seed, messages=MessageFactory(ros=False))
        actions, passes, accepted = [], 0, 0
        for result in run_ticks(engine, clock, world, 90):
            actions.append(None if result.action is None else result.action.token_ids)
            passes += result.record.n_decode
            accepted += result.record.accepted
            world.step(0.1, 0.0)
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
    passes = [p for _, _, p in engine.recent_decodes]
    fed = [n for _, n, _ in engine.recent_decodes]
    assert sum(passes) < sum(fed)   # drafts were kept
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

    Run here on the numpy backend (its verify has the same contract as the GPU's).
    """
    import sys
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    from bench_cuda import action
    checkpoint = random_model(tmp_path, demo, 4)
    vocab = checkpoint.config.vocab_size
    rng = np.random.default_rng(5)
    allowed = np.sort(rng.choice(vocab, 24, replace=False))
    prompts = [rng.integers(0, vocab, 20) for _ in range(6)]
    plain, drafted = NumpyBackend(checkpoint, 96), NumpyBackend(checkpoint, 96)
    last, kept = [], 0
    for prompt in prompts + prompts[::-1]:
        for backend in (plain, drafted):
            backend.rollback(0)
            backend.prefill(prompt)
        want = action(plain, allowed, 0, [])
        got = action(drafted, allowed, 5, last)
        assert got[0] == want[0]
        assert want[1] == 6 and got[1] <= 6
        assert np.array_equal(drafted.kv.k[:, :26], plain.kv.k[:, :26])
        last, kept = got[0], kept + got[3]
    assert kept > 0
