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

import numpy as np

from rt_llm_node.backends import BackendError
from rt_llm_node.backends import verify_limit
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
# a fused pass whose first draft was wrong (the action no longer begins as the last one did)
# ran its rows for nothing: the next this many ticks draft after the prefill instead
FUSE_BACKOFF = 8
# a new instruction within this many ticks of the last placement is prefilled with the inputs
FLOOD_TICKS = 1


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
    instruction_ms: float = 0.0    # placing a new instruction (restore, or prefill), in evict_ms
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    late: bool = False             # admitted, then ran past the deadline
    probe: bool = False            # admitted as a probe of a pessimistic cost model
    n_fed: int = 0                 # action tokens run after the prefill (kept ones)
    drafted: int = 0               # speculative decoding: tokens drafted, kept, verify passes
    accepted: int = 0
    verify_passes: int = 0         # (a fused pass included)
    fused: bool = False            # the action's drafts verified beside its prefill
    instruction: str = ''          # a new instruction placed: 'prefilled', 'restored' or ''


@dataclass
class TickResult:
    action: Optional[object]
    refusal: Optional[Refusal]
    record: TickRecord


def header_stamp_lag(msg, now_s):
    """Seconds from ``msg``'s header stamp to ``now_s`` (same clock), or None without a stamp.

    A message without a header, or with a zero stamp (never set), is judged by arrival alone.
    """
    stamp = getattr(getattr(msg, 'header', None), 'stamp', None)
    if stamp is None:
        return None
    try:
        seconds = int(stamp.sec) + int(stamp.nanosec) * 1e-9
    except (AttributeError, TypeError, ValueError):
        return None
    return None if seconds == 0 else now_s - seconds


