"""Fine-tuning data from rosbags: at each recorded tick, what the node would have fed the model.

A bag with the robot's inputs and the commands it was driven by (an operator, an expert, an
earlier policy) is replayed through the node's own engine (``configure.build_engine``: the
renderers, the prompt layout, the eviction policy, the instruction cache, ``replay.bag_ticks``
for what the node holds at each tick), with a ``TeacherBackend`` in place of the model: it
keeps the cache's token ids, runs nothing, and answers each choice of the action with the
recorded command's token. So the engine's own decode loop writes the recorded actions into
the cache, and each sample is the cache as the model would see it at that tick (token ids at
positions 0..n-1, which is what the backends' slots hold after eviction) followed by the
action's tokens.

What the cache shows of earlier ticks may differ from the recorded commands while every label
stays the recorded command (``Augment``): Gaussian noise on each field, and now and then a
random action held for a while. Commands change slowly, so a learner shown the clean history
learns to repeat its last action (the copycat shortcut of behaviour cloning with an action
history; Wen et al., "Fighting Copycat Agents", 2020): in closed loop one wrong early action
is then repeated for ever. Noise and held random actions make the history a poor predictor of
the label, and teach the way back from a wrong action. Simulated restarts (the engine built
afresh, as after the node restarted) add decisions with no history at all, which a long bag
holds once. The contexts stay exactly the engine's, with these actions in its cache (as after
the node had acted so).

Ticks without a command in the period after them (before the operator's first, after a
gap) and ticks the engine refuses (stale inputs) give no sample; their observations stay
unrendered, as after a refusal on the robot.
"""

import bisect
from dataclasses import dataclass
import math
from pathlib import Path
import zlib

import numpy as np

from rt_llm_node.admission import Admission
from rt_llm_node.admission import CostModel
from rt_llm_node.backends import BackendError
from rt_llm_node.backends import compact_slots
from rt_llm_node.backends import rollback_length
from rt_llm_node.backends import verify_limit
from rt_llm_node.bags import input_connections
from rt_llm_node.bags import open_bag
from rt_llm_node.codec import normalize_type
from rt_llm_node.configure import build_engine
from rt_llm_node.engine import ModelClock
from rt_llm_node.replay import action_topic
from rt_llm_node.replay import bag_ticks
from rt_llm_node.replay import ReplayError

TWISTS = ('geometry_msgs/msg/Twist', 'geometry_msgs/msg/TwistStamped')


@dataclass(frozen=True)
class Augment:
    """What the cache shows of earlier ticks (module docstring); labels are never changed.

    ``noise``: a standard deviation per action field (its units) added to the shown command;
    ``hold_rate``: the chance a tick starts showing a uniformly random action instead, held for
    1 to ``hold_ticks`` ticks; ``restart_s``: mean seconds between simulated restarts.
    """

    noise: tuple = ()
    hold_rate: float = 0.0
    hold_ticks: int = 30
    restart_s: float = 0.0

    def __post_init__(self):
        if not (all(0.0 <= x < 1e3 for x in self.noise) and 0.0 <= self.hold_rate <= 1.0
                and self.hold_ticks >= 1 and 0.0 <= self.restart_s < 1e9):
            raise ValueError(f'augmentation out of range: {self}')

    def check(self, grammar):
        if self.noise and len(self.noise) != len(grammar.fields):
            raise ValueError(f'history noise needs {len(grammar.fields)} standard deviations '
                             f'(one per action field), not {len(self.noise)}')


@dataclass
class Sample:
    """One tick's training example: the context, then the action's tokens (the loss's)."""

    context: np.ndarray     # int64 token ids at positions 0..n-1: the cache at the decision
    action: np.ndarray      # int64: the action's tokens after the prefix, end excluded
    tick_ns: int


