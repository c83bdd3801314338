"""Expert episodes rendered to tokens exactly as the node renders them.

A tick's token stream is what ``TickEngine`` feeds the model: the segments of
the inputs that changed (instruction once per goal, then /scan, /odom,
/detections), then the action segment (prefix, one word per field, newline).
"""

from dataclasses import dataclass
from dataclasses import field

import numpy as np

from rt_llm_node.codec import ObservationCodec
from rt_llm_node.codec import scan_sectors
from rt_llm_node.demo.expert import distractor_ahead
from rt_llm_node.demo.expert import expert_aim
from rt_llm_node.demo.expert import expert_command
from rt_llm_node.demo.expert import parse_detections
from rt_llm_node.demo.expert import parse_instruction
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.task import action_grammar
from rt_llm_node.demo.task import AIM_FIELD
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import SYSTEM_PROMPT
from rt_llm_node.demo.world import COLOURS
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.demo.world import instruction_for
from rt_llm_node.demo.world import SHAPES

SCAN_SECTORS = next(s.options['sectors'] for s in INPUTS if s.topic == '/scan')


@dataclass
class TickTokens:
    """One tick: input segments [(kind, topic, ids)] and the action's ids (prefix..newline)."""

    segments: list
    action_ids: list         # the expert's (clean) command: the training label
    n_prefix: int            # the action's first n_prefix ids are prefilled, not predicted
    executed_ids: list = None  # the command the robot executed (with DART noise), as rendered
    distractor: bool = False   # the target off to one side, another object ahead (expert.py)
    n_plan: int = 0            # ids of plan fields ('_aim') after the prefix, before v and w
    # counterfactual labels: {(colour, shape): the expert's action ids had the instruction
    # named that object instead} for the other objects in the detections (expert_episode's
    # ``counterfactual``); the ones among them that would be a distractor tick
    alternatives: dict = None
    alt_distractor: frozenset = frozenset()


@dataclass
class Episode:
    seed: int
    ticks: list = field(default_factory=list)
    results: list = field(default_factory=list)
    final_pose: tuple = None
    instructions: dict = None   # (colour, shape) -> its instruction segment's ids


def episode_texts(seed, noise=0.0, inputs=INPUTS):
    """Plain text lines of an expert episode (for training the tokenizer)."""
    world = DemoWorld(seed, messages=MessageFactory(ros=False))
    codec = ObservationCodec(None, inputs)
    lines, instruction = [SYSTEM_PROMPT], ''
    rng = np.random.default_rng(seed)
    last_w = 0.0
    while not world.done:
        msgs = world.observe()
        for spec in inputs:
            if spec.topic in msgs:
                lines.append(codec.text(spec.topic, msgs[spec.topic]))
        if '/instruction' in msgs:
            instruction = msgs['/instruction'].data
        v, w = expert_command(instruction, scan_sectors(msgs['/scan'], SCAN_SECTORS),
                              msgs['/detections'].data, last_w)
        lines.append(f'act v{v:+.1f} w{w:+.2f}')
        ev, last_w = v + noise * rng.normal(), w + noise * rng.normal()
        world.step(ev, last_w)
    return lines


AIM_RANDOM = 0.25   # with aim noise, the share of shown aims drawn at random


