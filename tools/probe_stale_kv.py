"""Is a closed-loop miss the context's content or its cached keys and values? (aiming policies)

    python tools/probe_stale_kv.py --policy recency --capacity 1024 --seed 1000000 \
        [--ticks 400] [--every 3] [--model M]
    python tools/probe_stale_kv.py --policy recency --capacity 1024 --closed-loop 1000000,1000001

The policy drives the seed through the tick engine (the evaluation's closed loop). Before each
tick's prefill the probe copies the cache's token ids and their segments. Afterwards, at every
``--every``-th tick from 40 on where the instructed object is in view, the stated aim (the
'_aim' plan field) is decoded again on a fresh backend from the very same tokens, prefilled
from scratch at positions 0.. (no eviction history), and from two thinned copies of them: the
cached observations all dropped (the instruction, the actions and this tick's observation
stay) and only the newest 8 ticks' observations kept. Each is scored against the expert's aim
(``expert_aim``, the training label). If the fresh prefill of the same tokens is right where
the engine was wrong, the miss comes from the cached keys and values of layers 1 and up, which
were computed beside tokens that have since been evicted (compaction re-rotates positions
exactly, see test_rerotation.py, but cannot undo what a token attended to): the contexts of
training are always computed fresh.

``--closed-loop SEEDS``: whole episodes instead, each seed twice: as the engine runs it, and
with the kept tokens prefilled afresh after every compaction (``Context.apply_plan``
patched here, an experiment; the package compacts only).
"""

import argparse

import numpy as np

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.context import Context
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.expert import expert_aim
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.kvcache import OBSERVATION
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path

UNSEEN = 180.0   # expert_aim's value when the instructed object is out of sight


def record_prefills(engine, snaps):
    """Wrap the engine's prefill so each tick's context is copied into ``snaps`` first."""
    context = engine.context
    append = context.append_segments

    def wrapped(parts):
        cache = context.cache
        owner = cache.owner[:cache.length].tolist()
        snaps.append({
            'ids': cache.token_ids[:cache.length].copy(),
            'kinds': np.array([cache.segments[u].kind for u in owner]),
            'stamps': np.array([cache.segments[u].stamp for u in owner]),
            'new': (list(context.pending[1]) if context.pending else [])
            + [t for ids, *_ in parts for t in ids],
        })
        return append(parts)

    context.append_segments = wrapped


def stated_aim(backend, grammar, ids):
    """Prefill ``ids`` (ending in the action prefix) from position 0; the greedy '_aim'."""
    backend.rollback(0)
    backend.prefill(list(ids))
    state = grammar.start()
    while True:
        token = backend.argmax(grammar.allowed(state))
        state = grammar.advance(state, token)
        if grammar.done(state):
            return grammar.action(state).values['_aim']
        backend.decode(token)


def refreshing_apply_plan(apply_plan):
    """``Context.apply_plan`` that re-encodes the kept tokens from scratch after compacting."""
    def wrapped(self, slots):
        evicted = apply_plan(self, slots)
        if slots is not None:
            self.backend.rollback(0)
            if self.cache.length:
                self.backend.prefill(self.cache.token_ids[:self.cache.length].copy())
        return evicted
    return wrapped


def closed_loop(args, checkpoint):
    """Goals reached per seed with the engine's compaction and with a fresh re-encoding."""
    print(f'| seed | {args.policy} @{args.capacity}, compacted (as shipped) | re-encoded after '
          'each compaction |\n|---|---|---|')
    plain = Context.apply_plan
    for seed in (int(s) for s in args.closed_loop.split(',')):
        cells = []
        for patched in (plain, refreshing_apply_plan(plain)):
            Context.apply_plan = patched
            try:
                run = run_model_episode(checkpoint, seed, args.policy, args.capacity,
                                        inputs=model_inputs(args.model), aim=True)
            finally:
                Context.apply_plan = plain
            cells.append(f"{run['results'].count('reached')} of {len(run['results'])} goals, "
                         f"{run['ticks']} ticks")
        print(f'| {seed} | {cells[0]} | {cells[1]} |', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', default=default_model_path())
    parser.add_argument('--policy', default='recency')
    parser.add_argument('--capacity', type=int, default=1024)
    parser.add_argument('--seed', type=int, default=1_000_000)
    parser.add_argument('--ticks', type=int, default=400)
    parser.add_argument('--every', type=int, default=3)
    parser.add_argument('--closed-loop', default=None, metavar='SEEDS',
                        help='comma-separated seeds: whole episodes, compacted and re-encoded')
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    if not model_aim(args.model):
        raise SystemExit(f'{args.model} states no aim (no _aim plan field)')
    if args.closed_loop:
        closed_loop(args, checkpoint)
        return 0
    grammar = action_grammar(checkpoint.tokenizer, True)
    fa = grammar.field('_aim')
    snaps, ticks = [], []

    def observe(msgs, instruction, sectors, expert, model, action):
        ticks.append((fa.quantize(expert_aim(instruction, msgs['/detections'].data)),
                      None if action is None else action.values['_aim']))

    run = run_model_episode(checkpoint, args.seed, args.policy, args.capacity,
                            max_ticks=args.ticks, observe=observe,
                            inputs=model_inputs(args.model), aim=True,
                            on_engine=lambda engine: record_prefills(engine, snaps))
    if len(snaps) != len(ticks):
        raise SystemExit(f'{len(snaps)} prefills for {len(ticks)} ticks: a tick was refused')
    backend = NumpyBackend(checkpoint, checkpoint.config.max_position_embeddings)
    rows = {'engine (as run)': [], 'fresh prefill, same tokens': [],
            'fresh, cached observations dropped': [], 'fresh, newest 8 ticks of observations': []}
    for t in range(40, len(ticks), args.every):
        label, engine_aim = ticks[t]
        if label == UNSEEN or engine_aim is None:
            continue
        s = snaps[t]
        old_obs = s['kinds'] == OBSERVATION
        newest = sorted(set(s['stamps'][old_obs].tolist()))[-8:]
        contexts = (s['ids'], s['ids'][~old_obs],
                    s['ids'][~old_obs | np.isin(s['stamps'], newest)])
        aims = [engine_aim] + [stated_aim(backend, grammar, list(c) + s['new'])
                               for c in contexts]
        for row, aim in zip(rows.values(), aims):
            row.append(aim == label)
    scored = len(rows['engine (as run)'])
    print(f'{args.policy} at {args.capacity} tokens, seed {args.seed}, {len(ticks)} ticks, '
          f"goals {run['results']}; ticks scored (target in view, every {args.every} from 40): "
          f'{scored}')
    print('| context | stated aim = expert aim |\n|---|---|')
    for name, hits in rows.items():
        print(f'| {name} | {np.mean(hits):.2f} |')
    return 0


if __name__ == '__main__':
    main()
