"""Bookkeeping of a fixed-capacity KV cache: segments, attention scores, eviction plans.

The device buffers belong to the backend; this module only decides. The cache
is a sequence of slots ``0 .. length-1`` (slot == RoPE position), each owned by
one segment: the system prompt, an instruction, an observation of one topic at
one stamp, an action, or other text. An eviction plan is the ascending list of
slots to keep; the backend compacts them to ``0 .. m-1`` and re-rotates their
keys, so positions never grow past the capacity however long the node runs.

Policies share one interface, ``keep(cache, n_needed, incoming) -> bool [length]``:

- ``recency``: drop the oldest unpinned segments;
- ``sink_window``: keep the first ``sink_tokens`` slots and the newest ones
  (StreamingLLM), token level;
- ``h2o``: keep a recent window plus the tokens with the most accumulated
  attention (Heavy-Hitter Oracle), token level;
- ``meaning``: segment level; pinned segments stay; observations superseded by
  a newer one of the same topic, and superseded instructions, are stale and go
  first (oldest first); then the lowest decayed attention mass per token; ties
  by age.
"""

from dataclasses import dataclass

import numpy as np

SYSTEM = 'system'
INSTRUCTION = 'instruction'
OBSERVATION = 'observation'
ACTION = 'action'
OTHER = 'other'
KINDS = (SYSTEM, INSTRUCTION, OBSERVATION, ACTION, OTHER)
PINNED_KINDS = (SYSTEM, INSTRUCTION)


class CacheFullError(RuntimeError):
    """No eviction can make the requested room (pinned and protected tokens fill the cache)."""


@dataclass
class Segment:
    """A run of cache slots with one meaning; ``uid`` grows with age (smaller is older)."""

    uid: int
    kind: str
    topic: str = ''
    stamp: float = 0.0
    pinned: bool = False


@dataclass(frozen=True)
class Incoming:
    """What is about to be appended: lets ``meaning`` see what it will supersede."""

    kind: str = OTHER
    topic: str = ''


@dataclass(frozen=True)
class Mark:
    """A saved cache state to roll back to (taken after eviction, before a tick's tokens)."""

    length: int
    next_id: int
    mass: np.ndarray
    accumulated: np.ndarray
    pinned: tuple


