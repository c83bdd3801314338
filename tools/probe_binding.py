"""Does an aiming policy find the object it was told, or the one ahead? Closed-loop contexts.

    python tools/probe_binding.py --model M [--episodes 2] [--capacity 1024] [--every 2]

The policy (a checkpoint trained with ``--aim``) drives held-out seeds under meaning
eviction. At every ``--every``-th tick where the instructed object is 30 degrees or more off
the heading with another object within 15 degrees of it (the state where the shipped
policies steer at the wrong object), the context the engine held before the tick's action
is decoded again, changed one way at a time:

  as is            the context unchanged (reproduces the aim stated in the loop)
  target only      the newest detections list the instructed object alone
  target first     the newest detections list it first (the world lists nearest first)
  newest tick      the instruction and the newest observation only, no history
  past aims right  every aim the context shows replaced by this tick's right one

Score: the stated aim equals the expert's (exactly). A policy that binds the instruction
scores about the same on 'as is' and 'target only'; one that steers at what is ahead gains
from 'target only' and not from 'newest tick' (BENCHMARKS.md, stop 24).
"""

import argparse

from probe_context import decode_values   # tools/, beside this script

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.codec import ObservationCodec
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.expert import distractor_ahead
from rt_llm_node.demo.expert import expert_aim
from rt_llm_node.demo.expert import parse_detections
from rt_llm_node.demo.expert import parse_instruction
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import AIM_FIELD
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.demo.world import detections_line
from rt_llm_node.model import load_checkpoint

WAYS = ('as is', 'target only', 'target first', 'newest tick', 'past aims right')


def find_last(seq, sub):
    """Start of the last occurrence of ``sub`` in ``seq``, or -1."""
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


class Variants:
    """Builds the changed contexts of one checkpoint."""

    def __init__(self, checkpoint, inputs, grammar):
        self.tokenizer = checkpoint.tokenizer
        self.codec = ObservationCodec(self.tokenizer, inputs)
        self.messages = MessageFactory(ros=False)
        self.prefix = list(grammar.prefix_ids)
        self.aim = grammar.field(AIM_FIELD['name'])
        self.aim_ids = {self._word(v) for v in self.aim.values}

    def _word(self, value):
        ids = self.tokenizer.encode(' ' + self.aim.text(value)).ids
        assert len(ids) == 1, 'an aim word must be one token (whole_words)'
        return ids[0]

    def _detections(self, text):
        return list(self.codec.encode('/detections', self.messages.string(text)))

    def build(self, ids, instruction, detections, label):
        """{way: context ids or None (not applicable)} from the cache ``ids`` holding this
        tick's action last."""
        action = find_last(ids, self.prefix)
        context = ids[:action]
        newest = self._detections(detections)
        at = find_last(context, newest)
        target = parse_instruction(instruction)
        found = parse_detections(detections)
        mine = [d for d in found if d[:2] == target]
        others = [d for d in found if d[:2] != target]

        def swap(found_now):
            if at < 0:
                return None
            return context[:at] + self._detections(detections_line(found_now)) + \
                context[at + len(newest):]
        task = list(self.codec.encode('/instruction', self.messages.string(instruction)))
        previous = find_last(context, self.prefix)   # the newest tick starts after its action
        tick_start = -1 if previous < 0 else context.index(
            self.tokenizer.encode('\n').ids[0], previous) + 1
        start = find_last(context, task)
        right = self._word(label)
        return {
            'as is': context,
            'target only': swap(mine),
            'target first': swap(mine + others),
            'newest tick': (context[:start + len(task)] + context[tick_start:]
                            if start >= 0 and tick_start > start else None),
            'past aims right': [right if x in self.aim_ids else x for x in context],
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True)
    parser.add_argument('--episodes', type=int, default=2)
    parser.add_argument('--first-seed', type=int, default=HELD_OUT_SEED0)
    parser.add_argument('--capacity', type=int, default=1024)
    parser.add_argument('--every', type=int, default=2)
    parser.add_argument('--max-ticks', type=int, default=1500)
    args = parser.parse_args()
    if not model_aim(args.model):
        parser.error(f'{args.model} does not state an aim (its training.json has no "aim")')
    checkpoint = load_checkpoint(args.model)
    inputs = model_inputs(args.model)
    grammar = action_grammar(checkpoint.tokenizer, aim=True)
    variants = Variants(checkpoint, inputs, grammar)
    probe = NumpyBackend(checkpoint, args.capacity)
    scores = {way: [0, 0] for way in ('in the loop',) + WAYS}
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        held = {'tick': 0}

        def observe(msgs, instruction, sectors, expert, model, action):
            held['tick'] += 1
            detections = msgs['/detections'].data
            if action is None or held['tick'] % args.every or \
                    not distractor_ahead(instruction, detections):
                return
            label = variants.aim.quantize(expert_aim(instruction, detections))
            cache = held['engine'].context.cache
            ids = [int(x) for x in cache.token_ids[:cache.length]]
            scores['in the loop'][0] += 1
            scores['in the loop'][1] += action.values['_aim'] == label
            for way, context in variants.build(ids, instruction, detections, label).items():
                if context is None or len(context) + len(variants.prefix) + 4 > args.capacity:
                    continue
                scores[way][0] += 1
                scores[way][1] += decode_values(probe, grammar, context)['_aim'] == label
        result = run_model_episode(checkpoint, seed, 'meaning', args.capacity,
                                   max_ticks=args.max_ticks, observe=observe, inputs=inputs,
                                   aim=True, on_engine=lambda e: held.update(engine=e))
        print(f'seed {seed}: {", ".join(result["results"]) or "-"} in {result["ticks"]} ticks',
              flush=True)
    print(f'{"context at ticks with another object ahead":44s} {"ticks":>6s} {"aim exact":>9s}')
    for way, (n, right) in scores.items():
        print(f'{way:44s} {n:6d} {right / max(1, n):9.2f}')


if __name__ == '__main__':
    main()
