"""Where the demo policy goes wrong: closed-loop episodes, each tick classified.

    python tools/diagnose_policy.py [--model DIR] [--episodes 4] [--capacity 1024]

Per episode: goals reached or timed out, ticks, collisions; by situation (target in
the detections or not, 30 degrees or more off the heading or not, another object within
15 degrees of the heading or not; an obstacle within 1 m ahead or not), how often the
model's (v, w) matched the expert's on the same observation, the mean |error| of each,
and with the target off to one side how often each turned toward it.
A policy that fails while searching needs other data than one that fails on the
approach; one that disagrees with the expert on the expert's own states
(``--driver expert``) is underfit, one that agrees there but not on its own states
(``--driver model``) meets states its data lacked (DAgger's case).
"""

import argparse
from collections import defaultdict
import math

from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.expert import distractor_ahead
from rt_llm_node.demo.expert import target_detection
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path


def target_bearing(instruction, detections):
    """Bearing (deg) of the instructed object in the detections line, or None."""
    seen = target_detection(instruction, detections)
    return None if seen is None else seen[2]


def situation(instruction, sectors, detections, bearing):
    """The tick's row; ``bearing``: target_bearing of the same instruction and detections."""
    n = len(sectors)
    ahead = min(sectors[s] for s in (n - 1, 0, 1) if not math.isnan(sectors[s]))
    near = ', obstacle ahead' if ahead < 1.0 else ''
    if bearing is None:
        return 'searching' + near
    if abs(bearing) >= OFF_AXIS_DEG:
        # another object near the heading while the target is off to one side: what a
        # policy that binds colour or shape alone, not both, drives toward
        other = distractor_ahead(instruction, detections, OFF_AXIS_DEG, AHEAD_DEG)
        return 'target off-axis' + (', other object ahead' if other else '') + near
    return 'target seen' + near


OFF_AXIS_DEG = 30
AHEAD_DEG = 15
STATS = 8   # ticks, agree, |dv|, |dw|, model repeats w, expert repeats w, turns to target x2


def episode(checkpoint, seed, capacity, policy, driver='model', inputs=INPUTS, aim=False):
    """(result of run_model_episode, {situation: [ticks, agree, |dv|, |dw|, model repeats
    the executed w, expert's label does, model turns toward the target, expert does]})."""
    stats = defaultdict(lambda: [0] * STATS)
    last = [None]   # the w executed the tick before

    def observe(msgs, instruction, sectors, expert, model):
        v, w = model or (0.0, 0.0)
        ev, ew = expert
        detections = msgs['/detections'].data
        bearing = target_bearing(instruction, detections)
        s = stats[situation(instruction, sectors, detections, bearing)]
        s[0] += 1
        s[1] += (v, w) == (ev, ew)
        s[2] += abs(v - ev)
        s[3] += abs(w - ew)
        s[4] += w == last[0]
        s[5] += ew == last[0]
        if bearing is not None and abs(bearing) >= OFF_AXIS_DEG:
            side = math.copysign(1.0, bearing)
            s[6] += w * side >= 0.5
            s[7] += ew * side >= 0.5
        last[0] = w if driver == 'model' else ew

    result = run_model_episode(checkpoint, seed, policy, capacity, observe=observe,
                               expert_drives=driver == 'expert', inputs=inputs, aim=aim)
    return result, stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', default=default_model_path())
    parser.add_argument('--episodes', type=int, default=4)
    parser.add_argument('--first-seed', type=int, default=HELD_OUT_SEED0)
    parser.add_argument('--capacity', type=int, default=1024)
    parser.add_argument('--policy', default='meaning')
    parser.add_argument('--driver', choices=('model', 'expert'), default='model',
                        help="who drives the robot: 'expert' scores the model on the expert's "
                             "own states (fit), 'model' on the states it reaches itself")
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    total = defaultdict(lambda: [0] * STATS)
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        result, stats = episode(checkpoint, seed, args.capacity, args.policy, args.driver,
                                model_inputs(args.model), model_aim(args.model))
        print(f"seed {seed}: {', '.join(result['results'])} in {result['ticks']} ticks, "
              f"{result['collisions']} collisions", flush=True)
        for key, s in stats.items():
            total[key] = [a + b for a, b in zip(total[key], s)]
    # 'repeat': how often w equals the w executed the tick before (its last action): a
    # model far above the expert there copies its own past command (the copycat failure).
    # 'turns to target' (target 30 deg or more off the heading): w of 0.5 rad/s or more
    # toward it; a model far below the expert there steers by something else, e.g. another
    # object ahead that shares the target's colour or shape (a binding failure)
    print(f"{'situation':44s} {'ticks':>6s} {'agree':>6s} {'|dv|':>6s} {'|dw|':>6s} "
          f"{'model repeats w':>15s} {'expert repeats w':>16s} {'model turns to target':>21s} "
          f"{'expert turns to target':>22s}")
    for key, (n, agree, dv, dw, rep_m, rep_e, to_m, to_e) in sorted(total.items()):
        off = key.startswith('target off-axis')
        turn_m = f'{to_m / n:21.2f}' if off else f"{'-':>21s}"
        turn_e = f'{to_e / n:22.2f}' if off else f"{'-':>22s}"
        print(f'{key:44s} {n:6d} {agree / n:6.2f} {dv / n:6.3f} {dw / n:6.3f} '
              f'{rep_m / n:15.2f} {rep_e / n:16.2f} {turn_m} {turn_e}')


if __name__ == '__main__':
    main()