class TeacherBackend:
    """A backend that keeps the cache's token ids and chooses the action's tokens it is taught.

    The engine's calls have a backend's effect on the cache's slots (prefill, decode, verify
    and keep, compaction, rollback, instruction state export and import); ``argmax`` and the
    verify rows answer with the taught action (``teach``), whose first choice marks where the
    model would decide: ``contexts`` collects the cache there. ``model``: a backend of the
    model that runs the same calls, for the attention mass the ``meaning`` and ``h2o``
    policies evict by (without it every mass is 0: exact for ``recency`` and ``sink_window``,
    and for ``meaning`` its stale-first order with ties by age).
    """

    name = 'teacher'

    def __init__(self, capacity, vocab_size, model=None):
        self.capacity = int(capacity)
        self.vocab_size = int(vocab_size)
        self.model = model
        if model is not None and model.capacity != self.capacity:
            raise ValueError('the model backend must have the cache capacity of the parameters')
        # forced tokens ride in a verify pass, as on the model
        self.verify_tokens = self.capacity if model is None else verify_limit(model)
        self.ids = np.zeros(self.capacity, np.int64)
        self.length = 0
        self.action = None       # the taught action's tokens
        self.start = None        # the slot of its first token: where the last prefill ended
        self.decided = False     # the context of this action is in ``contexts``
        self.rows_from = 0       # the length before the last verify pass
        self.contexts = []

    def teach(self, action_ids):
        self.action, self.start, self.decided = [int(t) for t in action_ids], None, False

    def _append(self, token_ids):
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        if self.length + len(ids) > self.capacity:
            raise BackendError(f'{len(ids)} tokens do not fit: {self.length} of '
                               f'{self.capacity} slots used')
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise BackendError('a token id outside the vocabulary')
        self.ids[self.length:self.length + len(ids)] = ids
        self.length += len(ids)
        return ids

    def _taught(self, at):
        """Return the taught token at action position ``at`` (0 past its end: never kept)."""
        if self.action is None:
            raise BackendError('nothing taught: the teacher backend cannot choose')
        return self.action[at] if at < len(self.action) else 0

    def prefill(self, token_ids):
        ids = self._append(token_ids)
        if self.model is not None:
            self.model.prefill(ids)
        self.start = self.length   # the action prefix is the last thing a tick prefills

    def decode(self, token_id):
        self._append([token_id])
        if self.model is not None:
            self.model.decode(int(token_id))

    def verify(self, token_ids, allowed):
        base = self.length - self.start
        self.rows_from = self.length   # row i's mass spans the slots before it and itself
        ids = self._append(token_ids)
        if self.model is not None:
            self.model.verify(ids, allowed)
        return np.array([self._taught(base + i + 1) for i in range(len(ids))], np.int64)

    def argmax(self, allowed=None):
        if not self.decided:   # the first choice: the model decides on the cache to the prefix
            self.decided = True
            self.contexts.append(self.ids[:self.start].copy())
        token = self._taught(self.length - self.start)
        if allowed is not None and token not in {int(t) for t in allowed}:
            raise BackendError(f'the taught token {token} is not allowed by the grammar here')
        return token

    def attention_mass(self):
        if self.model is not None:
            return self.model.attention_mass()
        return np.zeros(self.length, np.float32)

    def row_mass(self, i):
        if self.model is not None:
            return self.model.row_mass(i)
        return np.zeros(self.rows_from + i + 1, np.float32)

    def rollback(self, length):
        self.length = rollback_length(length, self.length)
        if self.model is not None:
            self.model.rollback(length)

    def compact(self, keep):
        keep = compact_slots(keep, self.length)
        self.ids[:len(keep)] = self.ids[keep]
        self.length = len(keep)
        if self.model is not None:
            self.model.compact(keep)

    def export_kv(self, start, stop):
        tensors = {} if self.model is None else self.model.export_kv(start, stop)
        return {**tensors, 'teacher_ids': self.ids[start:stop].copy()}

    def import_kv(self, tensors, start=0):
        """Put stored slots (``export_kv``'s) at ``start`` on; returns the new length."""
        tensors = dict(tensors)
        ids = tensors.pop('teacher_ids')
        self.length = rollback_length(start, self.length)
        self._append(ids)
        if self.model is not None:
            self.model.import_kv(tensors, start)
        return self.length


def command_values(msg, msgtype, grammar):
    """Return the grammar's field values of a recorded command (None where it has none)."""
    if normalize_type(msgtype) == 'geometry_msgs/msg/TwistStamped':
        msg = msg.twist
    values = {}
    for f in grammar.fields:
        part, _, axis = f.name.partition('.')
        value = float(getattr(getattr(msg, part), axis))
        if not math.isfinite(value):
            return None
        values[f.name] = value
    return values


