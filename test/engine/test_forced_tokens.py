"""An action costs a forward pass a chosen token, whatever the tokenizer.

Tokens the grammar forces (a field's key, a decimal point, a digit every value shares) run in
the pass of the chosen token before them, so a decode costs a pass a choice, not a pass a
token; the actions, the cache and its eviction scores stay exactly those of token-by-token
greedy decoding. The ``compact`` spelling writes each value as one letter word, a single
token in a pretrained model's vocabulary, so an action costs one choice a field even with a
tokenizer that splits numbers into digits (SmolLM2's).
"""

import numpy as np
import pytest

from rt_llm_node.codec import twist_grammar
from rt_llm_node.codec.actions import ActionField
from rt_llm_node.codec.actions import FieldGrammar
from rt_llm_node.codec.actions import GrammarError
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import action_fields
from rt_llm_node.demo.world import DemoWorld

from conftest import run_ticks  # noqa: I100
from test_speculative import demo  # noqa: F401,I100,I201 (a fixture)
from test_speculative import engine_for  # noqa: I100
from test_speculative import random_grammar  # noqa: I100
from test_speculative import random_model  # noqa: I100


def choices(grammar, action_ids):
    """Chosen (not forced) tokens of an action's ids (prefix and end excluded)."""
    state, count = grammar.start(), 0
    for token in action_ids:
        if grammar.done(state):
            break
        count += len(grammar.allowed(state)) > 1
        state = grammar.advance(state, token)
    return count


def compact(grammar):
    fields = [{'name': f.name, 'key': f.key, 'min': f.minimum, 'max': f.maximum,
               'step': f.step} for f in grammar.fields]
    return twist_grammar(grammar.tokenizer, fields, spelling='compact')


@pytest.mark.parametrize('seed', range(5))
@pytest.mark.parametrize('spelling', ['digits', 'compact'])
def test_forced_tokens_ride_with_the_chosen_one(tmp_path, demo, seed, spelling):  # noqa: F811
    checkpoint = random_model(tmp_path, demo, seed)
    grammar = random_grammar(checkpoint.tokenizer, seed)
    if spelling == 'compact':
        if not hasattr(grammar, 'fields'):   # free text has no spelling: the demo's fields
            grammar = twist_grammar(checkpoint.tokenizer, [
                {'name': 'linear.x', 'key': 'v', 'min': -0.2, 'max': 0.8, 'step': 0.1},
                {'name': 'angular.z', 'key': 'w', 'min': -1.5, 'max': 1.5, 'step': 0.25}])
        grammar = compact(grammar)
    runs = {}
    for folded in (False, True):
        engine, clock = engine_for(checkpoint, grammar, 0, capacity=192)
        if not folded:
            engine.forced_run = 0   # a pass a token, as greedy decoding is usually run
        world = DemoWorld(seed, messages=MessageFactory(ros=False))
        actions, passes = [], []
        for result in run_ticks(engine, clock, world, 60):
            actions.append(None if result.action is None else result.action.token_ids)
            passes.append(result.record.n_decode)
            assert result.record.drafted == 0, 'forced tokens are not speculation'
            world.step(0.1, 0.0)
        cache = engine.session.cache
        runs[folded] = (actions, cache.token_ids[:cache.length].copy(),
                        cache.mass[:cache.length].copy(), passes)
    stepped, folded = runs[False], runs[True]
    assert folded[0] == stepped[0], 'other actions'
    assert np.array_equal(folded[1], stepped[1]) and np.array_equal(folded[2], stepped[2])
    n_prefix = len(grammar.prefix_ids)
    for ids, n in zip(folded[0], folded[3]):
        if ids is not None:
            assert n <= choices(grammar, ids[n_prefix:]), 'a pass for a forced token'
    if grammar.max_forced_run():
        assert sum(folded[3]) < sum(stepped[3])


def spelled(tokenizer, spelling, aim=True):
    return FieldGrammar(tokenizer, 'twist', [
        ActionField(f['name'], f['key'], f['min'], f['max'], f['step'], spelling)
        for f in action_fields(aim)])


def test_compact_spelling_is_one_chosen_token_a_field(demo, smollm2_gguf):  # noqa: F811
    from rt_llm_node.model import load_model
    smol = load_model(str(smollm2_gguf)).tokenizer
    for tokenizer in (demo.tokenizer, smol):
        grammar = spelled(tokenizer, 'compact')
        for f in grammar.fields:
            assert f.spelling == 'compact'
            for value in f.values:   # every value round-trips through text and tokens
                values = {g.name: (value if g is f else g.values[0]) for g in grammar.fields}
                text = grammar.render(values)
                assert grammar.parse(text).values == pytest.approx(values)
                if tokenizer is smol:   # a pretrained vocabulary: ' a'..' Z' one token each
                    ids = tokenizer.encode(text).ids
                    assert choices(grammar, ids[len(grammar.prefix_ids):]) == len(grammar.fields)
    assert spelled(smol, 'compact').typical_choices() == 3
    # with digits SmolLM2 spends a token a digit, half of them chosen
    digits = spelled(smol, 'digits')
    assert digits.typical_decode_tokens() == 16 and digits.typical_choices() == 8
    assert spelled(smol, 'compact').typical_decode_tokens() == 6
    assert spelled(smol, 'compact').render({'_aim': -165.0, 'linear.x': 0.8,
                                            'angular.z': 0.0}) == 'act a a v k w g\n'


def test_compact_spelling_past_52_values_and_bad_words(demo):  # noqa: F811
    field = ActionField('linear.x', 'v', 0.0, 99.0, 1.0, 'compact')
    grammar = FieldGrammar(demo.tokenizer, 'twist', [field])
    assert [field.text(v) for v in (0.0, 51.0, 52.0, 99.0)] == ['v aa', 'v aZ', 'v ba', 'v bV']
    assert grammar.parse('act v bV\n').values == {'linear.x': 99.0}
    for bad in ('act v zz', 'act w aa', 'act v', 'act v aa bb'):
        with pytest.raises(GrammarError):
            grammar.parse(bad)
    with pytest.raises(GrammarError, match='spelling'):
        ActionField('linear.x', 'v', 0.0, 1.0, 0.5, 'roman')
