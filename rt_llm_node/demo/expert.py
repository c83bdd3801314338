"""The scripted expert: goal seeking with obstacle avoidance, from what the model sees.

It reads the same rendered text the model reads (the instruction, the scan's
sector minima, the detections line, and its own previous action), so its
decisions can be imitated from the context alone: no privileged state. Steering
follows the gap: among the target bearing and the sector centres, head for the
direction closest to the target whose sector is clear far enough.
"""

import math
import re

DETECTION = re.compile(r'(\w+) (\w+) (-?\d+)deg (\d+(?:\.\d+)?)m')
INSTRUCTION = re.compile(r'go to the (\w+) (\w+)')
MAX_V = 0.8
MAX_W = 1.5


def parse_detections(text):
    """'red box 31deg 2.1m; ...' -> [(colour, shape, bearing_deg, distance_m)]."""
    return [(c, s, int(b), float(d)) for c, s, b, d in DETECTION.findall(text)]


def parse_instruction(text):
    """'go to the red box' -> ('red', 'box'), or None."""
    match = INSTRUCTION.search(text or '')
    return (match.group(1), match.group(2)) if match else None


def target_detection(instruction, detections_text):
    """Find the detection of the object the instruction names.

    The first detection of the object ``instruction`` names, (colour, shape, bearing_deg,
    distance_m), or None when it is not in sight (or there is no instruction).
    """
    target = parse_instruction(instruction)
    if target is None:
        return None
    return next((d for d in parse_detections(detections_text) if d[:2] == target), None)


def distractor_ahead(instruction, detections_text, off_axis_deg=30, ahead_deg=15):
    """Tell whether the target is off to one side with another object ahead.

    True when the instructed object is seen ``off_axis_deg`` or more off the heading while another
    object lies within ``ahead_deg`` of it: the state where a policy that binds the instruction's
    colour or shape alone, not both, steers at the wrong object (training/diagnose.py;
    docs/history.md, why the demo policy fails).
    """
    seen = target_detection(instruction, detections_text)
    return seen is not None and abs(seen[2]) >= off_axis_deg and any(
        d[:2] != seen[:2] and abs(d[2]) <= ahead_deg for d in parse_detections(detections_text))


def expert_aim(instruction, detections_text, limit_deg=165.0, unseen_deg=180.0):
    """Return the bearing (deg) the expert steers for.

    The instructed object's, within +-``limit_deg``; ``unseen_deg`` when it is not in sight (the
    expert then turns on the spot). What an aiming policy states before its command
    (task.AIM_FIELD).
    """
    seen = target_detection(instruction, detections_text)
    return unseen_deg if seen is None else _clip(float(seen[2]), limit_deg)


def _clip(value, limit):
    return max(-limit, min(limit, value))


def expert_command(instruction, sectors, detections_text, last_w=0.0):
    """(v, w) toward the goal in ``instruction``: attraction to it, repulsion from the scan.

    ``sectors``: scan minima, sector 0 straight ahead, counter-clockwise;
    ``last_w``: the turn rate of the previous command given (the newest action segment
    in the context), which keeps a turn going and breaks the tie when a pillar stands
    dead ahead. It is the command, not the turn rate /odom measures: under actuation
    latency /odom shows a command two or more ticks old, and a tie-break on it dithers
    in place (docs/history.md, actuation latency). So the command is a function of the
    newest observation segments and the newest action segment alone.
    """
    n = len(sectors)
    width = 2.0 * math.pi / n
    seen = target_detection(instruction, detections_text)
    if seen is None:  # nothing to go to: turn on the spot
        return 0.0, MAX_W / 2
    _, _, bearing_deg, distance = seen
    bearing = math.radians(bearing_deg)
    turn = 2.0 * bearing
    slow = 1.0
    for s in range(n):
        angle = math.atan2(math.sin(s * width), math.cos(s * width))
        clear = sectors[s]
        if math.isnan(clear) or abs(angle) > math.pi / 2 + 1e-6 or clear > 1.0:
            continue
        if abs(angle - bearing) < width and clear > distance - 0.5:
            continue  # that return is the target itself
        push = (1.0 - clear) / max(clear, 0.1) * math.cos(angle)
        side = math.copysign(1.0, angle) if abs(angle) > 1e-6 else math.copysign(
            1.0, -last_w if abs(last_w) > 0.1 else -1.0)
        turn -= 1.2 * push * side
        if abs(angle) <= width + 1e-6:
            slow = min(slow, max(0.0, (clear - 0.3) / 0.7))
    w = _clip(turn, MAX_W)
    v = MAX_V * min(1.0, distance / 1.2) * max(0.0, math.cos(bearing)) ** 2 * slow
    if v < 0.05:  # turning on the spot: never reverse the turn (no dithering in place)
        if abs(last_w) > 0.1 and (w * last_w <= 0 or abs(w) < 0.5):
            w = math.copysign(max(abs(w), 0.5), last_w)
        elif abs(w) < 0.2:
            w = math.copysign(0.5, bearing if abs(bearing) > 0.05 else 1.0)
    return v, w
