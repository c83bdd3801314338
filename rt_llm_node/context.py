"""The model's running context: a backend's KV cache and its bookkeeping, kept in step.

Every token that enters the backend enters through here, so the slots the
backend holds and the segments ``KVCache`` knows about never disagree.
"""

import numpy as np

from rt_llm_node.kvcache import Incoming
from rt_llm_node.kvcache import KVCache
from rt_llm_node.kvcache import OTHER


class Context:
    """Append segments, decode into them, evict by policy, roll back aborted work."""

    def __init__(self, backend, policy, decay=0.9):
        self.backend = backend
        self.cache = KVCache(backend.capacity, policy, decay)

    @property
    def length(self):
        return self.cache.length

    def make_room(self, n_needed, kind=OTHER, topic='', protect=()):
        """Evict (and compact) so that ``n_needed`` more tokens fit; returns tokens evicted."""
        slots = self.cache.plan(n_needed, Incoming(kind, topic), protect)
        if slots is None:
            return 0
        evicted = self.cache.length - len(slots)
        self.backend.compact(slots)
        self.cache.apply(slots)
        return evicted

    def append(self, token_ids, kind=OTHER, topic='', stamp=0.0, pinned=None, reserve=0):
        """Prefill ``token_ids`` as a new segment, first making room for them plus ``reserve``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        self.make_room(len(ids) + reserve, kind, topic)
        segment = self.cache.open_segment(kind, topic, stamp, pinned)
        self._run(segment, ids)
        return segment

    def open_segment(self, kind=OTHER, topic='', stamp=0.0, pinned=None):
        """Start an empty segment to decode into (room is made token by token)."""
        return self.cache.open_segment(kind, topic, stamp, pinned)

    def decode(self, segment, token_id):
        """Feed one token into ``segment`` (evicting other segments if the cache is full)."""
        self.make_room(1, segment.kind, segment.topic, protect=(segment.uid,))
        self._run(segment, np.asarray([token_id], dtype=np.int64))

    def _run(self, segment, ids):
        if len(ids) == 1:
            self.backend.decode(int(ids[0]))
        else:
            self.backend.prefill(ids)
        self.cache.extend(segment, ids)
        self.cache.add_attention(self.backend.attention_mass())

    def mark(self):
        """Save the state that ``rollback`` returns to."""
        return self.cache.mark()

    def rollback(self, mark):
        """Forget everything appended since ``mark`` (on the backend too)."""
        self.backend.rollback(mark.length)
        self.cache.rollback(mark)

    def tick(self):
        """Age the attention scores by one control tick."""
        self.cache.decay()


def greedy_generate(context, prompt_ids, max_new_tokens, segment_tokens=16, allowed=None,
                    on_step=None):
    """Greedy decoding through ``context``; returns the generated ids.

    The prompt and the output are cut into segments of ``segment_tokens`` so that
    segment-level eviction can work when they outgrow the cache. ``allowed``:
    sorted permitted ids for every step (constrained decoding), or None.
    ``on_step(step, backend)`` runs before each token is chosen (e.g. to dump logits).
    """
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    if len(prompt_ids) == 0:
        raise ValueError('the prompt is empty')
    for start in range(0, len(prompt_ids), segment_tokens):
        context.append(prompt_ids[start:start + segment_tokens])
    out = []
    segment = None
    for step in range(max_new_tokens):
        if on_step is not None:
            on_step(step, context.backend)
        token = context.backend.argmax(allowed)
        out.append(token)
        if step == max_new_tokens - 1:
            break
        if segment is None or step % segment_tokens == 0:
            segment = context.open_segment()
        context.decode(segment, token)
    return out
