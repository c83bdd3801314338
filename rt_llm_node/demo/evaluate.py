"""``rt-llm-eval``: closed-loop evaluation of the demo policy under each eviction policy.

For every (policy, cache budget) the shipped model drives the in-process world
through the very TickEngine the node uses, on held-out seeds; reported: goal
success rate, and action agreement with the expert on the same observations.
The expert is run on the same seeds for reference. Timing is not the subject
here (a model clock and an always-admitting cost model are used): the node and
the benchmarks measure time. ``--action-delay N`` makes each command reach the
robot N ticks after the observation it answers (the live loop's actuation latency:
0 or 1 tick with ``rt-llm-demo-world``, by the phase of the two timers).

    rt-llm-eval --episodes 200 --json eval.json --plot eviction.png
    rt-llm-eval --merge a.json b.json --json all.json   # runs over other seeds, one table
    rt-llm-eval --episodes 100 --json eval.json --resume  # go on where eval.json stopped

(``benchmarks/bench_demo.py`` runs it and records the table in the results file.)
"""

import argparse
from collections import deque
from concurrent.futures import as_completed
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import ThreadPoolExecutor
import json
import multiprocessing
import os
from pathlib import Path
import sys
import threading
import time

from rt_llm_node.admission import Admission
from rt_llm_node.admission import CostModel
from rt_llm_node.backends import BackendError
from rt_llm_node.backends import KV_DTYPES
from rt_llm_node.backends import make_backend
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.codec import scan_sectors
from rt_llm_node.configure import verify_tokens
from rt_llm_node.demo.episodes import SCAN_SECTORS
from rt_llm_node.demo.expert import expert_command
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.demo.task import SYSTEM_PROMPT
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.engine import ModelClock
from rt_llm_node.engine import TickEngine
from rt_llm_node.files import FileError
from rt_llm_node.files import write_atomic
from rt_llm_node.instruction_cache import InstructionCache
from rt_llm_node.kvcache import POLICIES
from rt_llm_node.model import load_model
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.model.quant import WEIGHT_FORMATS

HELD_OUT_SEED0 = 1_000_000      # training uses seeds below 100,000 x (training seed + 1)
BUDGETS = (128, 256, 512, 'full')
# what an episode raises for inputs it cannot use (a checkpoint, adapter or parameter file; a
# cache budget the model or the prompt cannot take): one line and exit status 2, no traceback
EPISODE_ERRORS = (ValueError, FileError, BackendError)
_CACHE = {}


class Actuation:
    """Commands reach the robot ``delay`` ticks after they are given (standing still before)."""

    def __init__(self, delay=0):
        if delay < 0:
            raise ValueError(f'action delay must be >= 0 ticks, got {delay}')
        self.queue = deque([(0.0, 0.0)] * int(delay))

    def __call__(self, command):
        """Give ``command``; returns the one the robot executes this tick."""
        self.queue.append(command)
        return self.queue.popleft()


_LOADING = threading.Lock()


def _checkpoint(path, weight_format='native', adapter=''):
    with _LOADING:   # once a process, whichever of its threads asks first
        if (path, weight_format, adapter) not in _CACHE:
            _CACHE[path, weight_format, adapter] = load_model(path, adapter, weight_format)
        return _CACHE[path, weight_format, adapter]


