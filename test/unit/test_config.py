"""The YAML files declare exactly the node's parameters, and the demo profile matches the demo."""

import dataclasses
import os

import pytest
import yaml

from rt_llm_node.demo import task
from rt_llm_node.params import BY_NAME
from rt_llm_node.params import validate

from conftest import ROOT  # noqa: I100


def load(name):
    with open(os.path.join(ROOT, 'config', name)) as f:
        return yaml.safe_load(f)['rt_llm_node']['ros__parameters']


def test_defaults_file_lists_every_parameter_with_its_default():
    values = load('rt_llm.yaml')
    assert set(values) == set(BY_NAME)
    for name, value in values.items():
        assert value == BY_NAME[name].default, name
    assert validate(values) == []


def test_demo_profile_matches_the_demo_task():
    """The demo profile's inputs are those the shipped policy reads.

    Every input line of the demo profile is the demo task's spec of the inputs the shipped policy
    reads (the world publishes more: /odom, which this policy does not see).
    """
    from rt_llm_node.model.embedded import default_model_path
    values = {p: BY_NAME[p].default for p in BY_NAME}
    values.update(load('demo.yaml'))
    assert validate(values) == []
    assert values['system_prompt'] == task.SYSTEM_PROMPT
    assert values['rate_hz'] == task.RATE_HZ
    inputs = task.model_inputs(default_model_path())
    assert values['input_topics'] == [s.topic for s in inputs]
    assert values['input_types'] == [s.msg_type for s in inputs]
    assert values['input_kinds'] == [s.kind for s in inputs]
    assert values['input_prefixes'] == [s.prefix for s in inputs]
    assert values['input_max_tokens'] == [s.max_tokens for s in inputs]
    assert values['input_max_age_s'] == [s.max_age_s for s in inputs]
    scan = next(s for s in inputs if s.topic == '/scan')
    assert values['scan_sectors'] == scan.options['sectors']
    # the shipped policy's grammar: with its plan field first where it states an aim
    fields = task.action_fields(task.model_aim(default_model_path()))
    assert values['action_fields'] == [f['name'] for f in fields]
    assert values['action_keys'] == [f['key'] for f in fields]
    assert values['action_min'] == [f['min'] for f in fields]
    assert values['action_max'] == [f['max'] for f in fields]
    assert values['action_step'] == [f['step'] for f in fields]
    # the grammar keeps the trained range, whatever limits a user sets after it
    assert values['action_grammar_min'] == [f['min'] for f in fields]
    assert values['action_grammar_max'] == [f['max'] for f in fields]


def test_demo_profile_feeds_the_shipped_model_what_it_was_trained_on():
    """A policy fed inputs it was not trained on loses most goals (docs/history.md).

    The shipped checkpoint's recorded inputs (training.json) are the demo profile's.
    """
    from rt_llm_node.model.embedded import default_model_path
    values = load('demo.yaml')
    assert values['input_topics'] == [s.topic for s in task.model_inputs(default_model_path())]


def test_smollm2_profile_is_valid_and_fits_a_tick_of_its_tokenizer(smollm2_gguf):
    """The real model's profile: valid, its grammar compact, a tick's inputs uncut.

    With SmolLM2's tokenizer (a token a digit) a scan and the detections take ~50 and ~66
    tokens: the caps must not cut them (the instructed object could be the one cut off).
    """
    from rt_llm_node.codec import ObservationCodec
    from rt_llm_node.configure import action_grammar
    from rt_llm_node.configure import input_specs
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.world import DemoWorld
    from rt_llm_node.model import load_model
    values = {p: BY_NAME[p].default for p in BY_NAME}
    values.update(load('demo_smollm2.yaml'))
    assert validate(values) == []
    tokenizer = load_model(str(smollm2_gguf)).tokenizer
    assert action_grammar(values, tokenizer).typical_choices() == 2
    specs = input_specs(values)
    uncapped = ObservationCodec(tokenizer, [dataclasses.replace(s, max_tokens=1000)
                                            for s in specs])
    world = DemoWorld(1_000_000, messages=MessageFactory(ros=False))
    for _ in range(200):
        for topic, msg in world.observe().items():
            spec = next((s for s in specs if s.topic == topic), None)
            if spec is not None:
                assert len(uncapped.encode(topic, msg)) <= spec.max_tokens, topic
        world.step(0.4, 0.5)


def test_inconsistent_lists_are_reported():
    values = {p: BY_NAME[p].default for p in BY_NAME}
    values['input_types'] = ['sensor_msgs/msg/LaserScan']
    assert any('input_types has 1 entries' in e for e in validate(values))
    values = {p: BY_NAME[p].default for p in BY_NAME}
    values['input_types'] = ['sensor_msgs/msg/PointCloud2', 'nav_msgs/msg/Odometry']
    assert any('unsupported input type' in e for e in validate(values))


def test_cuda_decode_step_is_checked_and_numpy_ignores_it(tiny_checkpoint):
    """Only the known decode steps are accepted.

    cuda_decode_step takes auto, kernels or persistent (a typo is a parameter error, not a silent
    default); make_backend refuses anything else and the numpy backend, which has one decode step,
    builds the same with any of them.
    """
    from rt_llm_node.backends import DECODE_STEPS
    from rt_llm_node.backends import make_backend
    from rt_llm_node.model import load_checkpoint
    values = {p: BY_NAME[p].default for p in BY_NAME}
    values['cuda_decode_step'] = 'persistant'
    assert any('cuda_decode_step' in e for e in validate(values)), validate(values)
    checkpoint = load_checkpoint(tiny_checkpoint)
    for step in DECODE_STEPS:
        assert make_backend('numpy', checkpoint, 32, step).name == 'numpy'
    with pytest.raises(ValueError, match='unknown decode step'):
        make_backend('numpy', checkpoint, 32, 'fast')


def test_speculation_on_cuda_refuses_the_persistent_decode_step():
    """A verify row repeats the per-kernel step: speculation with 'persistent' is an error.

    On the numpy backend, which ignores cuda_decode_step, the pair is fine.
    """
    values = {p: BY_NAME[p].default for p in BY_NAME}
    values.update(speculative_tokens=4, cuda_decode_step='persistent', backend='cuda')
    assert any('speculative_tokens' in e for e in validate(values)), validate(values)
    values['backend'] = 'auto'
    assert any('speculative_tokens' in e for e in validate(values)), validate(values)
    values['backend'] = 'numpy'
    assert not validate(values)
    values.update(backend='cuda', cuda_decode_step='auto')
    assert not validate(values)
