"""A walled 2D arena with pillars and coloured objects, and a differential-drive robot.

Deterministic for a given seed. Each tick (``dt`` = 1/30 s) the world gives the
robot's sensors as messages: ``/scan`` (LaserScan, 360 degrees), ``/odom``
(Odometry), ``/detections`` (String, e.g. ``red box 31deg 2.1m; blue cone -12deg
4.0m``) and, once per goal, ``/instruction`` (String, e.g. ``go to the red box``).
It takes a Twist (v, w). An episode chains ``goals`` goals; the next instruction
comes when the robot reaches the goal or the goal times out.
"""

from dataclasses import dataclass
import math

import numpy as np

from rt_llm_node.demo.messages import MessageFactory

COLOURS = ('red', 'green', 'blue')
SHAPES = ('box', 'cone', 'ball')


@dataclass
class WorldConfig:
    """Arena geometry, robot limits and episode rules."""

    arena: float = 8.0            # square side, m
    obstacles: int = 3            # pillars
    objects: int = 5              # distinct (colour, shape) objects placed
    goals: int = 3                # goals per episode
    dt: float = 1.0 / 30.0
    robot_radius: float = 0.2
    object_radius: float = 0.2
    goal_distance: float = 0.6    # reached when the object's centre is this close
    goal_timeout_s: float = 30.0
    scan_beams: int = 90
    range_max: float = 6.0        # laser range
    detect_range: float = 12.0    # the object detector sees across the arena
    bearing_step_deg: int = 1     # the detector's bearing resolution, degrees
    scan_noise: float = 0.01
    max_v: float = 0.8
    min_v: float = -0.2
    max_w: float = 1.5


def instruction_for(colour, shape):
    """/instruction's text for a goal object: 'go to the red box'."""
    return f'go to the {colour} {shape}'


def detections_line(found):
    """Render the /detections text for [(colour, shape, bearing_deg, distance_m)].

    'red box 31deg 2.1m; blue cone -12deg 4.0m', or 'none'.
    """
    if not found:
        return 'none'
    return '; '.join(f'{c} {s} {b}deg {d:.1f}m' for c, s, b, d in found)


def _wrap(angle):
    return (angle + math.pi) % (2.0 * math.pi) - math.pi


