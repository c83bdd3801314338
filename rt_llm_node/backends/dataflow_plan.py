"""The dataflow decode step's plan: tasks, the ``ready`` counters they wait on, per-SM lists.

A decode step as one persistent launch is a set of tasks, each a fused phase of one layer on a
slice of its outputs (RMSNorm into q/k/v with RoPE and the KV append for one kv head's group;
attention of one kv group over one chunk of the cache; o with the residual; gate/up with SiLU;
down with the residual; the final norm into a slice of the LM head with its grammar-constrained
argmax; the argmax's reduction). A task waits until the ``ready`` counters of what it reads have
reached the counts the planner wrote into it, and adds one to its own counter once its stores
are visible: no grid-wide barrier, no kernel boundary inside a step. Each multiprocessor runs
its list in order.

Everything here is pure (numpy only), so CI checks every plan without a GPU
(test/unit/test_dataflow_plan.py): each counter's signals add up to what is waited for, every
task waits (directly or through the tasks it waits for) for every earlier task whose output it
reads or overwrites, and no set of in-order lists can stall (``simulate``).

Naming: a *task*, not an instruction (that word is the robot's task text here); the counters
are ``ready`` (``counters`` already names the attention kernels' split counts).
"""

from dataclasses import dataclass
from dataclasses import field

import numpy as np

TASK_OPS = ('nop', 'embed', 'qkv', 'attn', 'o', 'gate_up', 'down', 'lm_head', 'argmax')
TASK_FIELDS = ('op', 'layer', 'unit0', 'units', 'wait0', 'need0', 'wait1', 'need1', 'signal',
               'arg')
TASK_WORDS = len(TASK_FIELDS)
NO_COUNTER = -1
ASSIGN_MODES = ('round_robin', 'greedy')
ATTN_CHUNK_KEYS = 64     # cached keys an attention task covers
ROW_ALIGN = 16           # output rows of a matvec task: a multiple of this (bf16 16-byte loads)


class PlanError(ValueError):
    """A plan breaks a rule (an unmet wait, a missing dependency, too many waits)."""


@dataclass
class Task:
    """One unit of work: ``op`` on ``units`` output units from ``unit0`` of ``layer``.

    ``waits``: [(counter, count)] it needs before it starts (two at most, the task format's
    slots); ``signal``: the counter it adds one to when done. ``reads``/``writes``:
    [(buffer, lo, hi)] element ranges, the planner's own record for the checks (the device
    gets none of it). ``cost``: bytes of weights it streams (for ``assign``).
    """

    op: str
    layer: int
    unit0: int
    units: int
    arg: int = 0
    waits: list = field(default_factory=list)
    signal: int = NO_COUNTER
    reads: list = field(default_factory=list)
    writes: list = field(default_factory=list)
    cost: float = 0.0

    def words(self):
        """Return the task packed: TASK_WORDS int32 values in TASK_FIELDS order."""
        if len(self.waits) > 2:
            raise PlanError(f'{self}: {len(self.waits)} waits, the format holds two')
        waits = list(self.waits) + [(NO_COUNTER, 0)] * (2 - len(self.waits))
        return [TASK_OPS.index(self.op), self.layer, self.unit0, self.units, waits[0][0],
                waits[0][1], waits[1][0], waits[1][1], self.signal, self.arg]

    def __str__(self):
        waits = ', '.join(f'ready[{c}]>={n}' for c, n in self.waits) or 'nothing'
        return (f'L{self.layer} {self.op}({self.arg}) u[{self.unit0}:{self.unit0 + self.units})'
                f' wait {waits} signal ready[{self.signal}]')


@dataclass
class Plan:
    """The tasks of one decode step in program order, and the names of their counters."""

    tasks: list
    ready: dict          # counter name -> index
    n_sm: int

    def counter_name(self, index):
        return next((name for name, i in self.ready.items() if i == index), str(index))