def run_model_episode(checkpoint, seed, policy, capacity, backend=None, max_ticks=None,
                      observe=None, expert_drives=False, action_delay=0, inputs=INPUTS,
                      aim=False, speculative_tokens=0, instruction_cache=0, grammar=None,
                      system_prompt=SYSTEM_PROMPT):
    """Run one closed-loop episode of the model.

    One closed-loop episode; returns dict(results, ticks, agree, refusals, executed, pose,
    collisions).

    ``executed``: the (v, w) the robot executed each tick (0, 0 on a refusal), which with
    ``seed`` replays the episode exactly (``episodes.expert_episode(executed=...)``, the
    DAgger data of ``training/train.py``); ``pose``: (x, y, yaw) at the end.
    ``max_ticks`` ends the episode early. ``observe(msgs, instruction, sectors, expert,
    model, action)`` sees every tick's messages, instruction, scan sector minima, both
    commands (quantized; the model's is None on a refusal) and the model's whole Action
    (plan fields too; None on a refusal); with ``expert_drives`` the robot executes
    the expert's command while the model still decides every tick (its fit on the expert's
    own states). ``action_delay``: ticks between an observation and its command's effect
    (``executed`` holds what the robot executed, so replays need no delay). ``inputs``: the
    input specs the engine renders, those the policy was trained on (``model_inputs``);
    ``aim``: the policy states its aim first (``model_aim``; the '_aim' plan field).
    ``speculative_tokens``: the engine's speculative decoding (0: off); ``passes`` lists
    each action's forward passes (its prefill, decode steps and verify passes), ``drafted``
    and ``accepted`` sum its drafts, ``actions`` holds each tick's action tokens (None on a
    refusal). ``instruction_cache``: entries of the engine's instruction cache (0: none, the
    instruction appended like an observation). ``grammar``, ``system_prompt``: a node
    parameter file's (``--params``) instead of the shipped policy's.
    """
    actuate = Actuation(action_delay)
    backend = backend or NumpyBackend(checkpoint, capacity)
    backend.rollback(0)
    grammar = grammar or action_grammar(checkpoint.tokenizer, aim)
    fv, fw = grammar.field('linear.x'), grammar.field('angular.z')
    clock = ModelClock()
    engine = TickEngine(backend, checkpoint.tokenizer, inputs, grammar,
                        Admission(CostModel(), margin_ms=0.0), policy=policy,
                        system_prompt=system_prompt, clock=clock,
                        speculative_tokens=speculative_tokens,
                        instruction_cache=(InstructionCache(instruction_cache)
                                           if instruction_cache else None))
    engine.start()
    world = DemoWorld(seed, messages=MessageFactory(ros=False))
    dt = world.config.dt
    snapshot, instruction = {}, ''
    agree = refusals = 0
    executed, passes, actions = [], [], []
    drafted = accepted = 0
    last = (0.0, 0.0)   # the command given last tick: the newest action in the context
    while not world.done and (max_ticks is None or world.tick < max_ticks):
        now = world.tick * dt
        clock.advance_to(now)
        msgs = world.observe()
        for topic, msg in msgs.items():
            snapshot[topic] = (msg, now)
        if '/instruction' in msgs:
            instruction = msgs['/instruction'].data
        sectors = scan_sectors(msgs['/scan'], SCAN_SECTORS)
        ev, ew = expert_command(instruction, sectors, msgs['/detections'].data,
                                last[1])
        expert = (fv.quantize(ev), fw.quantize(ew))
        result = engine.tick(snapshot, now, now + dt)
        actions.append(None if result.action is None else result.action.token_ids)
        if result.action is None:
            refusals += 1
            model = None
        else:
            passes.append(1 + result.record.n_decode)
            drafted += result.record.drafted
            accepted += result.record.accepted
            model = (result.action.values['linear.x'], result.action.values['angular.z'])
            agree += model == expert
        if observe is not None:
            observe(msgs, instruction, sectors, expert, model, result.action)
        last = expert if expert_drives else (model or (0.0, 0.0))
        command = actuate(last)
        executed.append(command)
        world.step(*command)
    return {'results': world.results, 'ticks': world.tick, 'agree': agree,
            'refusals': refusals, 'executed': executed,
            'pose': (world.x, world.y, world.yaw), 'collisions': world.collisions,
            'passes': passes, 'drafted': drafted, 'accepted': accepted, 'actions': actions}


