"""Property tests of the codec: any message, any text, any logits.

For every renderer, 10,000 generated messages (NaN, infinities, huge and negative values,
empty and ragged arrays, any unicode): the line renders or the renderer raises RenderError,
never anything else, and a rendered line is short, printable and free of 'nan' or 'inf'.
For the action grammar, 10,000 decodes under arbitrary logits and 10,000 parses of arbitrary
text: every action is complete, finite and within its limits, or a GrammarError.
"""

import math
from types import SimpleNamespace as NS

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

from rt_llm_node.codec import GrammarError
from rt_llm_node.codec import InputSpec
from rt_llm_node.codec import ObservationCodec
from rt_llm_node.codec import RenderError
from rt_llm_node.codec import twist_grammar
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path

EXAMPLES = settings(max_examples=10_000, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.floats(-1e3, 1e3), st.integers(-10**40, 10**40),
                    st.sampled_from([0.0, -0.0, 1e-300, 1e39, -1e39]))
texts = st.text(max_size=300)


def vec():
    return st.builds(NS, x=numbers, y=numbers, z=numbers)


def quat():
    return st.builds(NS, x=numbers, y=numbers, z=numbers, w=numbers)


MESSAGES = {
    'sensor_msgs/msg/LaserScan': st.builds(
        NS, ranges=st.lists(numbers, max_size=400), angle_min=numbers, angle_increment=numbers,
        range_min=numbers, range_max=numbers),
    'nav_msgs/msg/Odometry': st.builds(
        NS, pose=st.builds(NS, pose=st.builds(NS, position=vec(), orientation=quat())),
        twist=st.builds(NS, twist=st.builds(NS, linear=vec(), angular=vec()))),
    'sensor_msgs/msg/Imu': st.builds(NS, orientation=quat(), angular_velocity=vec(),
                                     linear_acceleration=vec()),
    'sensor_msgs/msg/JointState': st.builds(NS, name=st.lists(texts, max_size=12),
                                            position=st.lists(numbers, max_size=12)),
    'geometry_msgs/msg/Twist': st.builds(NS, linear=vec(), angular=vec()),
    'std_msgs/msg/String': st.builds(NS, data=st.one_of(texts, st.text(max_size=100_000))),
}


@pytest.mark.parametrize('msg_type', sorted(MESSAGES))
def test_any_message_renders_a_clean_bounded_line_or_is_a_render_error(msg_type):
    codec = ObservationCodec(None, [InputSpec('/in', msg_type, kind='observation',
                                              options={'max_chars': 160})])

    @EXAMPLES
    @given(MESSAGES[msg_type])
    def check(msg):
        try:
            line = codec.text('/in', msg)
        except RenderError:
            return
        assert len(line) <= 400 and line.isprintable()
        words = line.lower().split()
        if msg_type != 'std_msgs/msg/String' and msg_type != 'sensor_msgs/msg/JointState':
            assert 'nan' not in words and 'inf' not in words and '-inf' not in words, line
            for word in words:
                try:
                    assert math.isfinite(float(word)) and abs(float(word)) <= 1e6, line
                except ValueError:
                    pass
    check()


@pytest.fixture(scope='module')
def grammar():
    tokenizer = load_checkpoint(default_model_path()).tokenizer
    return twist_grammar(tokenizer, [
        {'name': '_aim', 'key': 'a', 'min': -180, 'max': 180, 'step': 15},
        {'name': 'linear.x', 'key': 'v', 'min': -0.2, 'max': 0.8, 'step': 0.1},
        {'name': 'angular.z', 'key': 'w', 'min': -1.5, 'max': 1.5, 'step': 0.25}])


def within(grammar, action):
    for field in grammar.fields:
        value = action.values[field.name]
        assert math.isfinite(value) and field.minimum - 1e-9 <= value <= field.maximum + 1e-9


def test_any_logits_decode_to_a_complete_action_within_limits(grammar):
    vocab = grammar.tokenizer.get_vocab_size()

    @EXAMPLES
    @given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 1.0, 1e30, float('inf')]))
    def check(seed, spike):
        rng = np.random.default_rng(seed)
        logits = rng.standard_normal(vocab) * rng.choice([1e-3, 1.0, 1e6])
        logits[rng.integers(0, vocab, 3)] = spike
        state, steps = grammar.start(), 0
        while not grammar.done(state):
            allowed = grammar.allowed(state)
            assert len(allowed) > 0
            state = grammar.advance(state, int(allowed[np.argmax(logits[allowed])]))
            steps += 1
            assert steps <= 16
        within(grammar, grammar.action(state))
    check()


def test_any_text_parses_to_an_action_within_limits_or_a_grammar_error(grammar):
    word = st.one_of(st.text(max_size=12), st.builds(
        lambda k, x: f'{k}{x}', st.sampled_from('avwx'),
        st.one_of(numbers.map(str), st.text(max_size=6))))

    @EXAMPLES
    @given(st.lists(word, max_size=6).map(lambda ws: ' '.join(['act', *ws])))
    def check(text):
        try:
            action = grammar.parse(text)
        except GrammarError:
            return
        within(grammar, action)
    check()
