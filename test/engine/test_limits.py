"""Limits clamp: a tighter action_min/action_max changes an action only by clamping it.

The model decodes in its own grammar range (``action_grammar_min``/``_max``); the limits
clamp what is published. Over random models and random limits, every tick's decision and
published values must be those of the unlimited run, clamped.
"""

import shutil

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

from rt_llm_node.admission import CostModel
from rt_llm_node.configure import configure_engine
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.engine import ModelClock
from rt_llm_node.model.config import read_config
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.model.synthetic import random_weights
from rt_llm_node.model.synthetic import write_checkpoint

from conftest import demo_values  # noqa: I100

TICKS = 24
SEEDS = (11, 12, 13)


@pytest.fixture(scope='module')
def models(tmp_path_factory):
    """Random models of the demo policy's shape with its tokenizer, and their free runs."""
    from tokenizers import Tokenizer
    demo = default_model_path()
    config = read_config(demo)
    tokenizer = Tokenizer.from_file(str(demo / 'tokenizer.json'))
    made = {}
    for seed in SEEDS:
        directory = tmp_path_factory.mktemp(f'random{seed}')
        write_checkpoint(directory, config, random_weights(config, seed), tokenizer, 'F32')
        shutil.copy(demo / 'training.json', directory / 'training.json')
        made[seed] = (directory, run(directory))
    return made


def run(model, **limits):
    """[(decision, values)] of TICKS ticks on a fixed world trajectory (it does not react)."""
    values = demo_values(backend='numpy', model_path=str(model), **limits)
    clock = ModelClock()
    engine = configure_engine(values, clock=clock, log=lambda text: None,
                              cost_model=CostModel())
    world = DemoWorld(4, messages=MessageFactory(ros=False))
    out, snapshot = [], {}
    for i in range(TICKS):
        now = i / 30
        clock.advance_to(now)
        snapshot.update({topic: (msg, now) for topic, msg in world.observe().items()})
        result = engine.tick(dict(snapshot), now, now + 1 / 30)
        out.append(('refusal', result.refusal.reason) if result.action is None
                   else ('action', dict(result.action.values)))
        world.step(0.3, 0.2)   # the same path whatever the model chose
    return out


def bounds(draw, low, high, step):
    """Draw a limit pair inside [low, high] on the field's grid, the lower not above the upper."""
    n = int(round((high - low) / step))
    a, b = sorted(draw(st.integers(0, n)) for _ in range(2))
    return low + a * step, low + b * step


@st.composite
def limits(draw):
    aim = (-165.0, 180.0)
    v = bounds(draw, -0.2, 0.8, 0.1)
    w = bounds(draw, -1.5, 1.5, 0.25)
    return [aim[0], v[0], w[0]], [aim[1], v[1], w[1]]


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.sampled_from(SEEDS), limit=limits())
def test_a_tighter_limit_only_clamps(models, seed, limit):
    directory, free = models[seed]
    low, high = limit
    limited = run(directory, action_min=low, action_max=high)
    assert [d for d, _ in limited] == [d for d, _ in free], 'the same ticks act'
    fields = ('_aim', 'linear.x', 'angular.z')
    for (_, got), (_, want) in zip(limited, free):
        if not isinstance(want, dict):
            continue
        for name, lo, hi in zip(fields, low, high):
            assert got[name] == pytest.approx(float(np.clip(want[name], lo, hi)))
            if lo <= want[name] <= hi:
                assert got[name] == want[name], 'inside the limits: unchanged'
