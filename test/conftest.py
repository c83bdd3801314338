"""Shared fixtures: checkpoints made on the fly (transformers on CPU torch, or numpy)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope='session')
def tiny_checkpoint(tmp_path_factory):
    """Return a random tiny Llama checkpoint written by our numpy writer (no torch needed)."""
    from rt_llm_node.model.synthetic import write_random_checkpoint
    return write_random_checkpoint(tmp_path_factory.mktemp('tiny'), 'tiny', seed=1)


def pytest_configure(config):
    """Keep DDS discovery on this host and away from other test runs."""
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    # data over UDP loopback: Fast DDS shared-memory segments left by a killed process can
    # match a reader and writer that then never exchange a sample
    os.environ.setdefault('FASTDDS_BUILTIN_TRANSPORTS', 'UDPv4')
    # 1..101 are the domain ids whose ports never collide with Linux ephemeral ports
    os.environ.setdefault('ROS_DOMAIN_ID', str(10 + os.getpid() % 90))
