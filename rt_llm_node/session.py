"""The KV session: a backend's KV cache (the tensors) and ``KVCache`` (its segments), in step.

Every token that enters the backend enters through here, so the slots the backend holds and
the segments the bookkeeping knows about (system prompt, instruction, observation of a topic,
action) never disagree: appending, decoding into a segment, evicting by the policy's plan
(compacting the backend's slots), rolling back aborted work.
"""

import numpy as np

from rt_llm_node.kvcache import Incoming
from rt_llm_node.kvcache import KVCache
from rt_llm_node.kvcache import OTHER


class KVSession:
    """Append segments, decode into them, evict by policy, roll back aborted work.

    ``pending`` holds tokens already chosen but not yet run (the end of the last
    action): they enter the backend at the front of the next prefill, which saves
    a decode step per tick.
    """

    def __init__(self, backend, policy, decay=0.9):
        self.backend = backend
        self.cache = KVCache(backend.capacity, policy, decay)
        self.pending = None            # (segment, [token ids]) or None
        self._first_row = 0            # the backend's row of the last verify's first token

    @property
    def length(self):
        return self.cache.length

    @property
    def pending_tokens(self):
        return len(self.pending[1]) if self.pending else 0

    def plan_room(self, n_needed, incoming=(), protect=()):
        """Kept slots so ``n_needed`` more tokens (pending ones included) fit, or None.

        ``incoming``: [(kind, topic)] of the segments about to be appended.
        """
        protect = tuple(protect) + ((self.pending[0].uid,) if self.pending else ())
        return self.cache.plan(n_needed + self.pending_tokens,
                               [Incoming(k, t) for k, t in incoming], protect)

    def apply_plan(self, slots):
        """Evict: compact the backend and the bookkeeping to ``slots``; returns tokens evicted."""
        if slots is None:
            return 0
        evicted = self.cache.length - len(slots)
        self.backend.compact(slots)
        self.cache.apply(slots)
        return evicted

    def make_room(self, n_needed, kind=OTHER, topic='', protect=()):
        """Evict (and compact) so that ``n_needed`` more tokens fit; returns tokens evicted."""
        return self.apply_plan(self.plan_room(n_needed, [(kind, topic)], protect))

    def _open(self, parts):
        """Return the chunks to prefill (pending tokens, then ``parts``) and their segments."""
        chunks, owners = [], []
        if self.pending:
            chunks.append(np.asarray(self.pending[1], dtype=np.int64))
            owners.append(self.pending[0])
            self.pending = None
        for ids, kind, topic, stamp in parts:
            chunks.append(np.asarray(ids, dtype=np.int64))
            owners.append(self.cache.open_segment(kind, topic, stamp))
        return chunks, owners

    def append_segments(self, parts):
        """Prefill pending tokens and ``parts`` [(ids, kind, topic, stamp)] in one backend call.

        Room must have been made. Returns the new segments.
        """
        chunks, owners = self._open(parts)
        ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        if len(ids) == 0:
            return owners[len(owners) - len(parts):]
        self.backend.prefill(ids)   # (a backend runs one token as a decode step)
        for segment, chunk in zip(owners, chunks):
            self.cache.extend(segment, chunk)
        self.cache.add_attention(self.backend.attention_mass())
        return owners[len(owners) - len(parts):]

    def append_and_verify(self, parts, drafts, allowed):
        """``append_segments(parts)`` with ``drafts`` verified after them in the same call.

        The backend's ``prefill_verify``: returns (the new segments, the greedy token after the
        prefill and after each draft verified). The prefill enters the books as
        ``append_segments`` would leave it; the drafts stay in the backend until
        ``keep_verified`` says how many to keep. Room must have been made for all of them, and
        there must be tokens to prefill.
        """
        chunks, owners = self._open(parts)
        ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        predicted = self.backend.prefill_verify(ids, np.asarray(drafts, dtype=np.int64),
                                                allowed)
        for segment, chunk in zip(owners, chunks):
            self.cache.extend(segment, chunk)
        self.cache.add_attention(self.backend.row_mass(0))   # the prefill's
        self._first_row = 1
        return owners[len(owners) - len(parts):], predicted

    def append(self, token_ids, kind=OTHER, topic='', stamp=0.0, reserve=0):
        """Prefill ``token_ids`` as a new segment, first making room for them plus ``reserve``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        self.make_room(len(ids) + reserve, kind, topic)
        return self.append_segments([(ids, kind, topic, stamp)])[0]

    def restore(self, token_ids, kind, mass, topic='', stamp=0.0):
        """Take slots the backend imported at the cache's end (``import_kv``) into the books.

        As ``append`` would have left them after prefilling them: one segment, the prefill's
        attention ``mass`` (over the whole cache) added.
        """
        if self.pending or self.backend.length != self.cache.length + len(token_ids):
            raise ValueError('restored slots must follow the cache, nothing pending')
        segment = self.cache.open_segment(kind, topic, stamp)
        self.cache.extend(segment, np.asarray(token_ids, dtype=np.int64))
        self.cache.add_attention(mass)
        return segment

    def open_segment(self, kind=OTHER, topic='', stamp=0.0, pinned=None):
        """Start an empty segment to decode into (room is made token by token)."""
        return self.cache.open_segment(kind, topic, stamp, pinned)

    def decode(self, segment, token_id):
        """Feed one token into ``segment`` (evicting other segments if the cache is full)."""
        self.make_room(1, segment.kind, segment.topic, protect=(segment.uid,))
        self.backend.decode(int(token_id))
        self.cache.extend(segment, np.asarray([token_id], dtype=np.int64))
        self.cache.add_attention(self.backend.attention_mass())

    def verify(self, token_ids, allowed):
        """Run ``token_ids`` in one verify pass; returns the greedy token after each.

        The backend holds them until ``keep_verified`` says how many to keep; the caller
        makes sure they fit without eviction.
        """
        self._first_row = 0
        return self.backend.verify(np.asarray(token_ids, dtype=np.int64), allowed)

    def keep_verified(self, segment, token_ids, n):
        """Keep the first ``n`` tokens of the last verify in ``segment``, forget the rest.

        The bookkeeping (slots, attention scores) is what ``n`` decode calls would leave:
        each kept row's attention mass is added in turn (after ``append_and_verify`` the
        drafts' rows follow the prefill's).
        """
        start = self.cache.length
        self.backend.rollback(start + n)
        for r in range(n):
            self.cache.extend(segment, np.asarray(token_ids[r:r + 1], dtype=np.int64))
            self.cache.add_attention(self.backend.row_mass(self._first_row + r))

    def defer(self, segment, token_ids):
        """Keep ``token_ids`` of ``segment`` pending until the next append."""
        self.pending = (segment, list(token_ids))

    def mark(self):
        """Save the state that ``rollback`` returns to."""
        return (self.cache.mark(), self.pending)

    def rollback(self, mark):
        """Forget everything appended since ``mark`` (on the backend too)."""
        cache_mark, pending = mark
        self.backend.rollback(cache_mark.length)
        self.cache.rollback(cache_mark)
        self.pending = pending

    def truncate(self, length):
        """Forget every slot from ``length`` on, pending tokens too; returns tokens dropped."""
        dropped = self.cache.length - length
        self.backend.rollback(length)
        self.cache.truncate(length)
        self.pending = None
        return dropped

    def decay_scores(self):
        """Age the attention scores by one control tick."""
        self.cache.decay()


def greedy_generate(context, prompt_ids, max_new_tokens, segment_tokens=16, allowed=None,
                    on_step=None, stop_ids=()):
    """Greedy decoding through ``context``; returns the generated ids.

    The prompt and the output are cut into segments of ``segment_tokens`` so that
    segment-level eviction can work when they outgrow the cache. ``allowed``:
    sorted permitted ids for every step (constrained decoding), or None.
    ``on_step(step, backend)`` runs before each token is chosen (e.g. to dump logits).
    Generation ends after a token of ``stop_ids`` (the model's end-of-sequence ids).
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
        if step == max_new_tokens - 1 or token in stop_ids:
            break
        if segment is None or step % segment_tokens == 0:
            segment = context.open_segment()
        context.decode(segment, token)
    return out