class InputBuffer:
    """Latest message per topic with its receive time; written by callbacks, read by ticks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest = {}

    def put(self, topic, msg, received, stamp_lag=None):
        """Keep ``msg`` as the newest of ``topic``.

        ``received``: its arrival (engine clock); ``stamp_lag``: seconds after its header
        stamp (``header_stamp_lag``; None: no stamp).
        """
        with self._lock:
            self._latest[topic] = (msg, float(received), stamp_lag)

    def snapshot(self):
        """Return a copy of {topic: (msg, received, stamp lag)} taken at one instant."""
        with self._lock:
            return dict(self._latest)

    def clear(self):
        with self._lock:
            self._latest.clear()


class TickEngine:
    """Run ticks against one backend, tokenizer, set of inputs and action grammar."""

    def __init__(self, backend, tokenizer, inputs, grammar, admission, policy='meaning',
                 system_prompt='', decay=0.9, clock=None, stamp_tolerance_s=0.5,
                 speculative_tokens=0, instruction_cache=None, guard=None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.inputs = list(inputs)
        self.stamp_tolerance_s = float(stamp_tolerance_s)
        self.codec = ObservationCodec(tokenizer, self.inputs)
        self.grammar = grammar
        # what is published: the decoded action clamped, joint targets bounded by the
        # measured state (guard.OutputGuard); None: the decoded action as it is
        self.guard = guard
        self.admission = admission
        self.clock = clock or WallClock()
        # under the model clock the backend's work is what advances time
        timed = (ModelTimedBackend(backend, self.clock, admission)
                 if isinstance(self.clock, ModelClock) else backend)
        self.session = KVSession(timed, make_policy(policy) if isinstance(policy, str)
                                 else policy, decay)
        self.system_ids = tokenizer.encode(system_prompt + '\n').ids if system_prompt else []
        self.index = 0
        self.rendered = {}            # topic -> receive stamp of the last message in the cache
        # decode calls per action: the worst over the last DECODE_WINDOW ticks, admitted or
        # not, so that one rare long action cannot keep every later tick refused (typical
        # when none is recent); a longer action than predicted is caught by the watchdog
        self.typical_decodes = max(0, grammar.typical_decode_tokens() - 1)
        # (tick, tokens fed, forward passes, whether it speculated) of admitted ticks
        self.recent_decodes = deque()
        # speculative decoding: at most this many drafted tokens verified in one pass, where
        # the backend verifies row-exactly (the output stays exactly greedy); 0: off
        self.speculative_tokens = min(int(speculative_tokens),
                                      max(0, verify_limit(backend) - 1))
        # tokens the grammar forces after a chosen one ride in the pass that runs it (a verify
        # pass of them all, where the backend verifies row-exactly): decoding costs a pass a
        # chosen token, not a pass a token. ``forced_run``: the most such tokens in a row
        self.forced_run = min(grammar.max_forced_run(), max(0, verify_limit(backend) - 1))
        self.typical_passes = max(0, (grammar.typical_choices() if self.forced_run
                                      else grammar.typical_decode_tokens()) - 1)
        self.last_action_ids = []      # the last action's chosen tokens (a draft source)
        self.fuse_from = 0             # the first tick that may verify drafts beside its prefill
        self._system_state = None      # (KV tensors, attention mass) of the prompt's prefill
        self.state = None              # (StateStore, fields) where the prompt's state is kept
        # an instruction_cache.InstructionCache: a new instruction goes right after the system
        # prompt (what followed is dropped) and its state is kept for the next switch back to
        # it; None: instructions are appended like observations and evicted by meaning
        self.instructions = (instruction_cache if hasattr(backend, 'import_kv')
                             else None)
        self.instruction_ids = None    # the instruction in the cache (its token ids)
        self.placed_at = -FLOOD_TICKS - 1   # the tick that last placed an instruction
        self._log = None
        self.ready = False

    def expected_decodes(self, index):
        """Decode calls to plan for at tick ``index``: the worst of the recent window."""
        while self.recent_decodes and self.recent_decodes[0][0] <= index - DECODE_WINDOW:
            self.recent_decodes.popleft()
        return max([n for _, n, _, _ in self.recent_decodes], default=self.typical_decodes)

    def expected_passes(self, index):
        """Forward passes after the prefill to plan for with speculative decoding, or None.

        The admission quantile of the passes recent actions took (how many drafts were
        kept is what varies), over the same window as ``expected_decodes``; None without
        speculation or before any admitted action.
        """
        if not self.speculative_tokens:
            return None
        self.expected_decodes(index)   # drops what left the window
        passes = [p for _, _, p, speculated in self.recent_decodes if speculated]
        if not passes:
            return None
        return int(np.quantile(passes, self.admission.quantile, method='higher'))

    def plain_passes(self, n_decode):
        """Forward passes after the prefill to plan for without speculation: (passes, tokens).

        The worst of the window (``expected_decodes`` drops what left it), a pass a chosen
        token with its forced tokens beside it, never more than the ``n_decode`` tokens
        planned; ``tokens``: what the dearest pass runs (0: decode steps).
        """
        passes = max([p for _, _, p, speculated in self.recent_decodes if not speculated],
                     default=self.typical_passes)
        return min(passes, n_decode), (1 + self.forced_run if self.forced_run else 0)

    def start(self, state_store=None, state_fields=None, log=None):
        """Prefill the system prompt (pinned), or restore it, and get ready for ticks.

        With a ``state_store`` (state_store.StateStore) and a backend that exports its cache,
        the system prompt's KV state stored under ``state_fields`` (model, formats, backend)
        is restored instead of prefilled when it matches exactly, and a fresh prefill is
        stored. Returns True when the prompt was restored.
        """
        restored = False
        self._log = log
        if state_store is not None and hasattr(self.backend, 'import_kv'):
            self.state = (state_store, state_fields)
        if self.system_ids:
            if len(self.system_ids) >= self.backend.capacity // 2:
                raise ValueError(f'the system prompt ({len(self.system_ids)} tokens) needs less '
                                 f'than half the KV capacity ({self.backend.capacity})')
            stores = state_store is not None and hasattr(self.backend, 'import_kv')
            if state_store is not None and not stores and log:
                log(f'the {self.backend.name} backend cannot store its KV state: prefilling')
            found = state_store.load_prefix(state_fields, self.system_ids) if stores else None
            if found is not None:
                try:
                    self.backend.import_kv(found[0])
                    self.session.restore(self.system_ids, SYSTEM, found[1])
                    restored = True
                except BackendError as exc:
                    if log:
                        log(f'stored KV state not used: {exc}; prefilling')
                    self.backend.rollback(0)
            if not restored:
                self.session.append(self.system_ids, kind=SYSTEM)
                if stores:
                    self._system_state = (self.backend.export_kv(0, len(self.system_ids)),
                                          self.backend.attention_mass())
                    self.save_state(state_store, state_fields)
        self.ready = True
        return restored

    def save_state(self, state_store, state_fields):
        """Store the system prompt's KV state as its prefill left it (if this engine made one).

        With an instruction cache, the current instruction's state too (restored on the
        first switch to it after a restart).
        """
        if self._system_state is not None:
            state_store.save_prefix(state_fields, self.system_ids, *self._system_state)
        entry = (self.instructions.peek(self.instruction_ids)
                 if self.instructions is not None and self.instruction_ids else None)
        if entry is not None:
            state_store.save_prefix(state_fields, self.system_ids + self.instruction_ids,
                                    *entry, start=len(self.system_ids))

    # -- inputs -------------------------------------------------------------------------
    def input_problems(self, snapshot, now):
        """{topic: why it is missing or too old} for the required inputs that are."""
        problems = {}
        for spec in self.inputs:
            if not spec.required:
                continue
            entry = snapshot.get(spec.topic)
            if entry is None:
                if spec.kind != INSTRUCTION or spec.topic not in self.rendered:
                    problems[spec.topic] = 'no message yet'
            elif spec.kind == OBSERVATION:
                lag = entry[2] if len(entry) > 2 else None
                problem = self._stale(spec, now - entry[1], lag)
                if problem:
                    problems[spec.topic] = problem
        return problems

    def stale_inputs(self, snapshot, now):
        """Descriptions of required inputs that are missing or too old."""
        return [f'{topic}: {problem}'
                for topic, problem in self.input_problems(snapshot, now).items()]

    def _stale(self, spec, age, lag):
        """Say why an observation is too old to act on ('' if it is not), and by which clock.

        ``age``: seconds since its arrival; ``lag``: seconds from its header stamp to its
        arrival (None: no stamp).
        """
        tolerance = self.stamp_tolerance_s
        if lag is not None and lag < -tolerance:
            return (f'header stamp {-lag:.3g} s in the future (clock offset beyond the '
                    f'tolerance of {tolerance:g} s)')
        if lag is not None and age + lag > spec.max_age_s + tolerance:
            return (f'{1e3 * (age + lag):.0f} ms old by its header stamp (max '
                    f'{1e3 * spec.max_age_s:.0f} + {1e3 * tolerance:.0f} tolerance)')
        if age > spec.max_age_s:
            return f'{1e3 * age:.0f} ms old by arrival (max {1e3 * spec.max_age_s:.0f})'
        return

    def render(self, snapshot, everything=False):
        """[(ids, kind, topic, stamp)] for every input with a message newer than the cache's.

        ``everything``: every input with a message, new or not.
        """
        parts = []
        for spec in self.inputs:
            entry = snapshot.get(spec.topic)
            if entry is None or (not everything and entry[1] <= self.rendered.get(
                    spec.topic, float('-inf'))):
                continue
            ids = self.codec.encode(spec.topic, entry[0])
            parts.append((ids, spec.kind, spec.topic, entry[1]))
        return parts

    # -- the tick -----------------------------------------------------------------------
    def tick(self, snapshot, stamp, deadline):
        """Run one tick started at ``stamp`` that must finish by ``deadline`` (engine clock).

        The recipe: check the inputs, render what is new, admit (or refuse) against the time
        left, make room and prefill, decode the action under the watchdog, commit. Every step
        that fails returns a refusal; work already done to the cache is rolled back.
        """
        run = _Run(self, stamp, deadline)
        problem = self._check_inputs(snapshot, stamp)
        if problem:
            return run.refuse(*problem)
        try:
            parts = self._render(run, snapshot, stamp)
        except RenderError as exc:
            return run.refuse('input_error', detail=str(exc))
        plan = self._admit(run, parts)
        if isinstance(plan, TickResult):
            return plan
        mark = None
        try:
            mark, segment = self._prefill(run, plan, parts)
            decoded = self._decode_action(run, plan, segment, mark)
            if isinstance(decoded, TickResult):
                return decoded
        except (BackendError, CacheFullError, FloatingPointError) as exc:
            if mark is not None:
                try:
                    self.session.rollback(mark)
                except Exception:  # the backend is broken; the node will clean up
                    pass
            return run.refuse('backend_error', plan.predicted, str(exc))
        result = self._commit(run, plan, parts, segment, mark, *decoded)
        if result.action is not None and self.guard is not None:
            result.action = self.guard.limit(result.action, snapshot)
        return result

    def _check_inputs(self, snapshot, stamp):
        """(reason, detail) when the tick cannot start: not started, or inputs stale."""
        if not self.ready:
            return 'not_ready', 0.0, 'the engine has not started'
        problems = self.stale_inputs(snapshot, stamp)
        if problems:
            return 'stale_input', 0.0, '; '.join(problems)
        unbounded = self.guard.check(snapshot) if self.guard is not None else ''
        if unbounded:   # a joint target could not be bounded by its measured position
            return 'input_error', 0.0, unbounded
        return None

    def _render(self, run, snapshot, stamp):
        """Return the tick's new segments, ending with the action prefix the decode continues.

        With an instruction cache, a new instruction (not the one in place sent again) starts
        the cache over after the system prompt: it comes first (``run.instruction``: its part
        and its stored state, or None), then every input's latest message.
        """
        parts = self.render(snapshot)
        if self.instructions is not None:   # the instruction in place, sent again: nothing new
            again = [p for p in parts if p[1] == INSTRUCTION
                     and [int(t) for t in p[0]] == self.instruction_ids]
            for part in again:
                self.rendered[part[2]] = part[3]
                parts.remove(part)
        if self.instructions is not None and any(p[1] == INSTRUCTION for p in parts):
            parts = sorted(self.render(snapshot, everything=True),
                           key=lambda p: p[1] != INSTRUCTION)
            run.instruction = (parts[0], self._stored_instruction(parts[0][0]))
        parts.append((list(self.grammar.prefix_ids), ACTION, '', stamp))
        return parts

    def _stored_instruction(self, ids):
        """(KV tensors, mass) of instruction ``ids`` from the cache or the state store, or None."""
        ids = [int(t) for t in ids]
        found = self.instructions.get(ids)
        if found is None and self.state is not None:
            store, fields = self.state
            found = store.load_prefix(fields, self.system_ids + ids, start=len(self.system_ids))
            if found is not None:
                self.instructions.put(ids, *found)
                if self._log:
                    self._log(f'instruction: {len(ids)} tokens of KV state restored from the '
                              'state store')
        return found

    def _admit(self, run, parts):
        """Plan the eviction, predict the tick's cost and admit it (a ``_Plan``), or refuse."""
        session, admission = self.session, self.admission
        n_new = sum(len(p[0]) for p in parts)
        plan = _Plan(n_prefill=session.pending_tokens + n_new,
                     n_decode=self.expected_decodes(run.record.tick), length=session.length)
        run.mark_rendered()
        if run.instruction is not None:   # the cache starts over after the system prompt
            plan = self._admit_new_instruction(run, plan, n_new)
            if isinstance(plan, TickResult):
                return plan
        else:
            try:   # the last chosen token is deferred: n_decode steps, n_decode + 1 tokens
                plan.slots = session.plan_room(n_new + plan.n_decode,
                                               [(p[1], p[2]) for p in parts])
            except CacheFullError as exc:   # the inputs, not the backend: one tick too large
                return run.refuse('input_error', detail=f'the cache cannot make room: {exc}')
        plan.kept = None if plan.slots is None else len(plan.slots)
        passes = self.expected_passes(run.record.tick)
        if passes is None:
            plan.passes, plan.pass_tokens = self.plain_passes(plan.n_decode)
        else:
            plan.passes, plan.pass_tokens = min(passes, plan.n_decode), 1 + self.speculative_tokens
        plan.fused_tokens = 1 + self.speculative_tokens if self._fuses(run.index) else 0
        plan.predicted = admission.predict_ms(plan.n_prefill, plan.length, plan.passes,
                                              plan.kept, plan.restored, plan.pass_tokens,
                                              plan.fused_tokens)
        available = run.ms_left()
        if (plan.pass_tokens or plan.fused_tokens) and not admission.admit(plan.predicted,
                                                                           available):
            # speculation never refuses a tick that plain decoding would act on in time:
            # where its passes do not fit but the decode steps they stand for do, this tick
            # drafts nothing
            plain_passes, plain_tokens = self.plain_passes(plan.n_decode)
            plain = admission.predict_ms(plan.n_prefill, plan.length, plain_passes, plan.kept,
                                         plan.restored, plain_tokens)
            if admission.admit(plain, available):
                plan.passes, plan.pass_tokens, plan.fused_tokens = plain_passes, plain_tokens, 0
                plan.predicted = plain
                run.speculate = False
        run.record.predicted_ms, run.record.available_ms = plan.predicted, available
        run.record.n_prefill = plan.n_prefill
        if not admission.admit(plan.predicted, available):
            if not admission.probe_instead(plan.n_prefill, plan.length, plan.passes,
                                           plan.kept, available, plan.restored,
                                           plan.pass_tokens, plan.fused_tokens):
                return run.refuse('deadline', plan.predicted, available=available)
            run.record.probe = True
        return plan

    def _admit_new_instruction(self, run, plan, n_new):
        """Plan a tick that places a new instruction after the system prompt (or refuse).

        Everything after the system prompt goes; the instruction is restored by copy when its
        state is kept (priced as moving its slots), else prefilled in a call of its own.
        """
        part, found = run.instruction
        n_system, n_instruction = len(self.system_ids), len(part[0])
        if n_system + n_new + plan.n_decode + 1 > self.backend.capacity:
            return run.refuse('input_error', detail=(
                f'the cache cannot make room: the system prompt, the new instruction and the '
                f'inputs need {n_system + n_new + plan.n_decode + 1} of '
                f'{self.backend.capacity} slots'))
        plan.restored = n_instruction if found is not None else 0
        plan.n_prefill = n_new - plan.restored
        plan.length = n_system + plan.restored
        return plan

    def _place_instruction(self, run):
        """Start the cache over after the system prompt with the tick's new instruction.

        Restored by copy when its state is kept, else prefilled alone (so that its slots
        depend on the system prompt and itself only) and kept. Returns tokens dropped.
        """
        (ids, kind, topic, stamp), found = run.instruction
        n_system = len(self.system_ids)
        dropped = self.session.truncate(n_system)
        self.rendered = {}
        ids = [int(t) for t in ids]
        if found is not None:
            self.session.backend.import_kv(found[0], n_system)
            self.session.restore(ids, kind, found[1], topic, stamp)
            run.record.instruction = 'restored'
        else:
            self.session.append_segments([(ids, kind, topic, stamp)])
            end = n_system + len(ids)
            self.instructions.put(ids, self.backend.export_kv(n_system, end),
                                  self.backend.attention_mass())
            run.record.instruction = 'prefilled'
        self.rendered[topic] = stamp
        self.instruction_ids = ids
        return dropped

    def _prefill(self, run, plan, parts):
        """Evict as planned, then prefill the deferred tokens and the new segments.

        A new instruction under an instruction cache is placed first (not rolled back if the
        tick fails later: the cache then holds the system prompt and that instruction).
        Returns (the mark to roll back to, the action segment).
        """
        if run.instruction is not None and self._flooded(run):
            # instructions arriving tick after tick: the cache starts over after the system
            # prompt and the instruction is prefilled with the inputs in one call, as admission
            # priced it; kept by the cache only once it is placed in a tick of its own
            run.record.evicted = self.session.truncate(len(self.system_ids))
            self.rendered, self.instruction_ids = {}, None
            run.placed = [int(t) for t in parts[0][0]]
            run.record.instruction = 'prefilled'
        elif run.instruction is not None:
            started = run.now()
            run.record.evicted = self._place_instruction(run)
            run.record.instruction_ms = (run.now() - started) * 1e3
            self.placed_at = run.index
            parts = parts[1:]
        else:
            run.record.evicted = self.session.apply_plan(plan.slots)
        run.lap('evict_ms')
        mark = self.session.mark()
        n_prefill = self.session.pending_tokens + sum(len(p[0]) for p in parts)
        fused = self._fused_drafts(run, plan, n_prefill)
        if fused is None:
            segments = self.session.append_segments(list(parts))
        else:   # the action's drafts verified beside the prefill
            drafts, states, allowed, rows = fused
            segments, predicted = self.session.append_and_verify(list(parts), drafts[:rows],
                                                                 allowed)
            run.fused = (drafts, states, predicted)
            run.record.fused = True
        run.lap('prefill_ms')
        return mark, segments[-1]

    def _flooded(self, run):
        """Tell whether a new instruction comes right after the last one was placed.

        Not one to restore by copy; placed in the tick before this one (a flood: each would
        cost a prefill of its own and one of the inputs, the second unpriced).
        """
        return run.instruction[1] is None and self.placed_at >= run.index - FLOOD_TICKS

    def _fuses(self, index):
        """Tell whether tick ``index`` verifies the action's drafts beside its prefill.

        Where the backend fuses the two passes, with speculation on, unless a recent fused
        pass's first draft was wrong (``FUSE_BACKOFF``).
        """
        return (bool(self.speculative_tokens) and index >= self.fuse_from
                and hasattr(self.session.backend, 'prefill_verify'))

    def _fused_drafts(self, run, plan, n_prefill):
        """Draft the whole action for a fused pass: (drafts, states, allowed, rows), or None.

        The drafts (``_drafts`` from the grammar's start: the last action first), the grammar
        state before each and after the last, the allowed ids after the prefill and after
        each draft run, and how many drafts run as rows: a last draft that ends the action
        needs no row (only its check), and the watchdog keeps only as many rows as leave time
        to finish should none be kept. None: nothing to draft, or no room or time for a row.
        """
        if not plan.fused_tokens or not n_prefill:
            return None
        grammar, length = self.grammar, self.session.length
        state = grammar.start()
        limit = min(self.speculative_tokens + 1, self.backend.capacity - length - n_prefill - 1)
        drafts = self._drafts(state, [], limit)
        states = [state]
        for t in drafts:
            states.append(grammar.advance(states[-1], t))
        rows = len(drafts) - (1 if drafts and grammar.done(states[-1]) else 0)
        remaining = grammar.min_remaining(state)
        while rows and not self._can_fuse(run, plan, n_prefill, rows, remaining):
            rows -= 1
        if not rows:
            return None
        drafts = drafts[:rows + 1]
        allowed = [None if grammar.done(s) else grammar.allowed(s) for s in states[:rows + 1]]
        return drafts, states[:len(drafts) + 1], allowed, rows

    def _can_fuse(self, run, plan, n_prefill, rows, remaining):
        """Tell whether a fused pass can run and ``remaining`` tokens still follow in time.

        The watchdog, as ``_can_finish``: the prefill with ``rows`` drafts beside it, none
        of them kept at worst, then a decode step for each of the ``remaining`` tokens to
        choose but the last.
        """
        admission = self.admission
        scale = (admission.probe_scale(plan.n_prefill, plan.length, 0, plan.kept,
                                       run.ms_since_admit(), plan.restored, plan.pass_tokens,
                                       plan.fused_tokens)
                 if run.record.probe else None)
        length = self.session.length
        need = (admission.fused_ms(n_prefill, rows, length, scale)
                + (remaining - 1) * admission.step_ms(length + n_prefill, scale))
        return run.now() + (need + admission.margin_ms) / 1e3 <= run.deadline

    def _decode_action(self, run, plan, segment, mark):
        """Greedy decode under the grammar, several tokens a pass where drafts are right.

        Each chosen token is run (a decode step), except the last, which is deferred. With
        speculative decoding a token and the tokens drafted to follow it run in one verify
        pass; the drafts are kept up to the first one greedy decoding would not have chosen,
        the rest rolled back, so the tokens, the cache and its scores are exactly those of
        plain greedy decoding (the backend's verify is row-exact). Returns (grammar state,
        chosen tokens), or an ``overrun_abort`` refusal, rolled back, when the watchdog sees
        the deadline pass.
        """
        grammar, record = self.grammar, run.record
        if run.fused is not None:
            token, state, chosen = self._keep_fused(run, segment)
        else:
            state, chosen = grammar.start(), []
            token = self._choose(state)
        while True:
            state = grammar.advance(state, token)
            chosen.append(token)
            if grammar.done(state):
                return state, chosen
            if run.speculate:
                drafts = self._drafts(state, chosen)
                remaining = grammar.min_remaining(state)
            else:   # the pass that runs ``token`` runs the tokens forced after it too
                drafts = self._forced(state)
                remaining = (grammar.min_choices(state) + 1 if self.forced_run
                             else grammar.min_remaining(state))
            # a verify pass runs the drafts too, whether they are kept or not: only as many
            # as leave time to finish if none is kept
            while drafts and not self._can_finish(run, plan, remaining, len(drafts)):
                drafts.pop()
            if not self._can_finish(run, plan, remaining):
                self.session.rollback(mark)
                run.lap('decode_ms')
                # what ran so far is evidence too: a slow prefill raises the scale
                self.admission.observe(plan.n_prefill, plan.length, record.n_decode,
                                       plan.kept, run.ms_since_admit(), record.probe,
                                       in_time=False, restored=plan.restored,
                                       pass_tokens=plan.pass_tokens,
                                       fused_tokens=plan.fused_tokens)
                return run.refuse('overrun_abort', plan.predicted,
                                  f'{remaining} decode steps left would pass the deadline')
            record.n_decode += 1
            if not drafts:
                self.session.decode(segment, token)
                record.n_fed += 1
                token = self._choose(state)
                continue
            token, state = self._verify(record, segment, state, chosen, token, drafts,
                                        counted=run.speculate)
            if token is None:   # the drafts finished the action
                return state, chosen

    def _keep_fused(self, run, segment):
        """Keep what the fused pass's drafts got right; returns (token, state, chosen).

        Drafts are kept up to the first one greedy decoding would not have chosen (the
        prefill's greedy token checks the first, each draft's row the next). ``token``: the
        greedy token after the kept drafts, chosen but not yet run (the loop of
        ``_decode_action`` goes on from it); the kept drafts' rows stay, the rest is rolled
        back.
        """
        drafts, states, predicted = run.fused
        record, rows = run.record, len(predicted) - 1
        checked = min(len(drafts), rows + 1)
        kept = 0
        while kept < checked and int(predicted[kept]) == drafts[kept]:
            kept += 1
        base = min(kept, rows)   # a right draft without a row is the token to run next
        record.drafted += checked
        record.accepted += kept
        record.verify_passes += 1
        if not kept:   # the action began otherwise than the last: draft after the prefill
            self.fuse_from = run.index + 1 + FUSE_BACKOFF
        self.session.keep_verified(segment, drafts, base)
        record.n_fed += base
        return int(predicted[base]), states[base], drafts[:base]

    def _choose(self, state):
        """Return the greedy token the grammar allows at ``state`` (the only one if forced)."""
        allowed = self.grammar.allowed(state)
        return int(allowed[0]) if len(allowed) == 1 else self.backend.argmax(allowed)

    def _drafts(self, state, chosen, limit=None):
        """Return tokens likely to follow ``chosen``, each allowed by the grammar.

        At most ``limit`` (by default ``speculative_tokens``, and only as many as the cache
        has room for without eviction), none past the action's end. Sources, in order: the
        last action from this point on (actions at a control rate change slowly); else what
        followed the most recent earlier occurrence of the last two tokens in the cache
        (prompt lookup); then tokens the grammar forces.
        """
        if limit is None:
            limit = min(self.speculative_tokens,
                        self.backend.capacity - self.session.length - 1)   # no eviction mid-pass
        if limit <= 0:
            return []
        n = len(chosen)
        if self.last_action_ids[:n] == chosen:
            source = self.last_action_ids[n:]
        else:
            source = self._lookup(list(self.grammar.prefix_ids) + chosen)
        return self._allowed_run(state, source, limit)

    def _allowed_run(self, state, source, limit):
        """Return ``source``'s tokens from ``state`` on while the grammar allows them.

        Then the tokens it forces (a source token it does not allow ends the source); at
        most ``limit``, none past the action's end.
        """
        grammar, drafts = self.grammar, []
        for t in list(source) + [None] * limit:
            if len(drafts) >= limit or grammar.done(state):
                break
            allowed = grammar.allowed(state)
            if t is None or not _contains(allowed, t):
                if len(allowed) != 1:
                    break
                t = int(allowed[0])   # forced: certain
            drafts.append(int(t))
            state = grammar.advance(state, t)
        return drafts

    def _forced(self, state):
        """Return the tokens the grammar forces from ``state`` on (at most ``forced_run``).

        Only as many as the cache has room for without eviction mid-pass.
        """
        return self._allowed_run(state, (), min(self.forced_run,
                                                self.backend.capacity - self.session.length - 1))

    def _lookup(self, sequence, n=2, span=16):
        """Return up to ``span`` tokens that followed the latest ``sequence[-n:]`` in the cache."""
        if len(sequence) < n:
            return []
        ids = self.session.cache.token_ids[:self.session.length]
        if len(ids) <= n:
            return []
        # windows that match, then the latest of them with a token after it
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == np.asarray(sequence[-n:], np.int64)).all(axis=1))
        if not len(hits):
            return []
        at = int(hits[-1]) + n
        return ids[at:at + span].tolist()

    def _verify(self, record, segment, state, chosen, token, drafts, counted=True):
        """Run ``token`` and ``drafts`` in one pass and keep what greedy decoding would.

        Returns (the next token to choose from, or None when the action is complete, and
        the grammar state), having appended the kept drafts to ``chosen``. ``counted``:
        the drafts are speculation's (in the record's drafted and accepted), not only the
        tokens the grammar forces.
        """
        grammar = self.grammar
        states = [state]
        for t in drafts:
            states.append(grammar.advance(states[-1], t))
        allowed = [None if grammar.done(s) else grammar.allowed(s) for s in states]
        feed = [token] + drafts
        predicted = self.session.verify(feed, allowed)
        kept = 0
        while kept < len(drafts) and int(predicted[kept]) == drafts[kept]:
            kept += 1
        if counted:
            record.drafted += len(drafts)
            record.accepted += kept
            record.verify_passes += 1
        chosen.extend(drafts[:kept])
        state = states[kept]
        if grammar.done(state):   # its last token is deferred like any action's last
            self.session.keep_verified(segment, feed, kept)
            record.n_fed += kept
            return None, state
        self.session.keep_verified(segment, feed, kept + 1)
        record.n_fed += kept + 1
        return int(predicted[kept]), state

    def _can_finish(self, run, plan, remaining, drafts=0):
        """Tell whether the action can still finish by the deadline (the watchdog).

        The watchdog: can running this token (with ``drafts`` drafted tokens in one verify
        pass, none of them kept at worst) and choosing ``remaining`` more (the last of them
        deferred) still end by the deadline, with the admission margin kept as a guard band?
        A probe tick judges by what it has measured, not by the learned scale.
        """
        admission = self.admission
        scale = (admission.probe_scale(plan.n_prefill, plan.length, run.record.n_decode,
                                       plan.kept, run.ms_since_admit(), plan.restored,
                                       plan.pass_tokens, plan.fused_tokens)
                 if run.record.probe else None)
        length = self.session.length
        step = admission.step_ms(length, scale)
        if drafts:
            need = admission.verify_ms(drafts + 1, length, scale) + (remaining - 1) * step
        else:
            need = remaining * step
        return run.now() + (need + admission.margin_ms) / 1e3 <= run.deadline

    def _commit(self, run, plan, parts, segment, mark, state, chosen):
        """Teach admission what the tick cost.

        Keep the tokens and return the action, or roll back and refuse an action that finished
        after the deadline (never published).
        """
        record = run.record
        run.lap('decode_ms')
        in_time = run.now() <= run.deadline
        self.admission.observe(plan.n_prefill, plan.length, record.n_decode, plan.kept,
                               run.ms_since_admit(), record.probe, in_time=in_time,
                               restored=plan.restored, pass_tokens=plan.pass_tokens,
                               fused_tokens=plan.fused_tokens)
        if not in_time:
            record.late = True
            self.session.rollback(mark)
            return run.refuse('overrun_abort', plan.predicted, 'finished after the deadline')
        self.session.defer(segment, [chosen[-1], *self.grammar.end_ids])
        for ids, kind, topic, part_stamp in parts[:-1]:
            self.rendered[topic] = part_stamp
        if run.placed is not None:   # a flooded instruction, now in the cache
            self.instruction_ids, self.placed_at = run.placed, run.index
        # passes are the speculation's own evidence only where it ran (a tick priced as plain
        # decoding drafted nothing, and its steps would keep speculation priced off for ever)
        self.recent_decodes.append((record.tick, record.n_fed, record.n_decode,
                                    run.speculate))
        self.last_action_ids = list(chosen)
        self.session.decay_scores()
        record.decision = 'action'
        record.cache_length = self.session.length
        record.total_ms = run.ms_since_start()
        prefix = list(self.grammar.prefix_ids)
        action = self.grammar.action(state, prefix + chosen + list(self.grammar.end_ids))
        return TickResult(action, None, record)


