"""Where the demo policy goes wrong: closed-loop episodes, each tick classified.

    python training/diagnose.py [--model DIR] [--episodes 4] [--capacity 1024]

Per episode: goals reached or timed out, ticks, collisions; by situation (target in
the detections or not, 30 degrees or more off the heading or not, another object within
15 degrees of the heading or not; an obstacle within 1 m ahead or not), how often the
model's (v, w) matched the expert's on the same observation, the mean |error| of each,
and with the target off to one side how often each turned toward it. For a policy that
states its aim first (``--aim`` checkpoints): how often that aim was the expert's (exactly,
within one 15-degree step, on the right side) and how often, aiming 30 degrees or more off
the heading, it turned toward its own aim: a policy whose w follows a wrong aim fails at
finding the target, one that ignores a right aim fails at acting on it.
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
from rt_llm_node.demo.expert import expert_aim
from rt_llm_node.demo.expert import target_detection
from rt_llm_node.demo.task import AIM_FIELD
from rt_llm_node.demo.task import AIM_UNSEEN
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.demo.task import numeric_field
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path


def target_bearing(instruction, detections):
    """Bearing (deg) of the instructed object in the detections line, or None."""
    seen = target_detection(instruction, detections)
    return None if seen is None else seen[2]


def situation(instruction, sectors, detections, bearing):
    """Return the tick's row; ``bearing``: target_bearing of the same inputs."""
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
AIM_STATS = 6   # ticks, aim exact, within a step, right side, aiming off-axis, w toward it


def aim_scores(stated, expert, w, step=AIM_FIELD['step']):
    """Score one tick.

    [1, exact, within one step, right side (or both out of sight), the stated aim 30 deg or more
    off the heading, w of 0.5 rad/s or more toward it] for one tick.
    """
    unseen = (stated == AIM_UNSEEN, expert == AIM_UNSEEN)
    side = unseen[0] == unseen[1] and (unseen[0] or abs(expert) < step
                                       or math.copysign(1.0, stated) == math.copysign(1.0,
                                                                                      expert))
    off = not unseen[0] and abs(stated) >= OFF_AXIS_DEG
    return [1, stated == expert, not any(unseen) and abs(stated - expert) <= step or all(unseen),
            side, off, off and w * math.copysign(1.0, stated) >= 0.5]


def episode(checkpoint, seed, capacity, policy, driver='model', inputs=INPUTS, aim=False):
    """Run one diagnosed episode.

    Returns (result of run_model_episode, {situation: [ticks, agree, |dv|, |dw|, model repeats
    the executed w, expert's label does, model turns toward the target, expert does]},
    {situation: aim_scores summed} (empty unless ``aim``)).
    """
    stats = defaultdict(lambda: [0] * STATS)
    aims = defaultdict(lambda: [0] * AIM_STATS)
    last = [None]   # the w executed the tick before
    quantize = numeric_field(AIM_FIELD).quantize

    def observe(msgs, instruction, sectors, expert, model, action):
        v, w = model or (0.0, 0.0)
        ev, ew = expert
        detections = msgs['/detections'].data
        bearing = target_bearing(instruction, detections)
        key = situation(instruction, sectors, detections, bearing)
        if aim and action is not None:
            scores = aim_scores(action.values[AIM_FIELD['name']],
                                float(quantize(expert_aim(instruction, detections))), w)
            aims[key] = [a + b for a, b in zip(aims[key], scores)]
        s = stats[key]
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
    return result, stats, aims


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
    aim_total = defaultdict(lambda: [0] * AIM_STATS)
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        result, stats, aims = episode(checkpoint, seed, args.capacity, args.policy,
                                      args.driver, model_inputs(args.model),
                                      model_aim(args.model))
        print(f"seed {seed}: {', '.join(result['results'])} in {result['ticks']} ticks, "
              f"{result['collisions']} collisions", flush=True)
        for key, s in stats.items():
            total[key] = [a + b for a, b in zip(total[key], s)]
        for key, s in aims.items():
            aim_total[key] = [a + b for a, b in zip(aim_total[key], s)]
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
    if aim_total:
        print(f"\n{'situation (stated aim)':44s} {'ticks':>6s} {'aim exact':>9s} "
              f"{'within 15':>9s} {'right side':>10s} {'aiming off-axis':>15s} "
              f"{'w toward own aim':>16s}")
        for key, (n, exact, near, side, off, toward) in sorted(aim_total.items()):
            follow = f'{toward / off:16.2f}' if off else f"{'-':>16s}"
            print(f'{key:44s} {n:6d} {exact / n:9.2f} {near / n:9.2f} {side / n:10.2f} '
                  f'{off:15d} {follow}')


if __name__ == '__main__':
    main()