class DemoWorld:
    """One episode of the demo task; ``step(v, w)`` advances one tick."""

    def __init__(self, seed, config=None, messages=None):
        self.config = config or WorldConfig()
        self.messages = messages or MessageFactory()
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        self._place()
        self.tick = 0
        self.v = self.w = 0.0
        self.goal_index = 0
        self.goal_started = 0
        self.results = []              # per goal: 'reached' or 'timeout'
        self.collisions = 0
        self._instruction_pending = True
        angles = np.arange(self.config.scan_beams) * (2 * math.pi / self.config.scan_beams)
        self._beam_offsets = angles - math.pi

    # -- layout -------------------------------------------------------------------------
    def _free(self, p, radius, circles):
        c = self.config
        if not (radius <= p[0] <= c.arena - radius and radius <= p[1] <= c.arena - radius):
            return False
        return all(math.hypot(p[0] - q[0], p[1] - q[1]) > radius + r for q, r in circles)

    def _sample(self, radius, circles, margin):
        for _ in range(10_000):
            p = self.rng.uniform(0.0, self.config.arena, 2)
            if self._free(p, radius + margin, circles):
                return (float(p[0]), float(p[1]))
        raise RuntimeError(f'seed {self.seed}: could not place an item')

    def _place(self):
        c = self.config
        circles = []
        self.obstacles = []
        for _ in range(c.obstacles):
            r = float(self.rng.uniform(0.25, 0.45))
            p = self._sample(r, circles, 0.8)
            self.obstacles.append((p, r))
            circles.append((p, r))
        kinds = [(col, shape) for col in COLOURS for shape in SHAPES]
        chosen = self.rng.choice(len(kinds), size=c.objects, replace=False)
        self.objects = []
        for k in chosen:
            p = self._sample(c.object_radius, circles, 0.8)
            self.objects.append((kinds[k], p))
            circles.append((p, c.object_radius))
        p = self._sample(c.robot_radius, circles, 0.4)
        self.x, self.y = p
        self.yaw = float(self.rng.uniform(-math.pi, math.pi))
        order = self.rng.permutation(len(self.objects))[:c.goals]
        self.goal_objects = [int(i) for i in order]

    # -- queries ------------------------------------------------------------------------
    @property
    def done(self):
        return self.goal_index >= self.config.goals

    @property
    def goal(self):
        """((colour, shape), (x, y)) of the current goal object."""
        return self.objects[self.goal_objects[self.goal_index]]

    def instruction_text(self):
        return instruction_for(*self.goal[0])

    def _circles(self, with_objects=True):
        circles = list(self.obstacles)
        if with_objects:
            circles += [(p, self.config.object_radius) for _, p in self.objects]
        return circles

    def ranges(self):
        """Ranges of the 360-degree scan, beam 0 pointing backwards, counter-clockwise."""
        c = self.config
        angles = self.yaw + self._beam_offsets
        dx, dy = np.cos(angles), np.sin(angles)
        with np.errstate(divide='ignore', invalid='ignore'):
            tx = np.where(dx > 0, (c.arena - self.x) / dx, np.where(dx < 0, -self.x / dx, np.inf))
            ty = np.where(dy > 0, (c.arena - self.y) / dy, np.where(dy < 0, -self.y / dy, np.inf))
        t = np.minimum(tx, ty)
        for (px, py), r in self._circles():
            ox, oy = self.x - px, self.y - py
            b = dx * ox + dy * oy
            disc = b * b - (ox * ox + oy * oy - r * r)
            hit = -b - np.sqrt(np.maximum(disc, 0.0))
            t = np.where((disc >= 0) & (hit > 0), np.minimum(t, hit), t)
        t = t + self.rng.normal(0.0, c.scan_noise, len(t))
        return np.where(t > c.range_max, np.inf, np.maximum(t, 0.05))

    def detections(self):
        """Objects in detector range, nearest first: [(colour, shape, bearing_deg, distance_m)].

        The detector is a tag reader: pillars do not hide objects from it.
        """
        found = []
        for (colour, shape), p in self.objects:
            d = math.hypot(p[0] - self.x, p[1] - self.y)
            if d <= self.config.detect_range:
                bearing = math.degrees(_wrap(math.atan2(p[1] - self.y, p[0] - self.x) - self.yaw))
                step = self.config.bearing_step_deg
                bearing = max(-180, min(180, step * round(bearing / step)))
                found.append((colour, shape, int(bearing), round(d, 1)))
        return sorted(found, key=lambda f: f[3])

    def detections_text(self):
        return detections_line(self.detections())

    def observe(self):
        """Return this tick's messages by topic; ``/instruction`` only when a goal starts."""
        c = self.config
        m = self.messages
        out = {
            '/scan': m.laser_scan(self.ranges(), -math.pi, 2 * math.pi / c.scan_beams, 0.05,
                                  c.range_max),
            '/odom': m.odometry(self.x, self.y, self.yaw, self.v, self.w),
            '/detections': m.string(self.detections_text()),
        }
        if self._instruction_pending and not self.done:
            out['/instruction'] = m.string(self.instruction_text())
            self._instruction_pending = False
        return out

    # -- dynamics -----------------------------------------------------------------------
    def step(self, v, w):
        """Apply the command for one tick; returns 'reached', 'timeout' or None."""
        c = self.config
        v = float(v) if math.isfinite(v) else 0.0
        w = float(w) if math.isfinite(w) else 0.0
        self.v = min(max(v, c.min_v), c.max_v)
        self.w = min(max(w, -c.max_w), c.max_w)
        yaw = _wrap(self.yaw + self.w * c.dt)
        x = self.x + self.v * math.cos(yaw) * c.dt
        y = self.y + self.v * math.sin(yaw) * c.dt
        self.yaw = yaw
        if self._free((x, y), c.robot_radius, self._circles()):
            self.x, self.y = x, y
        else:
            self.collisions += 1
            self.v = 0.0
        self.tick += 1
        if self.done:
            return None
        _, (gx, gy) = self.goal
        event = None
        if math.hypot(gx - self.x, gy - self.y) < c.goal_distance:
            event = 'reached'
        elif (self.tick - self.goal_started) * c.dt >= c.goal_timeout_s:
            event = 'timeout'
        if event:
            self.results.append(event)
            self.goal_index += 1
            self.goal_started = self.tick
            self._instruction_pending = True
        return event
