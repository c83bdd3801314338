"""A short soak through the real backend under every policy (the long one is tools/soak.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools'))

import soak  # noqa: E402

from rt_llm_node.model import load_checkpoint  # noqa: E402,I100


@pytest.mark.parametrize('policy', ['recency', 'sink_window', 'h2o', 'meaning'])
def test_positions_stay_below_capacity(policy, tiny_checkpoint):
    result = soak.soak(load_checkpoint(tiny_checkpoint), policy, capacity=128,
                       total_tokens=12_000)
    assert result['tokens'] >= 12_000
    assert result['max_position'] < 128
    assert result['evicted'] > 10_000
