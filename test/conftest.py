"""Shared fixtures: checkpoints made on the fly (transformers on CPU torch, or numpy)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope='session')
def tiny_checkpoint(tmp_path_factory):
    """A random tiny Llama checkpoint written by our numpy writer (no torch needed)."""
    from rt_llm_node.model.synthetic import write_random_checkpoint
    return write_random_checkpoint(tmp_path_factory.mktemp('tiny'), 'tiny', seed=1)