def run_expert_episode(seed, action_delay=0):
    """Return the expert alone on ``seed`` (its commands quantized like the model's)."""
    actuate = Actuation(action_delay)
    world = DemoWorld(seed, messages=MessageFactory(ros=False))
    instruction = ''
    from rt_llm_node.demo.task import numeric_field
    from rt_llm_node.demo.task import TWIST_FIELDS
    fv, fw = (numeric_field(f) for f in TWIST_FIELDS)
    last_w = 0.0
    while not world.done:
        msgs = world.observe()
        if '/instruction' in msgs:
            instruction = msgs['/instruction'].data
        v, w = expert_command(instruction, scan_sectors(msgs['/scan'], SCAN_SECTORS),
                              msgs['/detections'].data, last_w)
        last_w = fw.quantize(w)
        world.step(*actuate((fv.quantize(v), last_w)))
    return {'results': world.results, 'ticks': world.tick}


_THREAD = threading.local()   # each thread's backends, one a cache budget (its own stream)
_POOL = []                    # a worker's threads, the same for every batch: backends stay


def episode_batch(jobs, threads=1):
    """Several episodes in one worker process, ``threads`` at once; their results in order.

    Each thread keeps its own backends (``episode_job``), so on the GPU each episode has its
    own CUDA stream in the process's one context: one episode's kernels run beside another's,
    where the contexts of separate processes only take turns on the GPU.
    """
    if threads == 1:
        return [episode_job(job) for job in jobs]
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(threads))
    return list(_POOL[0].map(episode_job, jobs))


def batches(jobs, threads):
    """Split {job: row} (seed-major) into the lists ``episode_batch`` runs.

    Up to ``threads`` episodes of one row a batch (alike in length), the rows' batches in turn,
    so that the seeds stay in step across the rows.
    """
    rows = {}
    for job, row in jobs.items():
        rows.setdefault(row, []).append(job)
    longest = max(map(len, rows.values()), default=0)
    return [row[at:at + threads] for at in range(0, longest, threads) for row in rows.values()
            if row[at:at + threads]]


def run_episodes(jobs, workers, threads, backend):
    """Yield (job, result) for the ``episode_job`` tuples ``jobs`` ({job: row}) as they finish.

    ``workers`` processes, each running ``threads`` episodes at once (``episode_batch``); for
    the CUDA backend the processes start fresh (spawn): CUDA cannot be used in a child forked
    after its parent touched it. An episode's error (a checkpoint, adapter or parameter file
    it cannot use) is raised here as itself: the package's errors cross processes intact.
    """
    context = multiprocessing.get_context('spawn' if backend == 'cuda' else None)
    todo = batches(jobs, threads)
    # no more processes than batches: a worker count beyond the work starts nothing idle
    pool = ProcessPoolExecutor(max(1, min(workers, len(todo))), mp_context=context)
    try:
        futures = {pool.submit(episode_batch, batch, threads): batch for batch in todo}
        for future in as_completed(futures):
            yield from zip(futures[future], future.result())
    finally:   # an episode's error ends the run: the episodes not yet started never start
        pool.shutdown(cancel_futures=True)


def episode_job(job):
    """One episode in a worker process.

    (model, policy, budget, seed, action delay, backend, weight format, kv dtype, adapter,
    parameter file or '') -> its result dict.
    """
    model, policy, budget, seed, delay, backend, weight_format, kv_dtype, adapter, params = job
    checkpoint = _checkpoint(model, weight_format, adapter)
    if policy == 'expert':
        return run_expert_episode(seed, delay)
    capacity = checkpoint.config.max_position_embeddings if budget == 'full' else int(budget)
    if params:   # the inputs, action and prompt of a node parameter file
        from rt_llm_node.configure import action_grammar as params_grammar
        from rt_llm_node.configure import input_specs
        from rt_llm_node.replay import load_params
        values = load_params(params)
        inputs, grammar = input_specs(values), params_grammar(values, checkpoint.tokenizer)
        system_prompt = values['system_prompt']
    else:
        inputs, grammar = model_inputs(model), action_grammar(checkpoint.tokenizer,
                                                              model_aim(model))
        system_prompt = SYSTEM_PROMPT
    key = (model, capacity, weight_format, kv_dtype, adapter)
    backends = _THREAD.__dict__.setdefault('backends', {})
    if key not in backends:   # reused by this thread's later episodes (rolled back to 0)
        backends[key] = make_backend(backend, checkpoint, capacity, kv_dtype=kv_dtype,
                                     verify_tokens=verify_tokens(0, grammar))
    return run_model_episode(checkpoint, seed, policy, capacity, backends[key],
                             action_delay=delay, inputs=inputs, grammar=grammar,
                             system_prompt=system_prompt)