def expert_episode(seed, tokenizer, noise=(0.0, 0.0), noise_seed=None, hold_rate=0.0,
                   executed=None, inputs=INPUTS, aim=False, aim_noise=0.0,
                   counterfactual=False, world_config=None):
    """Run the expert in the world; record each tick's tokens (label: the clean expert action).

    ``noise``: std of Gaussian noise (v, w) added to the executed command, so the
    data covers recoveries from the expert's own path (DART). ``hold_rate``: per
    tick, the chance that the robot starts executing a random command for 5 to 20
    ticks while the labels stay the expert's: the past actions in the context then say
    nothing about the label, so a learner cannot succeed by copying them (the copycat
    failure of imitation learning). ``executed``: [(v, w)] per tick,
    what a policy executed on this seed (``evaluate.run_model_episode``): the robot
    replays it exactly (the world is deterministic per seed and command sequence) and
    the episode ends with it, while each tick's label is still the expert's: DAgger
    data, the states the policy itself reaches. ``inputs``: the input specs rendered (the
    expert reads the messages either way). ``aim``: actions start with the plan field
    '_aim', labelled with the expert's aim (``expert_aim``). ``aim_noise``: std (degrees)
    of Gaussian noise on the aim the context shows for the tick (what a policy stated;
    the robot executes only v and w), and a random aim on AIM_RANDOM of the ticks; 0:
    the context shows the expert's aim, which changes slowly, so a learner can copy the
    aim of the tick before instead of finding the target in the detections, and at run
    time copies its own wrong ones (docs/history.md). Drawn from a generator of
    its own: the executed commands are the same with or without it.
    ``counterfactual``: also label every tick of a goal as if the instruction had named each
    other object in its detections (``TickTokens.alternatives``, ``Episode.instructions``):
    the expert's command is a function of the instruction, the newest observation and its
    last command alone, so the same observation under another instruction has an exact
    label of its own. A learner shown those cannot do well by
    steering at whichever object is ahead or nearest: it must read the instruction
    (docs/history.md). Draws nothing from the generators. ``world_config``: a
    WorldConfig other than the default (e.g. a coarser detector bearing).
    """
    world = DemoWorld(seed, config=world_config, messages=MessageFactory(ros=False))
    codec = ObservationCodec(tokenizer, inputs)
    grammar = action_grammar(tokenizer, aim)
    fv, fw = grammar.field('linear.x'), grammar.field('angular.z')
    rng = np.random.default_rng(seed if noise_seed is None else noise_seed)
    aim_rng = np.random.default_rng([seed if noise_seed is None else noise_seed, 1])
    fa = grammar.field(AIM_FIELD['name']) if aim else None
    episode = Episode(seed)
    instruction = ''
    rendered = {}   # action text -> ids: one shared list per distinct action

    def action_of(values):
        text = grammar.render(values)
        if text not in rendered:
            rendered[text] = tokenizer.encode(text).ids
        return rendered[text]
    if counterfactual:
        spec = next(s for s in inputs if s.kind == 'instruction')
        factory = MessageFactory(ros=False)
        episode.instructions = {
            (c, s): codec.encode(spec.topic, factory.string(instruction_for(c, s)))
            for c in COLOURS for s in SHAPES}
    hold_left, hold = 0, (0.0, 0.0)
    last_w = 0.0   # the previous command's turn rate, as its action segment renders it
    while not world.done and (executed is None or world.tick < len(executed)):
        msgs = world.observe()
        segments = [(spec.kind, spec.topic, codec.encode(spec.topic, msgs[spec.topic]))
                    for spec in inputs if spec.topic in msgs]
        if '/instruction' in msgs:
            instruction = msgs['/instruction'].data
        v, w = expert_command(instruction, scan_sectors(msgs['/scan'], SCAN_SECTORS),
                              msgs['/detections'].data, last_w)
        values = {'linear.x': v, 'angular.z': w}
        plan = {'_aim': expert_aim(instruction, msgs['/detections'].data)} if aim else {}
        values.update(plan)
        shown = dict(plan)   # the plan the context shows for this tick
        if aim and aim_noise > 0:
            if aim_rng.random() < AIM_RANDOM:
                shown['_aim'] = float(aim_rng.choice(fa.values))
            else:
                shown['_aim'] = fa.quantize(plan['_aim'] + aim_noise * aim_rng.normal())
        action_ids = action_of(values)
        episode.ticks.append(TickTokens(segments, action_ids, len(grammar.prefix_ids),
                                        distractor=distractor_ahead(
                                            instruction, msgs['/detections'].data),
                                        n_plan=1 if aim else 0))   # one token (test_demo)
        if counterfactual and instruction:
            _counterfactuals(episode.ticks[-1], instruction, msgs['/detections'].data,
                             scan_sectors(msgs['/scan'], SCAN_SECTORS), last_w, aim,
                             action_of)
        if executed is not None:   # the policy's command, replayed
            ev, ew = executed[world.tick]
        else:
            qv = fv.quantize(v)
            qw = fw.quantize(w)
            ev, ew = qv + noise[0] * rng.normal(), qw + noise[1] * rng.normal()
            if hold_left == 0 and hold_rate and rng.random() < hold_rate:
                hold_left = int(rng.integers(5, 21))
                hold = (float(rng.choice(fv.values)), float(rng.choice(fw.values)))
            if hold_left:
                hold_left -= 1
                ev, ew = hold
        if noise[0] or noise[1] or hold_rate or executed is not None or shown != plan:
            # what a policy that chose it would render
            ev, ew = fv.quantize(ev), fw.quantize(ew)
            episode.ticks[-1].executed_ids = tokenizer.encode(grammar.render(
                {'linear.x': ev, 'angular.z': ew, **shown})).ids
        else:
            episode.ticks[-1].executed_ids = action_ids
        last_w = ew   # quantized either way: noiseless, ev and ew are qv and qw
        world.step(ev, ew)
    episode.results = list(world.results)
    episode.final_pose = (world.x, world.y, world.yaw)
    return episode


def _counterfactuals(tick, instruction, detections, sectors, last_w, aim, action_of):
    """Fill ``tick.alternatives``: the expert's action for each other detected object."""
    target = parse_instruction(instruction)
    tick.alternatives, distracted = {}, set()
    for colour, shape, _, _ in parse_detections(detections):
        name = (colour, shape)
        if name == target or name in tick.alternatives:
            continue
        other = instruction_for(colour, shape)
        v, w = expert_command(other, sectors, detections, last_w)
        values = {'linear.x': v, 'angular.z': w}
        if aim:
            values['_aim'] = expert_aim(other, detections)
        tick.alternatives[name] = action_of(values)
        if distractor_ahead(other, detections):
            distracted.add(name)
    tick.alt_distractor = frozenset(distracted)


def system_ids(tokenizer):
    return tokenizer.encode(SYSTEM_PROMPT + '\n').ids


def success_rate(results):
    return sum(r == 'reached' for r in results) / max(1, len(results))
