"""The node's health over a recent window: diagnostic levels, input rates, rate-limited lines.

No ROS here: the node feeds it ticks and arrivals and turns its answers into
``/diagnostics`` statuses (levels as diagnostic_msgs defines them) and log lines.
"""

from collections import Counter
from collections import deque

OK, WARN, ERROR = 0, 1, 2
WAITING = ('not_ready', 'stale_input')   # reasons that are the world's, not the node's


class Health:
    """Ticks and input arrivals of the last ``window_s`` seconds, and what they say.

    The node's level: OK when every tick of the window acted; WARN when some were refused,
    or when it acted on none while only waiting (no instruction yet, inputs missing);
    ERROR when it acted on none while able to run (every tick refused for deadline, input
    or backend errors), or when an admitted action finished late.
    """

    def __init__(self, window_s=5.0, max_ticks=20000):
        self.window_s = float(window_s)
        self.ticks = deque(maxlen=max_ticks)      # (time, reason or '' for an action, late)
        # arrivals: a count and the last time per topic (two operations a message, on the
        # executor's thread, which a flood keeps busy), sampled for rates by ``sample``
        self.counts = Counter()
        self.last = {}
        self.samples = deque()                    # (time, {topic: count}) over the window

    def tick(self, now, reason, late=False):
        """Record a tick at ``now``: ``reason`` '' for an action, else the refusal's."""
        self.ticks.append((now, reason, bool(late)))

    def arrival(self, topic, now):
        """Record a message of ``topic`` arriving at ``now``."""
        self.counts[topic] += 1
        self.last[topic] = now

    def sample(self, now):
        """Keep the arrival counts at ``now`` (call about once a second) for ``rate_hz``."""
        self.samples.append((now, dict(self.counts)))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()

    def _recent(self, now):
        while self.ticks and self.ticks[0][0] < now - self.window_s:
            self.ticks.popleft()
        return list(self.ticks)

    def level(self, now):
        """(level, message) of the node over the window ending at ``now``."""
        ticks = self._recent(now)
        if not ticks:
            return WARN, 'no ticks in the last window'
        refused = [reason for _, reason, _ in ticks if reason]
        late = sum(late for *_, late in ticks)
        if late:
            return ERROR, f'{late} admitted actions finished late'
        if not refused:
            return OK, 'acting'
        if len(refused) < len(ticks):
            return WARN, f'refused {len(refused)} of {len(ticks)} ticks'
        if all(reason in WAITING for reason in refused):
            return WARN, 'waiting for inputs: every tick refused (' + ', '.join(
                sorted(set(refused))) + ')'
        return ERROR, 'every tick refused (' + ', '.join(sorted(set(refused))) + ')'

    def rate_hz(self, topic):
        """Messages a second of ``topic`` between the oldest and newest sample."""
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1.get(topic, 0) - c0.get(topic, 0)) / max(t1 - t0, 1e-9)

    def last_arrival(self, topic):
        return self.last.get(topic)


class LineLimiter:
    """At most one log line a key per ``interval_s``; the lines held back are counted."""

    def __init__(self, interval_s=1.0):
        self.interval_s = float(interval_s)
        self.last = {}
        self.held = {}

    def allow(self, key, now):
        """Return None to stay quiet, else how many lines of ``key`` were held back before."""
        last = self.last.get(key)
        if last is not None and now - last < self.interval_s:
            self.held[key] = self.held.get(key, 0) + 1
            return None
        self.last[key] = now
        return self.held.pop(key, 0)
