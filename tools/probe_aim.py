"""Does an aiming policy find the target, or copy the aim of the tick before? Hand-made contexts.

    python tools/probe_aim.py --model M [--episodes 2] [--history 8] [--every 37]

For a checkpoint trained with ``--aim`` (tools/train_demo_policy.py): clean expert
episodes on held-out seeds, rendered as training renders them; at every ``--every``-th
tick (``--history`` or more ticks into a goal) the model greedy-decodes its stated aim
after the system prompt, the instruction, the newest ``--history`` ticks (observations
and the actions the context shows) and the tick's observation, three ways:

  true     the past actions show the expert's aims (what training without --aim-noise
           shows, and what a policy that is always right would have said)
  shifted  the same, each shown aim moved 90 degrees (what a policy that was wrong said)
  none     no past ticks at all: the lookup alone

A policy that finds the target scores about the same in all three; one that copies the
aim of the tick before scores high on 'true' and near 0 on 'shifted'. Stop 23's aiming
model: 1.00 / 0.00 / 0.93 (BENCHMARKS.md): it can find the target but copies.
"""

import argparse

import numpy as np

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.demo.episodes import expert_episode
from rt_llm_node.demo.episodes import system_ids
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import AIM_FIELD
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.model import load_checkpoint

WAYS = ('true', 'shifted', 'none')


def stated_aim(backend, grammar, ids):
    """The aim greedy-decoded after ``ids`` and the action prefix."""
    backend.rollback(0)
    backend.prefill(list(ids) + list(grammar.prefix_ids))
    state = grammar.start()
    state = grammar.advance(state, backend.argmax(grammar.allowed(state)))
    return state[2][0]


def shifted(tokenizer, grammar, ids):
    """An action's ids with its aim moved 90 degrees (kept in range), v and w as they were."""
    field = grammar.field(AIM_FIELD['name'])
    words = tokenizer.decode(ids).split()
    aim = float(words[1][len(field.key):])
    words[1] = field.text(field.quantize(aim + 90.0 if aim < 90.0 else aim - 90.0))
    return tokenizer.encode(' '.join(words) + '\n').ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True)
    parser.add_argument('--episodes', type=int, default=2)
    parser.add_argument('--first-seed', type=int, default=HELD_OUT_SEED0)
    parser.add_argument('--history', type=int, default=8)
    parser.add_argument('--every', type=int, default=37)
    args = parser.parse_args()
    if not model_aim(args.model):
        parser.error(f'{args.model} does not state an aim (its training.json has no "aim")')
    checkpoint = load_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    grammar = action_grammar(tokenizer, aim=True)
    field = grammar.field(AIM_FIELD['name'])
    backend = NumpyBackend(checkpoint, checkpoint.config.max_position_embeddings)
    system = system_ids(tokenizer)
    scores = {way: [] for way in WAYS}
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        episode = expert_episode(seed, tokenizer, aim=True, inputs=model_inputs(args.model))
        ticks = episode.ticks
        starts = [i for i, t in enumerate(ticks)
                  if any(kind == 'instruction' for kind, _, _ in t.segments)]

        def observation(i):
            return [x for kind, _, ids in ticks[i].segments if kind != 'instruction'
                    for x in ids]
        for t in range(args.history, len(ticks), args.every):
            start = max(s for s in starts if s <= t)
            if t - start < args.history:
                continue
            instruction = next(ids for kind, _, ids in ticks[start].segments
                               if kind == 'instruction')
            label = field.quantize(float(
                tokenizer.decode(ticks[t].action_ids).split()[1][len(field.key):]))
            for way in WAYS:
                ids = list(system) + list(instruction)
                for i in range(t - (0 if way == 'none' else args.history), t):
                    shown = ticks[i].executed_ids
                    ids += observation(i) + (shifted(tokenizer, grammar, shown)
                                             if way == 'shifted' else list(shown))
                ids += observation(t)
                scores[way].append((stated_aim(backend, grammar, ids), label))
    print(f"{'past aims shown':16s} {'ticks':>6s} {'exact':>6s} {'within 15':>9s}")
    for way in WAYS:
        got = np.array(scores[way])
        n = len(got)
        exact = np.mean(got[:, 0] == got[:, 1]) if n else float('nan')
        near = np.mean(np.abs(got[:, 0] - got[:, 1]) <= field.step) if n else float('nan')
        print(f'{way:16s} {n:6d} {exact:6.2f} {near:9.2f}')


if __name__ == '__main__':
    main()
