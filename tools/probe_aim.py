"""Does a policy find its answer, or copy the one of the tick before? Hand-made contexts.

    python tools/probe_aim.py --model M [--field aim|w] [--episodes 2] [--history 8]

``--field aim`` (default; a checkpoint trained with ``--aim``): the stated aim; ``--field w``
(any checkpoint): the turn rate. Clean expert episodes on held-out seeds, rendered as
training renders them; at every ``--every``-th tick (``--history`` or more ticks into a
goal) the model greedy-decodes an action after the system prompt, the instruction, the
newest ``--history`` ticks (observations and the actions the context shows) and the tick's
observation, three ways:

  true     the past actions show the expert's values (what training without noise shows,
           and what a policy that is always right would have said)
  shifted  the same, the field moved (aim 90 degrees, w 0.75 rad/s) in every past action
  none     no past ticks at all

Scores: the field equals the expert's label (exactly, within one step), and equals the
value the newest past action shows (copies). A policy that finds its answer scores about
the same in all three; one that copies scores high on 'true', near 0 on 'shifted', and
copies there. Stop 23's aiming model: aim exact 1.00 / 0.00 / 0.85 (BENCHMARKS.md).
"""

import argparse

from probe_context import decode_values   # tools/, beside this script

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
FIELDS = {'aim': (AIM_FIELD['name'], 90.0), 'w': ('angular.z', 0.75)}   # name, shift


def value_of(tokenizer, field, word_index, ids):
    """The value of ``field`` in an action's ids (its word ``word_index``, after 'act')."""
    return float(tokenizer.decode(ids).split()[word_index][len(field.key):])


def shifted(tokenizer, field, word_index, shift, ids):
    """An action's ids with ``field`` moved by ``shift`` (the other way near the top)."""
    words = tokenizer.decode(ids).split()
    value = float(words[word_index][len(field.key):])
    top = field.values[-1]
    words[word_index] = field.text(field.quantize(value + shift if value + shift <= top
                                                  else value - shift))
    return tokenizer.encode(' '.join(words) + '\n').ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True)
    parser.add_argument('--field', choices=sorted(FIELDS), default='aim')
    parser.add_argument('--episodes', type=int, default=2)
    parser.add_argument('--first-seed', type=int, default=HELD_OUT_SEED0)
    parser.add_argument('--history', type=int, default=8)
    parser.add_argument('--every', type=int, default=37)
    args = parser.parse_args()
    aim = model_aim(args.model)
    if args.field == 'aim' and not aim:
        parser.error(f'{args.model} does not state an aim (its training.json has no "aim")')
    checkpoint = load_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    grammar = action_grammar(tokenizer, aim=aim)
    name, shift = FIELDS[args.field]
    field = grammar.field(name)
    word = 1 + [f.name for f in grammar.fields].index(name)   # its word, after 'act'
    backend = NumpyBackend(checkpoint, checkpoint.config.max_position_embeddings)
    system = system_ids(tokenizer)
    scores = {way: [] for way in WAYS}   # (decoded, label, newest shown or None)
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        episode = expert_episode(seed, tokenizer, aim=aim, inputs=model_inputs(args.model))
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
            label = field.quantize(value_of(tokenizer, field, word, ticks[t].action_ids))
            for way in WAYS:
                ids = list(system) + list(instruction)
                newest = None
                for i in range(t - (0 if way == 'none' else args.history), t):
                    shown = list(ticks[i].executed_ids)
                    if way == 'shifted':
                        shown = shifted(tokenizer, field, word, shift, shown)
                    newest = value_of(tokenizer, field, word, shown)
                    ids += observation(i) + shown
                ids += observation(t)
                scores[way].append((decode_values(backend, grammar, ids)[name], label,
                                    newest))
    print(f'{args.field}: {"past values shown":18s} {"ticks":>6s} {"exact":>6s} '
          f'{"within a step":>13s} {"copies the newest shown":>23s}')
    for way in WAYS:
        got = scores[way]
        n = max(1, len(got))
        exact = sum(d == lab for d, lab, _ in got) / n
        near = sum(abs(d - lab) <= field.step + 1e-9 for d, lab, _ in got) / n
        copies = ('-' if way == 'none' else
                  f'{sum(d == shown for d, _, shown in got) / n:.2f}')
        print(f'{args.field}: {way:18s} {len(got):6d} {exact:6.2f} {near:13.2f} {copies:>23s}')


if __name__ == '__main__':
    main()