def recorded_commands(reader, values, grammar, store):
    """Return [(stamp ns, field values)] of the bag's commands on the action topic, in order."""
    topic = action_topic(values)
    connections = [c for c in reader.connections if c.topic == topic]
    if not connections:
        raise ReplayError(f'the bag has no {topic}: the commands to learn from are missing '
                          '(record them with the inputs, e.g. rt-llm-demo-record --commands)')
    if any(normalize_type(c.msgtype) not in TWISTS for c in connections) or any(
            f.name.startswith('_') for f in grammar.fields):
        raise ReplayError(f'{topic}: learning from bags takes Twist or TwistStamped commands '
                          'and action fields a command holds (no plan fields)')
    out = []
    for connection, stamp_ns, raw in reader.messages(connections=connections):
        try:
            found = command_values(store.deserialize_cdr(raw, connection.msgtype),
                                   connection.msgtype, grammar)
        except Exception:   # an undecodable command: no label for its tick
            continue
        if found is not None:
            out.append((stamp_ns, found))
    return out


def bag_samples(bag, values, tokenizer, model=None, log=print, augment=Augment(), seed=0):
    """Return the Samples of one bag under the parameters ``values`` (the node's own).

    ``model``: a backend of the model whose attention the eviction policy reads
    (``TeacherBackend``), rolled back to empty first. ``augment``: what the cache shows of
    earlier ticks and the simulated restarts (``Augment``), drawn from ``seed`` and the bag's
    name.
    """
    from collections import Counter

    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    store = get_typestore(Stores.LATEST)
    values = dict(values, speculative_tokens=0)   # drafts change no token, only the passes
    reader = open_bag(bag)
    try:
        connections = input_connections(reader, values, {}, store,
                                        lambda text: log(f'warning: {text}'))
        if model is not None:
            model.rollback(0)
        backend = TeacherBackend(values['kv_capacity_tokens'], tokenizer.get_vocab_size(),
                                 model)

        def started():   # the node's engine on an empty cache
            backend.rollback(0)
            engine = build_engine(values, backend, tokenizer,
                                  Admission(CostModel(), margin_ms=0.0), ModelClock())
            engine.start()
            return engine
        engine = started()
        grammar = engine.grammar
        commands = recorded_commands(reader, values, grammar, store)
        augment.check(grammar)
        held, held_for = None, 0
        rng = np.random.default_rng([seed, zlib.crc32(Path(bag).name.encode())])
        stamps = [stamp for stamp, _ in commands]
        period_ns = int(1e9 / values['rate_hz'])
        topic_of = {c.topic: node_topic for node_topic, c in connections.items()}
        n_prefix, n_end = len(grammar.prefix_ids), len(grammar.end_ids)

        def action_tokens(command):
            ids = tokenizer.encode(grammar.render(command)).ids
            return ids[n_prefix:len(ids) - n_end]

        samples, bad = [], Counter()
        for tick_ns, snapshot in bag_ticks(reader, topic_of, store, reader.start_time,
                                           reader.end_time, 1.0 / values['rate_hz'],
                                           lambda text: log(f'warning: {text}'), bad):
            # the command given in the period after the tick: the answer to its inputs
            at = bisect.bisect_right(stamps, tick_ns)
            if at == len(stamps) or stamps[at] > tick_ns + period_ns:
                continue
            if augment.restart_s and rng.random() < period_ns / 1e9 / augment.restart_s:
                engine = started()
            label = action_tokens(commands[at][1])
            shown = commands[at][1]
            if augment.noise:
                shown = {f.name: f.quantize(shown[f.name] + rng.normal(0.0, std))
                         for f, std in zip(grammar.fields, augment.noise)}
            if held_for == 0 and rng.random() < augment.hold_rate:
                held = {f.name: f.values[rng.integers(len(f.values))] for f in grammar.fields}
                held_for = int(rng.integers(1, augment.hold_ticks + 1))
            if held_for:
                shown, held_for = held, held_for - 1
            shown = action_tokens(shown)
            backend.teach(shown)
            engine.clock.advance_to(tick_ns / 1e9)
            decided = len(backend.contexts)
            result = engine.tick(dict(snapshot), tick_ns / 1e9, tick_ns / 1e9 + 1e9)
            if result.action is None:
                continue
            if list(result.action.token_ids[n_prefix:len(result.action.token_ids) - n_end]) \
                    != shown or len(backend.contexts) != decided + 1:
                raise ReplayError(f'tick at {tick_ns} ns: the engine did not take the taught '
                                  'action')
            samples.append(Sample(backend.contexts[-1], np.asarray(label, np.int64), tick_ns))
        return samples
    finally:
        reader.close()