def summarize(episodes):
    results = [r for e in episodes for r in e['results']]
    ticks = sum(e['ticks'] for e in episodes)
    out = {'episodes': len(episodes), 'goals': len(results),
           'success': sum(r == 'reached' for r in results) / max(1, len(results)),
           'ticks': ticks}
    if episodes and 'agree' in episodes[0]:
        out['agreement'] = sum(e['agree'] for e in episodes) / max(1, ticks)
        out['refusals'] = sum(e['refusals'] for e in episodes)
    return out


def summarize_rows(gathered):
    """Summarize each row of an evaluation.

    {row: {seed: episode}} -> {row: summary with its seeds and the goals reached on each (rows on
    the same seeds pair up, e.g. for a sign test).
    """
    return {row: dict(summarize([eps[s] for s in sorted(eps)]), seeds=sorted(eps),
                      reached=[sum(r == 'reached' for r in eps[s]['results'])
                               for s in sorted(eps)])
            for row, eps in gathered.items()}


def table_rows(table, budgets, policies):
    """(header, rows) of the success and agreement table of an evaluation."""
    header = ['policy', *[f'success @{b}' for b in budgets], *[f'agree @{b}' for b in budgets]]
    rows = [['expert', *[f"{table['expert']['success']:.3f}"] * len(budgets),
             *['-'] * len(budgets)]]
    for p in policies:
        rows.append([p, *[f"{table[f'{p}@{b}']['success']:.3f}" for b in budgets],
                     *[f"{table[f'{p}@{b}']['agreement']:.3f}" for b in budgets]])
    return header, rows