class KVCache:
    """Slot ownership and attention scores of a cache of ``capacity`` tokens."""

    def __init__(self, capacity, policy, decay=0.9, slack=None):
        if capacity < 1:
            raise ValueError('capacity must be positive')
        if not 0.0 < decay <= 1.0:
            raise ValueError('decay must be in (0, 1]')
        self.capacity = int(capacity)
        self.policy = policy
        self.decay_factor = float(decay)
        # evict this much more than needed, so compaction is occasional, not every tick
        self.slack = capacity // 8 if slack is None else int(slack)
        self.owner = np.full(self.capacity, -1, np.int64)     # [capacity] segment id per slot
        self.token_ids = np.zeros(self.capacity, np.int64)    # [capacity] token in each slot
        self.mass = np.zeros(self.capacity, np.float64)       # [capacity] decayed attention
        self.accumulated = np.zeros(self.capacity, np.float64)  # [capacity] undecayed (h2o)
        self.length = 0
        self.segments = {}                                    # id -> Segment, oldest first
        self.next_id = 0
        self.evicted_tokens = 0

    # -- growing ----------------------------------------------------------------------
    def open_segment(self, kind, topic='', stamp=0.0, pinned=None):
        """Start a new (empty) segment; returns it. ``pinned`` defaults by kind."""
        if kind not in KINDS:
            raise ValueError(f'unknown segment kind {kind!r}')
        if pinned is None:
            pinned = kind in PINNED_KINDS
        if kind == INSTRUCTION:  # a newer instruction supersedes the older ones
            for seg in self.segments.values():
                if seg.kind == INSTRUCTION:
                    seg.pinned = False
        segment = Segment(self.next_id, kind, topic, float(stamp), bool(pinned))
        self.segments[segment.uid] = segment
        self.next_id += 1
        return segment

    def extend(self, segment, token_ids):
        """Give the next ``len(token_ids)`` slots to ``segment``."""
        n = len(token_ids)
        if self.length + n > self.capacity:
            raise CacheFullError(f'{n} tokens do not fit: {self.length} of {self.capacity} used')
        self.token_ids[self.length:self.length + n] = token_ids
        self.owner[self.length:self.length + n] = segment.uid
        self.mass[self.length:self.length + n] = 0.0
        self.accumulated[self.length:self.length + n] = 0.0
        self.length += n

    def add_attention(self, mass):
        """Add mass: [length] received by each cached token in the last backend call."""
        mass = np.asarray(mass, dtype=np.float64)
        if mass.shape != (self.length,):
            raise ValueError(f'attention mass has shape {mass.shape}, expected ({self.length},)')
        self.mass[:self.length] += mass
        self.accumulated[:self.length] += mass

    def decay(self):
        """Age the decayed scores by one tick."""
        self.mass[:self.length] *= self.decay_factor

    # -- reading ----------------------------------------------------------------------
    def tokens_of(self):
        """Return {segment id: token count} for segments that hold slots."""
        ids, counts = np.unique(self.owner[:self.length], return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))

    def stale_ids(self, incoming=()):
        """Ids of observations and instructions superseded by a newer one (or by ``incoming``)."""
        newest = {}
        for seg in self.segments.values():
            if seg.kind in (OBSERVATION, INSTRUCTION):
                newest[(seg.kind, seg.topic if seg.kind == OBSERVATION else '')] = seg.uid
        for item in incoming:
            if item.kind in (OBSERVATION, INSTRUCTION):
                newest[(item.kind, item.topic if item.kind == OBSERVATION else '')] = self.next_id
        return {seg.uid for seg in self.segments.values()
                if seg.kind in (OBSERVATION, INSTRUCTION)
                and newest[(seg.kind, seg.topic if seg.kind == OBSERVATION else '')] != seg.uid}

    # -- evicting ---------------------------------------------------------------------
    def plan(self, n_needed, incoming=None, protect=()):
        """Return the ascending slots to keep so ``n_needed`` more fit, or None if they fit now.

        ``incoming``: the Incoming segments about to be appended;
        ``protect``: segment ids that must not be evicted (e.g. the one being decoded).
        Raises CacheFullError when no plan can make the room.
        """
        if n_needed > self.capacity:
            raise CacheFullError(f'{n_needed} tokens exceed the cache capacity {self.capacity}')
        if self.length + n_needed <= self.capacity:
            return None
        if isinstance(incoming, Incoming):
            incoming = (incoming,)
        target = min(self.capacity, n_needed + self.slack)
        keep = np.asarray(self.policy.keep(self, target, tuple(incoming or ()),
                                           frozenset(protect)), dtype=bool)
        if keep.shape != (self.length,):
            raise RuntimeError(f'policy {self.policy.name} returned a mask of shape {keep.shape}')
        slots = np.flatnonzero(keep)
        if len(slots) + n_needed > self.capacity:
            raise CacheFullError(f'policy {self.policy.name} cannot free {n_needed} slots: '
                                 f'{len(slots)} of {self.capacity} must stay')
        return slots

    def apply(self, slots):
        """Compact the bookkeeping to the kept ``slots`` (the backend does the same)."""
        m = len(slots)
        before = set(self.owner[:self.length].tolist())
        self.evicted_tokens += self.length - m
        self.owner[:m] = self.owner[slots]
        self.token_ids[:m] = self.token_ids[slots]
        self.mass[:m] = self.mass[slots]
        self.accumulated[:m] = self.accumulated[slots]
        self.length = m
        for seg_id in before - set(self.owner[:m].tolist()):  # emptied, not merely empty
            del self.segments[seg_id]

    # -- rolling back -----------------------------------------------------------------
    def mark(self):
        """Save the state to return to if the coming tokens are aborted."""
        return Mark(self.length, self.next_id, self.mass[:self.length].copy(),
                    self.accumulated[:self.length].copy(),
                    tuple((s.uid, s.pinned) for s in self.segments.values()))

    def truncate(self, length):
        """Forget slots from ``length`` on, and every segment left without a slot."""
        if not 0 <= length <= self.length:
            raise ValueError(f'cannot truncate a cache of {self.length} to {length}')
        self.evicted_tokens += self.length - length
        self.length = int(length)
        kept = set(self.owner[:self.length].tolist())
        for seg_id in [s for s in self.segments if s not in kept]:
            del self.segments[seg_id]

    def rollback(self, mark):
        """Return to ``mark``: later slots and segments are forgotten, scores restored."""
        if mark.length > self.length:
            raise ValueError('cannot roll back to a longer cache (compacted since the mark?)')
        self.length = mark.length
        self.mass[:mark.length] = mark.mass
        self.accumulated[:mark.length] = mark.accumulated
        pinned = dict(mark.pinned)
        for seg_id in [s for s in self.segments if s >= mark.next_id]:
            del self.segments[seg_id]
        for seg in self.segments.values():
            seg.pinned = pinned.get(seg.uid, seg.pinned)
        self.next_id = mark.next_id