def _contains(sorted_ids, token):
    """Tell whether ``token`` is in the sorted id array ``sorted_ids``."""
    at = int(np.searchsorted(sorted_ids, token))
    return at < len(sorted_ids) and int(sorted_ids[at]) == token


@dataclass
class _Plan:
    """What admission decided a tick would run.

    Tokens to prefill (deferred ones included) and decode steps over a cache of ``length``, and the
    eviction (``slots`` kept, or None).
    """

    n_prefill: int
    n_decode: int
    length: int
    slots: Optional[object] = None
    kept: Optional[int] = None
    predicted: float = 0.0
    restored: int = 0              # instruction tokens restored by copy, not prefilled
    passes: int = 0                # forward passes after the prefill the prediction prices
    pass_tokens: int = 0           # each priced as a verify pass of this many (0: a step)
    fused_tokens: int = 0          # drafts verified beside the prefill (0: none)


class _Run:
    """One tick in progress: its record, clock readings and the way it refuses."""

    def __init__(self, engine, stamp, deadline):
        self.engine = engine
        self.index = engine.index
        engine.index += 1
        engine.admission.new_tick()
        self.record = TickRecord(self.index, stamp, deadline, capacity=engine.backend.capacity)
        self.stamp, self.deadline = stamp, deadline
        self.instruction = None   # a new instruction to place first: (its part, stored state)
        self.fused = None         # a fused pass's (drafts, grammar states, greedy tokens)
        # drafts: speculation is on, and admission did not price this tick as plain decoding
        self.speculate = engine.speculative_tokens > 0
        self.placed = None        # a flooded instruction prefilled with the inputs (its ids)
        self.now = engine.clock.now
        self.t0 = self.last = self.admitted = self.now()

    def ms_left(self):
        return (self.deadline - self.now()) * 1e3

    def ms_since_start(self):
        return (self.now() - self.t0) * 1e3

    def ms_since_admit(self):
        return (self.now() - self.admitted) * 1e3

    def mark_rendered(self):
        """Mark the end of rendering: admission, and the tick's model time, start here."""
        self.lap('render_ms')
        self.admitted = self.last

    def lap(self, field):
        """Record the time since the last lap as ``field`` of the record."""
        now = self.now()
        setattr(self.record, field, (now - self.last) * 1e3)
        self.last = now

    def refuse(self, reason, predicted=0.0, detail='', available=None):
        record = self.record
        record.decision, record.reason = 'refusal', reason
        # the time admission compared with, or what was left at the tick's start
        record.available_ms = max(0.0, (self.deadline - self.t0) * 1e3 if available is None
                                  else available)
        record.predicted_ms = predicted
        record.cache_length = self.engine.session.length
        record.total_ms = self.ms_since_start()
        return TickResult(None, Refusal(self.index, reason, predicted, record.available_ms,
                                        self.stamp, self.deadline, detail), record)