def print_table(header, rows):
    """Print rows aligned in columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print('  '.join(str(c).rjust(w) for c, w in zip(row, widths)))


def _write_json(path, table, complete, backend='numpy', settings=None):
    """Write the table and whether every episode of the run is in it.

    Beside them the policy's backend and what else decides an episode (model, adapter,
    parameter file, delay, formats): runs over other seeds with the same settings can be
    merged (``--merge``).
    """
    full = {p: table.get(f'{p}@full', {}).get('success') for p in POLICIES}
    write_atomic(path, json.dumps({'table': table, 'full': full, 'complete': complete,
                                   'backend': backend, 'settings': settings or {}}, indent=2),
                 'evaluation table')


def input_names(model, adapter, params):
    """Return the file names of what drives an episode: model, adapter, parameter file.

    Part of a run's settings, which a table (or a folder of rollout bags) records so that a
    later run goes on only with the same.
    """
    return {'model': Path(model).name, 'adapter': Path(adapter).name if adapter else '',
            'params': Path(params).name if params else ''}


def check_table(path, run):
    """Raise ValueError naming ``path`` unless ``run`` is a parsed rt-llm-eval --json table."""
    def counts(values):
        return isinstance(values, list) and all(type(v) is int for v in values)

    def row_ok(row):
        return (isinstance(row, dict) and counts(row.get('seeds')) and counts(row.get('reached'))
                and len(row['seeds']) == len(row['reached'])
                and counts([row.get('goals'), row.get('ticks')])
                and ('agreement' not in row or (type(row['agreement']) in (int, float)
                                                and counts([row.get('refusals')]))))

    table = run.get('table') if isinstance(run, dict) else None
    if not (isinstance(table, dict) and all(map(row_ok, table.values()))):
        raise ValueError(f'{path}: not an rt-llm-eval --json table')


def merge_tables(runs):
    """Return one table from evaluation JSONs over disjoint seeds of the same settings.

    ``runs``: [(path, parsed JSON)]. Each run's row counts as one episode-like part (its goals
    reached, ticks, agreeing ticks, refusals) that ``summarize`` adds up; seeds stay paired
    across rows. ValueError naming the file where settings differ, a seed is in two runs, or
    a file is not an evaluation.
    """
    first_path, first = runs[0]
    rows = {}   # row -> ({seed: goals reached}, [the part of each run])
    for path, run in runs:
        check_table(path, run)
        for key in ('settings', 'backend'):
            if run.get(key) != first.get(key):
                raise ValueError(f'{path}: {key} {run.get(key)} differ from those of '
                                 f'{first_path}: {first.get(key)}')
        for row, summary in run['table'].items():
            seeds, parts = rows.setdefault(row, ({}, []))
            overlap = set(seeds) & set(summary['seeds'])
            if overlap:
                raise ValueError(f'{path}: {row} seed {min(overlap)} is in another run too')
            seeds.update(zip(summary['seeds'], summary['reached']))
            won = sum(summary['reached'])
            part = {'results': ['reached'] * won + ['missed'] * (summary['goals'] - won),
                    'ticks': summary['ticks']}
            if 'agreement' in summary:
                part.update(agree=round(summary['agreement'] * summary['ticks']),
                            refusals=summary['refusals'])
            parts.append(part)
    return {row: dict(summarize(parts), episodes=len(seeds), seeds=sorted(seeds),
                      reached=[seeds[s] for s in sorted(seeds)])
            for row, (seeds, parts) in rows.items()}


def _earlier_run(path, backend, settings):
    """Return the table at ``path`` that a --resume run goes on from.

    ValueError where it is no evaluation table or what decides its episodes differs.
    """
    from rt_llm_node.files import read_json
    run = read_json(path, 'evaluation table')
    check_table(path, run)
    for key, now in (('backend', backend), ('settings', settings)):
        if run.get(key) != now:
            raise ValueError(f'{path}: its {key} {run.get(key)} are not those of this run '
                             f'({now}): --resume goes on only with the same; give another '
                             '--json for a new table')
    return run


def _merge_main(args):
    """--merge: print (and with --json write) the table of several runs' JSONs."""
    from rt_llm_node.files import read_json
    try:
        runs = [(path, read_json(path, 'evaluation table')) for path in args.merge]
        table = merge_tables(runs)
    except (FileError, ValueError) as exc:
        print(f'rt-llm-eval: error: {exc}', file=sys.stderr)
        return 2
    incomplete = [path for path, run in runs if not run.get('complete')]
    if incomplete:
        print(f'rt-llm-eval: warning: {", ".join(incomplete)} did not finish: its rows may '
              'hold different seeds', file=sys.stderr)
    rows = [r.split('@') for r in table if r != 'expert']
    policies = list(dict.fromkeys(p for p, _ in rows))
    budgets = list(dict.fromkeys(b if b == 'full' else int(b) for _, b in rows))
    if any(f'{p}@{b}' not in table for p in policies for b in budgets):
        print('rt-llm-eval: error: the runs do not hold every policy at every budget',
              file=sys.stderr)
        return 2
    header, lines = table_rows(table, budgets, policies)
    print_table(header, lines)
    episodes = sorted({t['episodes'] for t in table.values()})
    print(f'{"/".join(map(str, episodes))} held-out episodes per row from {len(runs)} runs, '
          f'{runs[0][1].get("backend")} backend')
    if args.json:
        _write_json(args.json, table, complete=not incomplete,
                    backend=runs[0][1].get('backend'), settings=runs[0][1].get('settings'))
    return 0