# -- policies ---------------------------------------------------------------------------
def _drop_segments_in_order(cache, order, n_needed):
    """Keep-mask that drops whole segments in ``order`` until ``n_needed`` fit."""
    keep = np.ones(cache.length, dtype=bool)
    owner = cache.owner[:cache.length]
    counts = cache.tokens_of()
    free = cache.capacity - cache.length
    for seg_id in order:
        if free >= n_needed:
            break
        keep[owner == seg_id] = False
        free += counts.get(seg_id, 0)
    return keep


def _evictable(cache, protect):
    counts = cache.tokens_of()
    return [s for s in cache.segments.values()
            if not s.pinned and s.uid not in protect and counts.get(s.uid, 0)]


class RecencyPolicy:
    """Drop the oldest unpinned segments."""

    name = 'recency'

    def keep(self, cache, n_needed, incoming, protect):
        order = [s.uid for s in _evictable(cache, protect)]  # segments are kept oldest first
        return _drop_segments_in_order(cache, order, n_needed)


class SinkWindowPolicy:
    """StreamingLLM: the first ``sink_tokens`` slots and the most recent tokens stay."""

    name = 'sink_window'

    def __init__(self, sink_tokens=4):
        self.sink_tokens = int(sink_tokens)

    def keep(self, cache, n_needed, incoming, protect):
        n = cache.length
        budget = cache.capacity - n_needed
        keep = np.zeros(n, dtype=bool)
        sinks = min(self.sink_tokens, budget, n)
        keep[:sinks] = True
        recent = budget - sinks
        if recent > 0:
            keep[max(sinks, n - recent):] = True
        return keep


class H2OPolicy:
    """Heavy-Hitter Oracle: a recent window plus the most-attended other tokens."""

    name = 'h2o'

    def __init__(self, recent_tokens=32):
        self.recent_tokens = int(recent_tokens)

    def keep(self, cache, n_needed, incoming, protect):
        n = cache.length
        budget = cache.capacity - n_needed
        keep = np.zeros(n, dtype=bool)
        recent = min(self.recent_tokens, budget, n)
        if recent:
            keep[n - recent:] = True
        heavy = budget - recent
        if heavy > 0:
            scores = cache.accumulated[:n - recent]
            # stable: among equal scores the older token goes first
            order = np.argsort(-scores, kind='stable')[:heavy]
            keep[order] = True
        return keep


class MeaningPolicy:
    """Stale before useful, then least attended per token, then oldest; pins stay."""

    name = 'meaning'

    def keep(self, cache, n_needed, incoming, protect):
        stale = cache.stale_ids(incoming)
        counts = cache.tokens_of()
        owner = cache.owner[:cache.length]
        mass = np.bincount(owner, weights=cache.mass[:cache.length],
                           minlength=cache.next_id)
        candidates = [s for s in cache.segments.values()
                      if s.uid not in protect and counts.get(s.uid, 0)
                      and s.kind != SYSTEM and (not s.pinned or s.uid in stale)]

        def rank(seg):
            if seg.uid in stale:
                return (0, 0.0, seg.uid)
            return (1, mass[seg.uid] / counts[seg.uid], seg.uid)

        order = [s.uid for s in sorted(candidates, key=rank)]
        return _drop_segments_in_order(cache, order, n_needed)


POLICIES = {
    'recency': RecencyPolicy,
    'sink_window': SinkWindowPolicy,
    'h2o': H2OPolicy,
    'meaning': MeaningPolicy,
}


def make_policy(name, **options):
    """Build eviction policy ``name`` (one of ``POLICIES``)."""
    try:
        return POLICIES[name](**options)
    except KeyError:
        raise ValueError(f'unknown eviction policy {name!r} '
                         f'(choose from {", ".join(POLICIES)})') from None
