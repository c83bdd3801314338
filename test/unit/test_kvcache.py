"""Eviction policies and cache bookkeeping, without a model."""

import numpy as np
import pytest

from rt_llm_node.kvcache import ACTION
from rt_llm_node.kvcache import CacheFullError
from rt_llm_node.kvcache import Incoming
from rt_llm_node.kvcache import INSTRUCTION
from rt_llm_node.kvcache import KVCache
from rt_llm_node.kvcache import make_policy
from rt_llm_node.kvcache import OBSERVATION
from rt_llm_node.kvcache import SYSTEM


def add(cache, n, kind, topic='', mass=0.0):
    segment = cache.open_segment(kind, topic)
    cache.extend(segment, np.arange(n))
    cache.mass[cache.length - n:cache.length] = mass
    cache.accumulated[cache.length - n:cache.length] = mass
    return segment


def evict(cache, n_needed, incoming=None):
    slots = cache.plan(n_needed, incoming)
    if slots is not None:
        cache.apply(slots)
    return slots


def live(cache):
    return [s.uid for s in cache.segments.values()]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match='unknown eviction policy'):
        make_policy('lru')


def test_no_plan_when_it_fits():
    cache = KVCache(32, make_policy('meaning'), slack=0)
    add(cache, 10, SYSTEM)
    assert cache.plan(22) is None


def test_recency_drops_oldest_unpinned_segments():
    cache = KVCache(40, make_policy('recency'), slack=0)
    system = add(cache, 8, SYSTEM)
    a = add(cache, 10, OBSERVATION, '/scan', mass=5.0)
    b = add(cache, 10, OBSERVATION, '/odom')
    c = add(cache, 10, ACTION)
    evict(cache, 5)
    assert live(cache) == [system.uid, b.uid, c.uid]
    assert a.uid not in cache.segments and cache.length == 28


def test_sink_window_keeps_sinks_and_newest_tokens():
    cache = KVCache(32, make_policy('sink_window', sink_tokens=4), slack=0)
    add(cache, 32, OBSERVATION, '/scan')
    cache.token_ids[:32] = np.arange(32)
    evict(cache, 8)
    assert cache.length == 24
    assert cache.token_ids[:24].tolist() == [0, 1, 2, 3] + list(range(12, 32))


def test_h2o_keeps_recent_window_and_heavy_hitters():
    cache = KVCache(20, make_policy('h2o', recent_tokens=5), slack=0)
    add(cache, 20, OBSERVATION, '/scan')
    cache.token_ids[:20] = np.arange(20)
    cache.accumulated[:20] = 0.0
    cache.accumulated[[2, 7, 9]] = [5.0, 3.0, 4.0]
    evict(cache, 12)  # budget 8: 5 recent + 3 heaviest
    assert cache.token_ids[:8].tolist() == [2, 7, 9, 15, 16, 17, 18, 19]


def test_meaning_evicts_superseded_observation_first_whatever_its_attention():
    cache = KVCache(50, make_policy('meaning'), slack=0)
    system = add(cache, 8, SYSTEM)
    instruction = add(cache, 6, INSTRUCTION)
    old_scan = add(cache, 10, OBSERVATION, '/scan', mass=100.0)
    odom = add(cache, 10, OBSERVATION, '/odom', mass=0.0)
    new_scan = add(cache, 10, OBSERVATION, '/scan', mass=1.0)
    evict(cache, 10)
    assert live(cache) == [system.uid, instruction.uid, odom.uid, new_scan.uid]
    assert old_scan.uid not in cache.segments


def test_meaning_counts_the_incoming_observation_as_superseding():
    cache = KVCache(30, make_policy('meaning'), slack=0)
    scan = add(cache, 10, OBSERVATION, '/scan', mass=50.0)
    odom = add(cache, 10, OBSERVATION, '/odom', mass=0.0)
    act = add(cache, 10, ACTION, mass=0.0)
    evict(cache, 10, Incoming(OBSERVATION, '/scan'))
    assert live(cache) == [odom.uid, act.uid] and scan.uid not in cache.segments


def test_meaning_then_lowest_mass_per_token_then_age():
    cache = KVCache(60, make_policy('meaning'), slack=0)
    a = add(cache, 10, ACTION, mass=1.0)        # 1.0 per token
    add(cache, 20, ACTION, mass=0.5)            # 0.5 per token: lowest
    c = add(cache, 10, ACTION, mass=1.0)        # ties with a, younger
    d = add(cache, 10, ACTION, mass=2.0)
    evict(cache, 25)  # free 10 -> drop b (20) -> 30 free
    assert live(cache) == [a.uid, c.uid, d.uid]
    evict(cache, 40)  # free 30 -> drop a (older of the tie)
    assert live(cache) == [c.uid, d.uid]


def test_meaning_never_evicts_pins_but_does_evict_a_superseded_instruction():
    cache = KVCache(40, make_policy('meaning'), slack=0)
    system = add(cache, 10, SYSTEM)
    first = add(cache, 10, INSTRUCTION)
    assert first.pinned
    second = add(cache, 10, INSTRUCTION)
    assert not first.pinned and second.pinned
    evict(cache, 15)
    assert live(cache) == [system.uid, second.uid]
    with pytest.raises(CacheFullError):
        cache.plan(25)


def test_decay_ages_the_mass_but_not_the_accumulated_score():
    cache = KVCache(10, make_policy('meaning'), decay=0.5)
    add(cache, 4, ACTION)
    cache.add_attention(np.ones(4))
    cache.decay()
    assert cache.mass[:4].tolist() == [0.5] * 4 and cache.accumulated[:4].tolist() == [1.0] * 4


def test_rollback_forgets_new_segments_and_restores_scores():
    cache = KVCache(40, make_policy('meaning'), slack=0)
    first = add(cache, 10, INSTRUCTION)
    mark = cache.mark()
    add(cache, 5, INSTRUCTION)
    cache.add_attention(np.ones(15))
    assert not first.pinned
    cache.rollback(mark)
    assert cache.length == 10 and live(cache) == [first.uid] and first.pinned
    assert cache.mass[:10].tolist() == [0.0] * 10


@pytest.mark.parametrize('policy', ['recency', 'sink_window', 'h2o', 'meaning'])
def test_random_workload_never_exceeds_capacity(policy, rng):
    cache = KVCache(64, make_policy(policy), slack=0)
    add(cache, 6, SYSTEM)
    add(cache, 5, INSTRUCTION)
    kinds = [(OBSERVATION, '/scan'), (OBSERVATION, '/odom'), (ACTION, ''), (INSTRUCTION, '')]
    for _ in range(2000):
        kind, topic = kinds[rng.integers(len(kinds))]
        n = int(rng.integers(1, 12))
        evict(cache, n, Incoming(kind, topic))
        add(cache, n, kind, topic)
        cache.add_attention(rng.random(cache.length))
        cache.decay()
        assert cache.length <= cache.capacity
        owners = set(cache.owner[:cache.length].tolist())
        assert owners == set(cache.segments), 'every live segment owns a slot and vice versa'
    if policy == 'meaning':
        assert cache.segments[min(cache.segments)].kind == SYSTEM


def test_slack_evicts_ahead_so_compaction_is_occasional():
    cache = KVCache(64, make_policy('recency'), slack=16)
    for _ in range(6):
        add(cache, 10, ACTION)
    slots = cache.plan(10)
    assert slots is not None and 64 - len(slots) >= 26, 'needed 10 more, freed 10 + slack'
    cache.apply(slots)
    add(cache, 10, ACTION)
    assert cache.plan(10) is None, 'the next segment fits without another compaction'