def plot(table, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [str(b) for b in BUDGETS]
    for policy in POLICIES:
        ys = [table[f'{policy}@{b}']['success'] for b in BUDGETS if f'{policy}@{b}' in table]
        ax.plot(labels[:len(ys)], ys, marker='o', label=policy)
    if 'expert' in table:
        ax.axhline(table['expert']['success'], color='k', ls='--', lw=1, label='expert')
    ax.set_xlabel('KV cache budget (tokens)')
    ax.set_ylabel('goal success rate')
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title('demo policy in closed loop, held-out seeds')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(prog='rt-llm-eval', description=__doc__.split('\n')[0])
    parser.add_argument('--model', default=None, help='checkpoint (default: embedded)')
    parser.add_argument('--episodes', type=int, default=200)
    parser.add_argument('--first-seed', type=int, default=HELD_OUT_SEED0,
                        help=f'first held-out seed (default {HELD_OUT_SEED0}; a run over '
                             'more seeds can go on where an earlier one stopped)')
    parser.add_argument('--policies', default=','.join(POLICIES))
    parser.add_argument('--budgets', default=','.join(str(b) for b in BUDGETS))
    parser.add_argument('--workers', type=int, default=os.cpu_count())
    parser.add_argument('--threads', type=int, default=1,
                        help='episodes each worker runs at once, a thread and a backend each '
                             '(default 1). On the GPU each has its own CUDA stream in the '
                             "worker's context, so their kernels overlap; workers' contexts "
                             'only take turns')
    parser.add_argument('--action-delay', type=int, default=0, metavar='TICKS',
                        help='ticks from an observation to its command reaching the robot '
                             '(0: the next step, as in training)')
    parser.add_argument('--backend', default='numpy', choices=('numpy', 'cuda'),
                        help="the policy's backend (default numpy, the reference the results "
                             'use). cuda: every worker process runs its own CUDA backend on '
                             'the one GPU, the workers started fresh (spawn), not forked; '
                             'float sums in another order can turn a near tie the other way, '
                             'so an episode may differ from the numpy one. Not faster with '
                             'many workers: one GPU serves them one launch at a time')
    parser.add_argument('--adapter', default='',
                        help='LoRA adapter folder (PEFT) merged into the model on load')
    parser.add_argument('--params', default='',
                        help='a node parameter file whose inputs, action grammar and system '
                             'prompt the policy reads (e.g. config/demo_smollm2.yaml); '
                             "default: the shipped policy's")
    parser.add_argument('--weight-format', default='native', choices=tuple(WEIGHT_FORMATS),
                        help="the policy's weights: native, or int8/int4 quantized on load")
    parser.add_argument('--kv-dtype', default='native', choices=KV_DTYPES,
                        help='the KV cache: native (fp32) or int8')
    parser.add_argument('--json', default=None, help='write the full table as JSON here')
    parser.add_argument('--plot', default=None, help='write the PNG here')
    parser.add_argument('--resume', action='store_true',
                        help='go on from the --json table of an earlier run with the same '
                             'settings (one cut short, or over fewer seeds or rows): its '
                             'episodes are kept and only the others run')
    parser.add_argument('--merge', nargs='+', metavar='JSON',
                        help='instead of running: the table of earlier runs over other seeds '
                             '(their --json files, the same settings), with --json written')
    args = parser.parse_args(argv)
    if args.merge:
        return _merge_main(args)
    if args.resume and not args.json:
        parser.error('--resume goes on from the table of --json: give its path')
    if args.action_delay < 0:
        parser.error('--action-delay must be >= 0')
    if args.threads < 1 or args.workers < 1:
        parser.error('--workers and --threads must be at least 1')
    if args.first_seed < HELD_OUT_SEED0:
        parser.error(f'--first-seed must be >= {HELD_OUT_SEED0}: lower seeds are training '
                     'seeds')
    if args.backend == 'cuda':
        from rt_llm_node.backends import cuda_available
        from rt_llm_node.backends import cuda_backend_class
        if cuda_backend_class() is None or not cuda_available():
            parser.error('--backend cuda needs CuPy and a CUDA device; none was found')
    if args.episodes < 1:
        parser.error('--episodes must be at least 1')
    try:
        budgets = [b if b == 'full' else int(b) for b in args.budgets.split(',')]
        if not all(b == 'full' or b > 0 for b in budgets):
            raise ValueError
    except ValueError:
        parser.error(f"--budgets: token counts or 'full', not {args.budgets!r}")
    policies = [p for p in args.policies.split(',') if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f'--policies: {unknown[0]!r} is not one of {", ".join(POLICIES)}')
    model = str(args.model or default_model_path())
    seeds = list(range(args.first_seed, args.first_seed + args.episodes))
    configs = [('expert', None)] + [(p, b) for p in policies for b in budgets]
    # one job per episode, so the pool stays balanced whatever the mix of fast (expert,
    # small cache) and slow episodes; each result is printed (and the JSON rewritten) as
    # it arrives, so a run cut short still leaves what it finished
    # (seed-major: a cut run has the same seeds for every row)
    jobs = {}
    for seed in seeds:
        for policy, budget in configs:
            owner = 'expert' if policy == 'expert' else f'{policy}@{budget}'
            jobs[(model, policy, budget, seed, args.action_delay, args.backend,
                  args.weight_format, args.kv_dtype, args.adapter, args.params)] = owner
    settings = dict(input_names(model, args.adapter, args.params),
                    action_delay=args.action_delay, weight_format=args.weight_format,
                    kv_dtype=args.kv_dtype)
    earlier = None
    if args.resume and Path(args.json).exists():
        try:
            earlier = _earlier_run(args.json, args.backend, settings)
        except (FileError, ValueError) as exc:
            print(f'rt-llm-eval: error: {exc}', file=sys.stderr)
            return 2
        kept = {(row, seed) for row, summary in earlier['table'].items()
                for seed in summary['seeds']}
        jobs = {job: owner for job, owner in jobs.items() if (owner, job[3]) not in kept}
        print(f'{args.json}: {len(kept)} episodes kept, {len(jobs)} to run', flush=True)

    def table_now():
        table = summarize_rows(gathered)
        if earlier is None:
            return table
        return merge_tables([(args.json, earlier), ('this run', {
            'table': table, 'backend': args.backend, 'settings': settings})])

    started = time.time()
    gathered = {}
    try:
        for done, (job, episode) in enumerate(run_episodes(jobs, args.workers, args.threads,
                                                           args.backend), 1):
            gathered.setdefault(jobs[job], {})[job[3]] = episode
            reached = sum(r == 'reached' for r in episode['results'])
            print(f'[{done}/{len(jobs)}] {jobs[job]} seed {job[3]}: {reached} of '
                  f"{len(episode['results'])} goals, {time.time() - started:.0f} s",
                  flush=True)
            if args.json and done < len(jobs):
                _write_json(args.json, table_now(), complete=False, backend=args.backend,
                            settings=settings)
    except EPISODE_ERRORS as exc:
        print(f'rt-llm-eval: error: {exc}', file=sys.stderr)
        return 2
    table = table_now()
    elapsed = time.time() - started
    header, rows = table_rows(table, budgets, policies)
    print_table(header, rows)
    episodes = '/'.join(map(str, sorted({table[row]['episodes'] for row in table})))
    print(f'{episodes} held-out episodes per row, action delay {args.action_delay} '
          f'ticks, {args.backend} backend, weights {args.weight_format}, KV cache '
          f'{args.kv_dtype}, {elapsed:.0f} s')
    if args.json:
        _write_json(args.json, table, complete=True, backend=args.backend, settings=settings)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(table, args.plot)
    return 0


if __name__ == '__main__':
    sys.exit(main())
