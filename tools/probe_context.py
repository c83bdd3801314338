"""Which part of the context makes a demo policy's decision: hand-made contexts, one action each.

    python tools/probe_context.py --seed 1000006 --ticks 48,376,504 [--model M] [--takeover]

The policy drives the seed (meaning eviction, full cache) up to the last tick asked; the
episode is then rendered again from what it executed (as DAgger data is). At each tick the
model greedy-decodes one action from: the system prompt, the instruction in force, the
newest K action segments (K = all that fit in 200, 20, 1, 0) and the tick's observation;
and once more with /odom's v and w set to 0.0 (when the model reads /odom). ``--takeover``
also hands the robot to the expert at each tick and reports whether it reaches the goal.
BENCHMARKS.md ("Why the shipped policy fails", stop 20) has what this showed.
"""

import argparse
import re

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.codec import scan_sectors
from rt_llm_node.demo.episodes import expert_episode
from rt_llm_node.demo.episodes import SCAN_SECTORS
from rt_llm_node.demo.episodes import system_ids
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.expert import expert_command
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path

ODOM_TWIST = re.compile(r'v -?[\d.]+ w -?[\d.]+')


def decode_values(backend, grammar, ids):
    """Greedy constrained action after ``ids`` + the action prefix: {field: value}."""
    backend.rollback(0)
    backend.prefill(list(ids) + list(grammar.prefix_ids))
    state = grammar.start()
    while not grammar.done(state):
        token = backend.argmax(grammar.allowed(state))
        state = grammar.advance(state, token)
        if not grammar.done(state):
            backend.decode(token)
    return grammar.action(state).values


def decode(backend, grammar, ids):
    """Greedy constrained action after ``ids`` + the action prefix: (v, w)."""
    values = decode_values(backend, grammar, ids)
    return values['linear.x'], values['angular.z']


def takeover(seed, executed, tick, grammar):
    """The expert drives from ``tick`` of the policy's trajectory: (result, ticks it took)."""
    world = DemoWorld(seed, messages=MessageFactory(ros=False))
    instruction, last_w = '', 0.0
    for t in range(tick):
        msgs = world.observe()
        instruction = msgs['/instruction'].data if '/instruction' in msgs else instruction
        last_w = executed[t][1]
        world.step(*executed[t])
    goals, start = len(world.results), world.tick
    while not world.done and len(world.results) == goals:
        msgs = world.observe()
        instruction = msgs['/instruction'].data if '/instruction' in msgs else instruction
        v, w = expert_command(instruction, scan_sectors(msgs['/scan'], SCAN_SECTORS),
                              msgs['/detections'].data, last_w)
        v, last_w = grammar.field('linear.x').quantize(v), grammar.field('angular.z').quantize(w)
        world.step(v, last_w)
    return (world.results[goals] if len(world.results) > goals else 'episode over',
            world.tick - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', default=default_model_path())
    parser.add_argument('--seed', type=int, default=1_000_006)
    parser.add_argument('--ticks', default='48,376,504')
    parser.add_argument('--takeover', action='store_true')
    args = parser.parse_args()
    ticks = sorted(int(t) for t in args.ticks.split(','))
    checkpoint = load_checkpoint(args.model)
    tokenizer, inputs = checkpoint.tokenizer, model_inputs(args.model)
    aim = model_aim(args.model)
    grammar = action_grammar(tokenizer, aim)
    run = run_model_episode(checkpoint, args.seed, 'meaning',
                            checkpoint.config.max_position_embeddings,
                            max_ticks=ticks[-1] + 1, inputs=inputs, aim=aim)
    episode = expert_episode(args.seed, tokenizer, executed=run['executed'], inputs=inputs,
                             aim=aim)
    backend = NumpyBackend(checkpoint, checkpoint.config.max_position_embeddings)
    system = system_ids(tokenizer)
    for tick in ticks:
        if tick >= len(episode.ticks):
            print(f'tick {tick}: the episode ended at {len(episode.ticks)}')
            continue
        instruction = next(ids for t in range(tick, -1, -1)
                           for kind, _, ids in episode.ticks[t].segments
                           if kind == 'instruction')
        observation = [i for kind, _, ids in episode.ticks[tick].segments
                       if kind != 'instruction' for i in ids]
        history = [episode.ticks[t].executed_ids for t in range(max(0, tick - 200), tick)]
        text = tokenizer.decode(observation)
        print(f"tick {tick}: {' | '.join(text.strip().splitlines())}")
        label = tokenizer.decode(episode.ticks[tick].action_ids).strip()
        print(f"  expert {label}, policy in the loop {run['executed'][tick]}")
        for k in (len(history), 20, 1, 0):
            actions = [i for ids in history[len(history) - k:] for i in ids] if k else []
            context = system + instruction + actions + observation
            print(f'  {k:3d} actions: {decode(backend, grammar, context)}')
        if ODOM_TWIST.search(text):
            zeroed = tokenizer.encode(ODOM_TWIST.sub('v 0.0 w 0.0', text)).ids
            print(f'  /odom v, w zeroed, no actions: '
                  f'{decode(backend, grammar, system + instruction + zeroed)}')
        if args.takeover:
            result, took = takeover(args.seed, run['executed'], tick, grammar)
            print(f'  the expert from here: {result} after {took} ticks')
    return 0


if __name__ == '__main__':
    main()
