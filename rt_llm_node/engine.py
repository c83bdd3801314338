"""The tick engine: one control tick from input snapshot to action or refusal. No ROS here.

    snapshot -> render new inputs -> admission -> evict -> prefill -> constrained decode
             -> parse and clamp -> Action           (or a Refusal at any step)

The clock is injected: ``WallClock`` on a robot, ``ModelClock`` in deterministic
replay, where time advances by the cost model's predictions instead of by what
the host happened to take. The same engine runs in the node, the replay tool,
the demo evaluation and the tests.
"""

from collections import deque
from dataclasses import dataclass
import threading
import time
from typing import Optional

from rt_llm_node.backends import BackendError
from rt_llm_node.codec import ObservationCodec
from rt_llm_node.codec import RenderError
from rt_llm_node.kvcache import ACTION
from rt_llm_node.kvcache import CacheFullError
from rt_llm_node.kvcache import INSTRUCTION
from rt_llm_node.kvcache import make_policy
from rt_llm_node.kvcache import OBSERVATION
from rt_llm_node.kvcache import SYSTEM
from rt_llm_node.session import KVSession

REFUSAL_REASONS = ('deadline', 'stale_input', 'not_ready', 'overrun_abort', 'backend_error',
                   'input_error')


DECODE_WINDOW = 150   # ticks (5 s at 30 Hz) over which the longest action is remembered


class WallClock:
    """Monotonic host time; work takes what it takes."""

    def now(self):
        return time.monotonic()

    def charge(self, ms):
        """Model time is real time here: nothing to add."""


class ModelClock:
    """Virtual time that advances only by the cost model's predictions (deterministic)."""

    def __init__(self, start=0.0):
        self.t = float(start)

    def now(self):
        return self.t

    def charge(self, ms):
        self.t += ms / 1e3

    def advance_to(self, t):
        self.t = max(self.t, float(t))


@dataclass
class Refusal:
    """An explicit 'no action this tick', with why and by how much."""

    tick: int
    reason: str
    predicted_ms: float
    available_ms: float
    stamp: float         # tick start (engine clock, s)
    deadline: float      # engine clock, s
    detail: str = ''


@dataclass
class TickRecord:
    """What one tick did and how long each stage took (ms, engine clock)."""

    tick: int
    stamp: float
    deadline: float
    decision: str = 'refusal'      # 'action' or 'refusal'
    reason: str = ''
    predicted_ms: float = 0.0
    available_ms: float = 0.0
    n_prefill: int = 0
    n_decode: int = 0
    cache_length: int = 0
    capacity: int = 0
    evicted: int = 0
    render_ms: float = 0.0
    evict_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    late: bool = False             # admitted, then ran past the deadline
    probe: bool = False            # admitted as a probe of a pessimistic cost model


@dataclass
class TickResult:
    action: Optional[object]
    refusal: Optional[Refusal]
    record: TickRecord


