"""A short soak through the real backend and session under every policy.

12,000 tokens of tick-shaped work through a 128-slot cache (the long run is benchmarks/soak.py).
"""

import numpy as np
import pytest

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.kvcache import ACTION
from rt_llm_node.kvcache import INSTRUCTION
from rt_llm_node.kvcache import make_policy
from rt_llm_node.kvcache import OBSERVATION
from rt_llm_node.kvcache import SYSTEM
from rt_llm_node.model import load_checkpoint
from rt_llm_node.session import KVSession

TOPICS = (('/scan', 20), ('/odom', 12), ('/detections', 16))


@pytest.mark.parametrize('policy', ['recency', 'sink_window', 'h2o', 'meaning'])
def test_a_long_stream_keeps_the_pinned_segments_and_evicts_the_rest(policy, tiny_checkpoint):
    checkpoint = load_checkpoint(tiny_checkpoint)
    rng = np.random.default_rng(0)
    vocab = checkpoint.config.vocab_size
    backend = NumpyBackend(checkpoint, 128)
    session = KVSession(backend, make_policy(policy))
    system = rng.integers(0, vocab, 16)
    session.append(system, kind=SYSTEM)
    tokens, tick, instruction = 16, 0, None
    while tokens < 12_000:
        if tick % 300 == 0:
            instruction = rng.integers(0, vocab, 8)
            session.append(instruction, kind=INSTRUCTION)
            tokens += 8
        topic, n = TOPICS[tick % len(TOPICS)]
        session.append(rng.integers(0, vocab, n), kind=OBSERVATION, topic=topic,
                       stamp=tick / 30.0, reserve=6)
        action = session.open_segment(ACTION)
        for _ in range(6):
            session.decode(action, backend.argmax())
        tokens += n + 6
        session.decay_scores()
        tick += 1
    cache = session.cache
    assert cache.evicted_tokens > 10_000          # the cache turned over ~90 times
    held = cache.token_ids[:cache.length]
    owners = cache.owner[:cache.length]

    def tokens(kind):   # the tokens the newest segment of ``kind`` still holds
        newest = max((s for s in cache.segments.values() if s.kind == kind),
                     key=lambda s: s.uid)
        return list(held[owners == newest.uid])
    if policy in ('recency', 'meaning'):
        # segment-level policies pin by kind, not by age: the system prompt and the current
        # instruction stay whole (the token-level baselines keep slots, not meanings)
        assert tokens(SYSTEM) == list(system)
        assert tokens(INSTRUCTION) == list(instruction)
    # what the bookkeeping says is in the cache is what the backend holds
    assert backend.length == session.length == cache.length <= 128
