"""Host-memory KV state of recent instructions, so that switching back to one is a copy.

An instruction is placed right after the system prompt (``TickEngine`` with an instruction
cache): its keys and values then depend on the system prompt and its own tokens only, so
the slots its prefill wrote, kept here with the attention mass that prefill reported, are
exactly what prefilling it again would write. Bounded in entries and bytes; the least
recently used entry goes first.
"""

from collections import OrderedDict


class InstructionCache:
    """Instruction token ids -> (KV tensors of its slots, attention mass), LRU-bounded."""

    def __init__(self, max_entries=8, max_bytes=64 << 20):
        if int(max_entries) < 1 or int(max_bytes) < 1:
            raise ValueError('an instruction cache needs room for one entry and one byte')
        self.max_entries = int(max_entries)
        self.max_bytes = int(max_bytes)
        self.entries = OrderedDict()   # ids -> (tensors, mass, bytes), least recent first
        self.nbytes = 0
        self.hits = self.misses = 0

    def __len__(self):
        return len(self.entries)

    def get(self, ids):
        """Return (tensors, mass) kept for instruction ``ids`` (now the most recent), or None."""
        key = tuple(int(t) for t in ids)
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return entry[0], entry[1]

    def peek(self, ids):
        """Return (tensors, mass) kept for ``ids`` without counting a use, or None."""
        entry = self.entries.get(tuple(int(t) for t in ids))
        return None if entry is None else (entry[0], entry[1])

    def put(self, ids, tensors, mass):
        """Keep an instruction's state; the least recently used go while over a bound.

        An entry larger than the whole byte bound is not kept. Returns whether it was.
        """
        key = tuple(int(t) for t in ids)
        size = sum(a.nbytes for a in tensors.values()) + mass.nbytes
        self._discard(key)
        if size > self.max_bytes:
            return False
        self.entries[key] = (tensors, mass, size)
        self.nbytes += size
        while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
            self.nbytes -= self.entries.popitem(last=False)[1][2]
        return True

    def _discard(self, key):
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[2]