def ready_slots(cfg):
    """Return counter name -> index: each name says which data is complete, not who wrote it.

    Per layer ``l``: ``x_attn[l]`` (x ready for its q/k/v), ``qkv[l][g]`` (q, k and v of kv
    group ``g``), ``attn[l]`` (every attention partial), ``x_mlp[l]`` (x after o), ``act[l]``
    (SiLU(gate) * up); then ``x_attn[L]`` (x after the last down: ready for the final norm)
    and ``logits`` (every LM head slice and its best token).
    """
    names = []
    for layer in range(cfg.num_layers):
        names.append(f'x_attn[{layer}]')
        names += [f'qkv[{layer}][{g}]' for g in range(cfg.num_kv_heads)]
        names += [f'attn[{layer}]', f'x_mlp[{layer}]', f'act[{layer}]']
    names += [f'x_attn[{cfg.num_layers}]', 'logits']
    return {name: i for i, name in enumerate(names)}


def split(n, parts, align=1):
    """Cut ``n`` units into at most ``parts`` ranges of whole ``align`` blocks: [(lo, hi)]."""
    blocks = -(-n // align)
    parts = max(1, min(parts, blocks))
    edges = [min(n, (blocks * i // parts) * align) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def build(cfg, n_sm, capacity, weight_bytes=2.0):
    """Return the Plan of one decode step of ``cfg`` for ``n_sm`` multiprocessors.

    ``capacity``: the KV cache's slots (attention is split into chunks of ``ATTN_CHUNK_KEYS``
    over it; a chunk past the step's length does nothing but signal). Matvecs are cut into
    about ``n_sm`` slices of whole ``ROW_ALIGN`` rows; q/k/v into head-sized units of a kv
    group (RoPE rotates within a head).
    """
    if n_sm < 1:
        raise PlanError(f'n_sm must be at least 1, not {n_sm}')
    if cfg.num_heads % cfg.num_kv_heads:
        raise PlanError('num_heads must be a multiple of num_kv_heads')
    ready = ready_slots(cfg)
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    group_q = cfg.num_heads // cfg.num_kv_heads
    group_units = group_q + 2           # the group's q heads, then its k head and v head
    chunks = -(-capacity // ATTN_CHUNK_KEYS)
    tasks = []

    def add(task, signal):
        task.signal = ready[signal]
        tasks.append(task)
        return task

    embed = split(hidden, n_sm, ROW_ALIGN)
    for lo, hi in embed:
        add(Task('embed', 0, lo, hi - lo, reads=[('token', 0, 1)], writes=[('x', lo, hi)],
                 cost=(hi - lo) * weight_bytes), 'x_attn[0]')
    x_parts = len(embed)
    for layer in range(cfg.num_layers):
        qkv_parts = []
        per_group = max(1, min(group_units, n_sm // cfg.num_kv_heads))
        for g in range(cfg.num_kv_heads):
            units = split(group_units, per_group)
            qkv_parts.append(len(units))
            for lo, hi in units:
                writes = []
                for u in range(lo, hi):
                    if u < group_q:
                        head = g * group_q + u
                        writes.append(('q', head * d, (head + 1) * d))
                    else:   # the new position's key or value row of kv head g
                        kind = 'k' if u == group_q else 'v'
                        writes.append((f'{kind}[{layer}]', g * d, (g + 1) * d))
                add(Task('qkv', layer, lo, hi - lo, arg=g,
                         waits=[(ready[f'x_attn[{layer}]'], x_parts)],
                         reads=[('x', 0, hidden)], writes=writes,
                         cost=(hi - lo) * d * hidden * weight_bytes), f'qkv[{layer}][{g}]')
        for g in range(cfg.num_kv_heads):
            for c in range(chunks):
                heads = (g * group_q * d, (g + 1) * group_q * d)
                add(Task('attn', layer, c, 1, arg=g,
                         waits=[(ready[f'qkv[{layer}][{g}]'], qkv_parts[g])],
                         reads=[('q', *heads), (f'k[{layer}]', g * d, (g + 1) * d),
                                (f'v[{layer}]', g * d, (g + 1) * d)],
                         writes=[('attn_part', g * chunks + c, g * chunks + c + 1)],
                         cost=ATTN_CHUNK_KEYS * 2 * d * 4.0), f'attn[{layer}]')
        n_attn = cfg.num_kv_heads * chunks
        o_parts = split(hidden, n_sm, ROW_ALIGN)
        for lo, hi in o_parts:   # merges the partials of every head, then its rows + residual
            add(Task('o', layer, lo, hi - lo, waits=[(ready[f'attn[{layer}]'], n_attn)],
                     reads=[('attn_part', 0, n_attn), ('x', lo, hi)], writes=[('x', lo, hi)],
                     cost=(hi - lo) * cfg.num_heads * d * weight_bytes), f'x_mlp[{layer}]')
        gu_parts = split(inter, n_sm, ROW_ALIGN)
        for lo, hi in gu_parts:
            add(Task('gate_up', layer, lo, hi - lo,
                     waits=[(ready[f'x_mlp[{layer}]'], len(o_parts))],
                     reads=[('x', 0, hidden)], writes=[('act', lo, hi)],
                     cost=2 * (hi - lo) * hidden * weight_bytes), f'act[{layer}]')
        down = split(hidden, n_sm, ROW_ALIGN)
        for lo, hi in down:
            add(Task('down', layer, lo, hi - lo, waits=[(ready[f'act[{layer}]'], len(gu_parts))],
                     reads=[('act', 0, inter), ('x', lo, hi)], writes=[('x', lo, hi)],
                     cost=(hi - lo) * inter * weight_bytes), f'x_attn[{layer + 1}]')
        x_parts = len(down)
    heads = split(cfg.vocab_size, n_sm, ROW_ALIGN)
    for i, (lo, hi) in enumerate(heads):
        add(Task('lm_head', cfg.num_layers, lo, hi - lo, arg=i,
                 waits=[(ready[f'x_attn[{cfg.num_layers}]'], x_parts)],
                 reads=[('x', 0, hidden)], writes=[('logits', lo, hi), ('best', i, i + 1)],
                 cost=(hi - lo) * hidden * weight_bytes), 'logits')
    tasks.append(Task('argmax', cfg.num_layers, 0, len(heads),
                      waits=[(ready['logits'], len(heads))], reads=[('best', 0, len(heads))],
                      writes=[('token', 0, 1)], signal=NO_COUNTER))
    return Plan(tasks, ready, n_sm)


def assign(plan, mode='greedy'):
    """Return per-SM lists of task indices, each in program order (so none can stall).

    ``round_robin``: task i to SM i mod n; ``greedy``: each task to the SM with the least
    work so far (its ``cost``; a list scheduler that keeps program order).
    """
    if mode not in ASSIGN_MODES:
        raise PlanError(f'unknown assign mode {mode!r} (one of {ASSIGN_MODES})')
    queues = [[] for _ in range(plan.n_sm)]
    load = np.zeros(plan.n_sm)
    for i, task in enumerate(plan.tasks):
        sm = i % plan.n_sm if mode == 'round_robin' else int(np.argmin(load))
        queues[sm].append(i)
        load[sm] += task.cost + 1.0
    return queues


def pack(plan, queues):
    """Return int32 [n_sm, longest list, TASK_WORDS], each list padded with nop tasks."""
    longest = max((len(q) for q in queues), default=0)
    out = np.zeros((len(queues), max(1, longest), TASK_WORDS), np.int32)
    out[:, :, TASK_FIELDS.index('wait0')] = NO_COUNTER
    out[:, :, TASK_FIELDS.index('wait1')] = NO_COUNTER
    out[:, :, TASK_FIELDS.index('signal')] = NO_COUNTER
    for sm, queue in enumerate(queues):
        for at, index in enumerate(queue):
            out[sm, at] = plan.tasks[index].words()
    return out


def simulate(plan, queues, rng=None):
    """Run the per-SM lists under the device's rules; return the order tasks ran in.

    Each SM runs its list in order; the task at its head starts only once every counter it
    waits on has its count. ``rng``: which runnable SM goes next (None: the lowest).
    PlanError, naming each stuck SM's task and its counter (have / need), if none can move
    while tasks remain.
    """
    ready = np.zeros(len(plan.ready), np.int64)
    heads = [0] * len(queues)
    order = []
    remaining = sum(len(q) for q in queues)
    while remaining:
        runnable = [sm for sm, q in enumerate(queues) if heads[sm] < len(q) and all(
            ready[c] >= n for c, n in plan.tasks[q[heads[sm]]].waits)]
        if not runnable:
            stuck = []
            for sm, q in enumerate(queues):
                if heads[sm] < len(q):
                    task = plan.tasks[q[heads[sm]]]
                    unmet = [f'{plan.counter_name(c)} {ready[c]}/{n}' for c, n in task.waits
                             if ready[c] < n]
                    stuck.append(f'SM {sm}: {task} ({", ".join(unmet)})')
            raise PlanError('the lists stall: ' + '; '.join(stuck[:8]))
        sm = runnable[0] if rng is None else runnable[int(rng.integers(len(runnable)))]
        index = queues[sm][heads[sm]]
        heads[sm] += 1
        remaining -= 1
        task = plan.tasks[index]
        if task.signal != NO_COUNTER:
            ready[task.signal] += 1
        order.append(index)
    return order


def check(plan):
    """Check the plan's counts and dependencies; PlanError naming the first broken rule.

    Counts: each counter's signals equal every count waited for on it. Dependencies: a task
    that reads data waits, directly or through the tasks it waits for, for every earlier
    task that wrote it; one that writes data, for every earlier task that read or wrote it.
    Writes of one op of one layer never overlap (one writer an element).
    """
    signals = np.zeros(len(plan.ready), np.int64)
    for task in plan.tasks:
        if task.signal != NO_COUNTER:
            signals[task.signal] += 1
    for task in plan.tasks:
        for counter, need in task.waits:
            if need != signals[counter]:
                raise PlanError(f'{task}: waits for {need} on {plan.counter_name(counter)}, '
                                f'which gets {signals[counter]} signals')
    # ancestors as bitsets: a waiter depends on every task that signals what it waits for
    closure = {}     # counter -> bitset of its signallers and their ancestors
    ancestors = []
    for i, task in enumerate(plan.tasks):
        mine = 0
        for counter, _ in task.waits:
            mine |= closure.get(counter, 0)
        ancestors.append(mine)
        if task.signal != NO_COUNTER:
            closure[task.signal] = closure.get(task.signal, 0) | mine | (1 << i)
    _check_accesses(plan, ancestors)


def _check_accesses(plan, ancestors):
    """Every conflicting earlier access of a range is an ancestor of the later one."""
    edges = {}
    for task in plan.tasks:
        for buffer, lo, hi in task.reads + task.writes:
            edges.setdefault(buffer, set()).update((lo, hi))
    cuts = {b: np.array(sorted(e)) for b, e in edges.items()}
    last_writer = {b: [None] * (len(c) - 1) for b, c in cuts.items()}
    readers = {b: [[] for _ in range(len(c) - 1)] for b, c in cuts.items()}
    owners = {}
    for i, task in enumerate(plan.tasks):
        for buffer, lo, hi in task.reads:
            for s in _segments(cuts[buffer], lo, hi):
                writer = last_writer[buffer][s]
                if writer is not None and not ancestors[i] >> writer & 1:
                    raise PlanError(f'{task} reads {buffer}[{lo}:{hi}] without waiting for '
                                    f'{plan.tasks[writer]}, which wrote it')
                readers[buffer][s].append(i)
        for buffer, lo, hi in task.writes:
            for s in _segments(cuts[buffer], lo, hi):
                earlier = readers[buffer][s] + ([last_writer[buffer][s]]
                                                if last_writer[buffer][s] is not None else [])
                for j in earlier:
                    if j != i and not ancestors[i] >> j & 1:
                        raise PlanError(f'{task} overwrites {buffer}[{lo}:{hi}] without '
                                        f'waiting for {plan.tasks[j]}')
                key = (task.op, task.layer, buffer, s)
                if key in owners and owners[key] != i:
                    raise PlanError(f'{task} and {plan.tasks[owners[key]]} both write '
                                    f'{buffer}[{lo}:{hi}]')
                owners[key] = i
                last_writer[buffer][s], readers[buffer][s] = i, []


def _segments(cuts, lo, hi):
    """Return the indices of the segments between ``cuts`` that [lo, hi) covers."""
    return range(int(np.searchsorted(cuts, lo)), int(np.searchsorted(cuts, hi)))


def dump(plan, queues):
    """Return each SM's list as text (the first thing to read when a step stalls)."""
    lines = []
    for sm, queue in enumerate(queues):
        lines.append(f'SM {sm}: {len(queue)} tasks')
        lines += [f'  {plan.tasks[i]}' for i in queue]
    return '\n'.join(lines)