class ModelTimedBackend:
    """A backend whose work advances a ``ModelClock`` by the cost model's prediction of it.

    Under the model clock (replay, evaluation) time is what admission predicts: compaction,
    prefill, decode, verify and a restore by copy each charge their scaled cost as they run,
    so the tick itself never charges time. Everything else passes through to the wrapped backend.
    """

    def __init__(self, backend, clock, admission):
        self._backend, self._clock, self._admission = backend, clock, admission

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def _charge(self, ms):
        self._clock.charge(ms * self._admission.scale)

    def compact(self, keep):
        self._backend.compact(keep)
        self._charge(self._admission.model.compact_ms(len(keep)))

    def prefill(self, token_ids):
        start = self._backend.length
        self._backend.prefill(token_ids)
        self._charge(self._admission.model.prefill_ms(self._backend.length - start, start))

    def decode(self, token_id):
        self._backend.decode(token_id)
        self._charge(self._admission.model.decode_ms(self._backend.length))

    def verify(self, token_ids, allowed):
        start = self._backend.length
        predicted = self._backend.verify(token_ids, allowed)
        self._charge(self._admission.model.verify_ms(len(token_ids), start))
        return predicted

    def prefill_verify(self, prefill_ids, drafts, allowed):
        start = self._backend.length
        predicted = self._backend.prefill_verify(prefill_ids, drafts, allowed)
        self._charge(self._admission.model.fused_ms(len(prefill_ids), len(predicted) - 1, start))
        return predicted

    def import_kv(self, tensors, start=0):
        length = self._backend.import_kv(tensors, start)
        self._charge(self._admission.model.compact_ms(length - start))   # priced as admitted
        return length