class InputBuffer:
    """Latest message per topic with its receive time; written by callbacks, read by ticks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest = {}

    def put(self, topic, msg, received):
        with self._lock:
            self._latest[topic] = (msg, float(received))

    def snapshot(self):
        """A copy of {topic: (msg, received)} taken at one instant."""
        with self._lock:
            return dict(self._latest)

    def clear(self):
        with self._lock:
            self._latest.clear()


class TickEngine:
    """Runs ticks against one backend, tokenizer, set of inputs and action grammar."""

    def __init__(self, backend, tokenizer, inputs, grammar, admission, policy='meaning',
                 system_prompt='', decay=0.9, clock=None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.inputs = list(inputs)
        self.codec = ObservationCodec(tokenizer, self.inputs)
        self.grammar = grammar
        self.admission = admission
        self.session = KVSession(backend, make_policy(policy) if isinstance(policy, str)
                                 else policy, decay)
        self.system_ids = tokenizer.encode(system_prompt + '\n').ids if system_prompt else []
        self.clock = clock or WallClock()
        self.index = 0
        self.rendered = {}            # topic -> receive stamp of the last message in the cache
        # decode calls per action: the worst over the last DECODE_WINDOW ticks, admitted or
        # not, so that one rare long action cannot keep every later tick refused (typical
        # when none is recent); a longer action than predicted is caught by the watchdog
        self.typical_decodes = max(0, grammar.typical_decode_tokens() - 1)
        self.recent_decodes = deque()  # (tick index, decode calls) of admitted ticks
        self.ready = False

    def expected_decodes(self, index):
        """Decode calls to plan for at tick ``index``: the worst of the recent window."""
        while self.recent_decodes and self.recent_decodes[0][0] <= index - DECODE_WINDOW:
            self.recent_decodes.popleft()
        return max([n for _, n in self.recent_decodes], default=self.typical_decodes)

    def start(self):
        """Prefill the system prompt (pinned) and get ready for ticks."""
        if self.system_ids:
            if len(self.system_ids) >= self.backend.capacity // 2:
                raise ValueError(f'the system prompt ({len(self.system_ids)} tokens) needs less '
                                 f'than half the KV capacity ({self.backend.capacity})')
            self.session.append(self.system_ids, kind=SYSTEM)
        self.ready = True

    # -- inputs -------------------------------------------------------------------------
    def stale_inputs(self, snapshot, now):
        """Descriptions of required inputs that are missing or too old."""
        problems = []
        for spec in self.inputs:
            if not spec.required:
                continue
            entry = snapshot.get(spec.topic)
            if entry is None:
                if spec.kind != INSTRUCTION or spec.topic not in self.rendered:
                    problems.append(f'{spec.topic}: no message yet')
            elif spec.kind == OBSERVATION and now - entry[1] > spec.max_age_s:
                problems.append(f'{spec.topic}: {1e3 * (now - entry[1]):.0f} ms old '
                                f'(max {1e3 * spec.max_age_s:.0f})')
        return problems

    def render(self, snapshot):
        """[(ids, kind, topic, stamp)] for every input with a message newer than the cache's."""
        parts = []
        for spec in self.inputs:
            entry = snapshot.get(spec.topic)
            if entry is None or entry[1] <= self.rendered.get(spec.topic, float('-inf')):
                continue
            ids = self.codec.encode(spec.topic, entry[0])
            parts.append((ids, spec.kind, spec.topic, entry[1]))
        return parts

    # -- the tick -----------------------------------------------------------------------
    def tick(self, snapshot, stamp, deadline):
        """Run one tick started at ``stamp`` that must finish by ``deadline`` (engine clock)."""
        index = self.index
        self.index += 1
        self.admission.new_tick()
        record = TickRecord(index, stamp, deadline, capacity=self.backend.capacity)
        clock = self.clock
        t0 = clock.now()

        def refuse(reason, predicted=0.0, detail='', available=None):
            record.decision, record.reason = 'refusal', reason
            # the time admission compared with, or what was left at the tick's start
            record.available_ms = max(0.0, (deadline - t0) * 1e3 if available is None
                                      else available)
            record.predicted_ms = predicted
            record.cache_length = self.session.length
            record.total_ms = (clock.now() - t0) * 1e3
            return TickResult(None, Refusal(index, reason, predicted, record.available_ms, stamp,
                                            deadline, detail), record)

        if not self.ready:
            return refuse('not_ready', detail='the engine has not started')
        problems = self.stale_inputs(snapshot, stamp)
        if problems:
            return refuse('stale_input', detail='; '.join(problems))
        try:
            parts = self.render(snapshot)
        except RenderError as exc:
            return refuse('input_error', detail=str(exc))
        prefix = list(self.grammar.prefix_ids)
        parts.append((prefix, ACTION, '', stamp))
        n_prefill = self.session.pending_tokens + sum(len(p[0]) for p in parts)
        n_decode = self.expected_decodes(index)  # the last chosen token is deferred
        t1 = clock.now()
        record.render_ms = (t1 - t0) * 1e3
        try:
            slots = self.session.plan_room(n_prefill - self.session.pending_tokens + n_decode,
                                           [(p[1], p[2]) for p in parts])
        except CacheFullError as exc:
            return refuse('backend_error', detail=f'cache cannot make room: {exc}')
        kept = None if slots is None else len(slots)
        length = self.session.length
        predicted = self.admission.predict_ms(n_prefill, length, n_decode, kept)
        available = (deadline - clock.now()) * 1e3
        record.predicted_ms, record.available_ms = predicted, available
        record.n_prefill = n_prefill
        if not self.admission.admit(predicted, available):
            if not self.admission.probe_instead(n_prefill, length, n_decode, kept, available):
                return refuse('deadline', predicted, available=available)
            record.probe = True
        model = self.admission.model
        scale = self.admission.scale
        mark = None
        try:
            record.evicted = self.session.apply_plan(slots)
            if kept is not None:
                clock.charge(model.compact_ms(kept) * scale)
            t2 = clock.now()
            record.evict_ms = (t2 - t1) * 1e3
            mark = self.session.mark()
            segments = self.session.append_segments(list(parts))
            clock.charge(model.prefill_ms(n_prefill, self.session.length - n_prefill) * scale)
            t3 = clock.now()
            record.prefill_ms = (t3 - t2) * 1e3
            action_segment = segments[-1]
            state = self.grammar.start()
            chosen = []
            while True:
                allowed = self.grammar.allowed(state)
                token = int(allowed[0]) if len(allowed) == 1 else self.backend.argmax(allowed)
                state = self.grammar.advance(state, token)
                chosen.append(token)
                if self.grammar.done(state):
                    break
                # the fastest completion from here: decode this token, then choose
                # min_remaining more of which the last is deferred
                # (the admission margin stays a guard band to the end of the tick)
                remaining = self.grammar.min_remaining(state)
                step = self.admission.step_ms(self.session.length, self.admission.probe_scale(
                    n_prefill, length, record.n_decode, kept, (clock.now() - t1) * 1e3)
                    if record.probe else None)
                if clock.now() + (remaining * step + self.admission.margin_ms) / 1e3 > deadline:
                    self.session.rollback(mark)
                    t4 = clock.now()
                    record.decode_ms = (t4 - t3) * 1e3
                    # what ran so far is evidence too: a slow prefill raises the scale
                    self.admission.observe(n_prefill, length, record.n_decode, kept,
                                           (t4 - t1) * 1e3, record.probe, in_time=False)
                    return refuse('overrun_abort', predicted,
                                  f'{remaining} decode steps left would pass the deadline')
                self.session.decode(action_segment, token)
                clock.charge(model.decode_ms(self.session.length) * scale)
                record.n_decode += 1
            t4 = clock.now()
            record.decode_ms = (t4 - t3) * 1e3
        except (BackendError, CacheFullError, FloatingPointError) as exc:
            if mark is not None:
                try:
                    self.session.rollback(mark)
                except Exception:  # the backend is broken; the node will clean up
                    pass
            return refuse('backend_error', predicted, str(exc))
        # every admitted tick that ran teaches admission, above all one that ran late
        self.admission.observe(n_prefill, length, record.n_decode, kept, (t4 - t1) * 1e3,
                               record.probe, in_time=t4 <= deadline)
        if t4 > deadline:
            record.late = True
            self.session.rollback(mark)
            return refuse('overrun_abort', predicted, 'finished after the deadline')
        self.session.defer(action_segment, [chosen[-1], *self.grammar.end_ids])
        for ids, kind, topic, part_stamp in parts[:-1]:
            self.rendered[topic] = part_stamp
        self.recent_decodes.append((index, record.n_decode))
        self.session.decay_scores()
        record.decision = 'action'
        record.cache_length = self.session.length
        record.total_ms = (t4 - t0) * 1e3
        action = self.grammar.action(state, prefix + chosen + list(self.grammar.end_ids))
        return TickResult(action, None, record)
