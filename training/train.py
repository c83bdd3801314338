"""Train the demo policy by imitation of the expert; export an HF-layout checkpoint.

Offline tooling (torch + transformers), run on the GPU machine:

    python training/train.py --out rt_llm_node/demo/model

Steps: expert episodes on training seeds (DART noise and held random commands
on three in four) -> a byte-level BPE tokenizer trained on their text -> token
streams rendered exactly as the node renders them -> training contexts that,
like the bounded cache, randomly drop old observation segments and re-base
positions -> a small Llama trained on the action tokens of every complete tick
in the context (with ``--dagger MODEL``, also on episodes where MODEL drove and the
expert labelled each state) -> config.json + model.safetensors + tokenizer.json +
training.json (command, seed, data size, steps, final loss).
"""

import argparse
import bisect
from collections import deque
from concurrent.futures import ProcessPoolExecutor
import copy
import json
import multiprocessing
import os
from pathlib import Path
import sys
import tempfile
import time

# One BLAS thread per process, set before numpy loads its BLAS: the DAgger rollouts run one
# numpy decoder per worker, and 16 workers each spinning 16 OpenBLAS threads on the GPU
# machine's 16 cores made a 128-episode rollout take minutes instead of 106 s.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
os.environ.setdefault('OMP_NUM_THREADS', '1')

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rt_llm_node.codec import ObservationCodec  # noqa: E402
from rt_llm_node.demo.episodes import episode_texts  # noqa: E402
from rt_llm_node.demo.episodes import expert_episode  # noqa: E402
from rt_llm_node.demo.episodes import success_rate  # noqa: E402
from rt_llm_node.demo.episodes import system_ids  # noqa: E402
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0  # noqa: E402
from rt_llm_node.demo.expert import parse_detections  # noqa: E402
from rt_llm_node.demo.expert import parse_instruction  # noqa: E402
from rt_llm_node.demo.messages import MessageFactory  # noqa: E402
from rt_llm_node.demo.task import demo_inputs  # noqa: E402
from rt_llm_node.demo.task import INPUTS  # noqa: E402
from rt_llm_node.demo.task import model_aim  # noqa: E402
from rt_llm_node.demo.task import model_inputs  # noqa: E402
from rt_llm_node.demo.task import model_object_tokens  # noqa: E402
from rt_llm_node.demo.task import object_phrases  # noqa: E402
from rt_llm_node.demo.task import whole_words  # noqa: E402
from tokenizer import train_tokenizer  # noqa: E402

MODEL = {'vocab_size': 1280, 'hidden_size': 192, 'intermediate_size': 512,
         'num_hidden_layers': 4, 'num_attention_heads': 6, 'num_key_value_heads': 2,
         'head_dim': 32, 'max_position_embeddings': 1024, 'rms_norm_eps': 1e-5,
         'rope_theta': 10000.0, 'tie_word_embeddings': True}
BUDGETS = (128, 192, 256, 384, 512, 768, 1024)
# --select-episodes validates on these seeds: neither training (seed * 100000 + i, DAgger
# seeds after them) nor held out for evaluation (rt-llm-eval, 1000000 and up)
VALIDATION_SEED0 = 900_000


def _texts(job):
    seed, topics = job
    return episode_texts(seed, inputs=demo_inputs(topics))


def _episode(job):
    """One expert episode, built in a worker.

    (seed, tokenizer json, noise, hold rate, executed commands or None, (topics, aim, aim noise,
    counterfactual)[, world config]). The topics were checked by the caller
    (training/lookup_stage.py renders fewer than the expert reads).
    """
    seed, tokenizer_json, noise, hold_rate, executed, (topics, aim, aim_noise, cf) = job[:6]
    world_config = job[6] if len(job) > 6 else None
    tokenizer = Tokenizer.from_str(tokenizer_json)
    inputs = demo_inputs(topics, required=())
    if executed is not None:   # DAgger: the policy's own states, the expert's labels
        return expert_episode(seed, tokenizer, executed=executed, inputs=inputs, aim=aim,
                              aim_noise=aim_noise, counterfactual=cf,
                              world_config=world_config)
    return expert_episode(seed, tokenizer, noise=noise, hold_rate=hold_rate, inputs=inputs,
                          aim=aim, aim_noise=aim_noise, counterfactual=cf,
                          world_config=world_config)


def _drive(job):
    """One closed-loop episode of the model under meaning eviction (numpy backend).

    (seed, what it executed, goals reached, goals). DAgger rollouts and validation both use it; the
    model's inputs are the ones its export records (``_export``).
    """
    model, seed, capacity, max_ticks = job
    from rt_llm_node.demo.evaluate import _checkpoint
    from rt_llm_node.demo.evaluate import run_model_episode
    result = run_model_episode(_checkpoint(model), seed, 'meaning', capacity,
                               max_ticks=max_ticks, inputs=model_inputs(model),
                               aim=model_aim(model))
    results = result['results']
    return seed, result['executed'], sum(r == 'reached' for r in results), len(results)


def _one_cycle_lrs(schedule, step):
    """Set the learning rates torch's OneCycleLR gives at ``step``, in closed form.

    Like its step(), this also sets the cycled momentum of the optimizer.
    """
    import warnings
    saved = schedule.last_epoch
    schedule.last_epoch = step
    try:
        with warnings.catch_warnings():   # get_lr outside step() warns; it is what we want
            warnings.simplefilter('ignore')
            return schedule.get_lr()
    finally:
        schedule.last_epoch = saved


def build_sample(episode, system, end, budget, rng, keyframe_weight=1.0, distractor_weight=1.0,
                 counterfactual=0.0, sparse=None, lookup=False, meaning=False, stale=0):
    """Build one training context.

    Token ids, labels (-100: no loss) and loss weights (0 off the labels) of one context ending at
    tick ``end``.

    Every tick of the context whose observation segments are all present is
    supervised, not only the last: its action position shows what the robot
    executed (DART noise, held random commands) while its label is the expert's
    clean command for that observation, so copying the shown history is never the
    label and each context teaches a dozen decisions instead of one.

    Keyframes: a supervised tick whose label differs from the command executed the tick
    before (what the context shows last, and what a copying policy would repeat) weighs
    ``keyframe_weight``, every other one 1 ("Keyframe-focused visual imitation
    learning", Wen et al. 2021: up-weighting the changes fights a learner that copies its
    own last action). A supervised tick whose target is off to one side with another object
    ahead (``TickTokens.distractor``) weighs ``distractor_weight`` times more again: where
    the shipped policy steers at the wrong object (training/diagnose.py).

    Counterfactual: with probability ``counterfactual`` (an episode made with
    ``expert_episode(counterfactual=True)``), the context's instruction names an object of
    the newest tick's detections drawn uniformly, the real target among them, and every
    supervised tick is labelled with the expert's command for that instruction
    (``TickTokens.alternatives``); the actions shown stay what the robot executed, so what
    the history and /odom say of the target is right only as often as chance. No draw is
    made when it is 0.

    Sparse detections: ``sparse`` = (share, ``SparseDetections``): with probability share,
    the newest tick's detections line shows the instructed object and at most two others
    drawn from the rest (``SparseDetections.thin``). The expert's command reads only the
    instructed object's detection, so every label stays exact. A line of two or three
    objects is where a fresh model first learns to find the instructed one (the match
    behind the lookup, learned on 6 objects only after a long plateau: docs/history.md).
    No draw is made when ``sparse`` is None.

    Lookup (an aiming episode's contexts only): every tick shows its detections and its
    action, no other observation, and only the stated aims are supervised (the aim is a
    function of the instruction and the detections alone; v and w are not without the
    scan). With the instruction drawn (``counterfactual``) and a short budget, this is the
    lookup alone, which a fresh model learns in ~1500 steps of 256 where the same with the
    scan and odometry rendered stays at chance (docs/history.md).

    Meaning: the context a ``meaning`` cache of about ``budget`` tokens holds once it has
    filled: the newest tick's observations alone (every older one superseded, so dropped
    first), the instruction, and the actions of older ticks thinned (the least attended go
    next), back as far as the budget reaches. Only the newest tick is then supervised (no
    older one shows its observations; but see ``stale``). Otherwise such a context comes
    up only where a draw drops every older observation and few actions, ~0.5% of the
    supervised ticks,
    and retrains from scratch kept 81% and 89% of their full-cache success at 256 tokens
    (docs/history.md).

    Stale (with ``meaning``): the cache's keys and values as the engine has them, not as a
    fresh prefill would. A kept action was encoded while its own tick's observations were in
    the cache; they were evicted since, but what the action's keys and values of layers 1
    and up took from them stays (the engine compacts, it does not re-encode: a retrain
    reached 8 goals of 18 on six seeds as the engine ran it, 15 with the kept tokens re-
    encoded after every compaction; docs/history.md). So the observations of the
    ``stale`` newest older ticks whose action is shown are put back in the sequence, right
    before that action, where only that tick's own tokens see them; those ticks are then
    supervised too (their action sees its observations). A fourth value is returned,
    (positions, owner, tick) per token: the position a cache compacted to the visible tokens
    gives it (a hidden observation sits just before its action's first position, as when it
    was encoded), the tick whose tokens alone see it (-1: seen by every later token) and the
    tick it belongs to (-1: the system prompt and the instruction). ``stale_mask`` turns
    them into an attention mask.

    """
    ticks = episode.ticks
    observed, starts = _tick_tables(episode)
    at = bisect.bisect_right(starts, end) - 1   # the instruction in force at ``end``
    instr = (starts[at], observed[starts[at]][1]) if at >= 0 else None
    alt = None   # the object a counterfactual instruction names
    if counterfactual and instr and ticks[end].alternatives and rng.random() < counterfactual:
        names = sorted(ticks[end].alternatives) + [None]   # None: the real one, as often
        alt = names[int(rng.integers(len(names)))]
        if alt is not None:
            instr = (instr[0], episode.instructions[alt])
    thin = sparse is not None and instr is not None and rng.random() < sparse[0]
    if meaning:
        p_drop_obs, p_drop_act = 1.0, rng.choice([0.0, 0.0, 0.3, 0.5])
    else:
        p_drop_obs = rng.choice([0.0, 0.0, 0.5, 0.8, 1.0])
        p_drop_act = 1.0 if rng.random() < 0.2 else rng.choice([0.0, 0.3, 0.7])
    pieces = []   # reversed chronological list of (tick, ids, labels, weights, hidden ids)
    used = len(system) + (len(instr[1]) if instr else 0)
    n_hidden = 0  # older ticks shown with their hidden observations (``stale``)
    for t in range(end, -1, -1):
        tick = ticks[t]
        chunk, hidden = [], []
        complete = instr is not None and t >= instr[0]
        n = tick.n_prefix
        keep_hidden = meaning and n_hidden < stale
        for k, ids in enumerate(observed[t][0]):
            if lookup and k != observed[t][2]:   # the detections alone
                continue
            if t != end and rng.random() < p_drop_obs:
                if keep_hidden:
                    hidden += ids
                else:
                    complete = False
                continue
            if thin and t == end and k == observed[t][2]:
                ids = sparse[1].thin(ids, instr[1], rng)
            chunk += ids
        n_obs = len(chunk)
        labels = [-100] * n_obs
        weights = [0.0] * n_obs
        label = tick.action_ids
        if alt is not None:   # the label had the instruction named ``alt``
            label = (tick.alternatives or {}).get(alt)
            complete = complete and label is not None
        if t == end:  # the newest tick: the expert's command is also what the context shows
            a = label
            taught = a[n:]
        elif rng.random() >= p_drop_act:
            a = tick.executed_ids
            taught = label[n:] if complete and len(a) == len(label) else None
        else:
            a = taught = None
        if a is None:
            hidden = []
        if a is not None:
            chunk += a
            if taught is None:
                labels += [-100] * len(a)
                weights += [0.0] * len(a)
            else:
                # the command (v, w) only: a shown plan is noisy (--aim-noise) by design
                c = n + tick.n_plan
                changed = t > 0 and label[c:] != ticks[t - 1].executed_ids[c:]
                distracted = tick.distractor if alt is None else alt in tick.alt_distractor
                weight = (keyframe_weight if changed else 1.0) * (
                    distractor_weight if distracted else 1.0)
                taught_weights = [weight] * len(taught)
                if lookup:   # the aim (the plan's one token) alone
                    rest = len(taught) - tick.n_plan
                    taught = taught[:tick.n_plan] + [-100] * rest
                    taught_weights = taught_weights[:tick.n_plan] + [0.0] * rest
                labels += [-100] * n + taught
                weights += [0.0] * n + taught_weights
        if used + len(chunk) > budget:   # hidden observations take no slot of the cache
            break
        used += len(chunk)
        n_hidden += bool(hidden)
        pieces.append((t, chunk, labels, weights, hidden))
    pieces.reverse()
    ids, out, weights = list(system), [-100] * len(system), [0.0] * len(system)
    positions = list(range(len(system)))
    owner, tick_of = [-1] * len(system), [-1] * len(system)

    def place_instruction(at):
        ids.extend(instr[1])
        out.extend([-100] * len(instr[1]))
        weights.extend([0.0] * len(instr[1]))
        positions.extend(range(at, at + len(instr[1])))
        owner.extend([-1] * len(instr[1]))
        tick_of.extend([-1] * len(instr[1]))
    placed = False
    visible = len(system)   # the next compacted position
    for t, chunk, labels, wts, hidden in pieces:
        if instr and not placed and t >= instr[0]:
            place_instruction(visible)
            visible += len(instr[1])
            placed = True
        ids += hidden + chunk
        out += [-100] * len(hidden) + labels
        weights += [0.0] * len(hidden) + wts
        positions += [max(0, visible - len(hidden) + i) for i in range(len(hidden))]
        positions += range(visible, visible + len(chunk))
        visible += len(chunk)
        owner += [t] * len(hidden) + [-1] * len(chunk)
        tick_of += [t] * (len(hidden) + len(chunk))
    if instr and not placed:
        place_instruction(visible)
    if not stale:
        return ids, out, weights
    return ids, out, weights, (positions, owner, tick_of)


def stale_mask(owner, tick_of, attention):
    """Build the attention mask of stale layouts.

    Boolean attention mask [batch, 1, width, width] of ``build_sample(stale=...)`` layouts (int
    tensors [batch, width]; ``attention`` 1 on real tokens): causal, and a hidden observation
    (owner >= 0) seen only by the tokens of its own tick.
    """
    import torch
    width = owner.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=owner.device).tril()
    seen = (owner[:, None, :] < 0) | (owner[:, None, :] == tick_of[:, :, None])
    keys = attention[:, None, :].bool()
    # a pad query (past every real token) sees its own slot, so no row is all-masked
    eye = torch.eye(width, dtype=torch.bool, device=owner.device)
    return ((causal & seen & keys) | eye)[:, None]


def _tick_tables(episode):
    """Build an episode's tick tables.

    Per tick ([the ids of each segment but the instruction], the instruction's ids or None, the
    index of the detections segment in that list or None), and the ticks that carry an instruction:
    made once per episode and kept on it (a sample reads a dozen ticks; searching back for the
    instruction each time was most of a batch's time).
    """
    tables = getattr(episode, '_tick_tables', None)
    if tables is None or len(tables[0]) != len(episode.ticks):
        observed = []
        for tick in episode.ticks:
            instruction = [ids for kind, _, ids in tick.segments if kind == 'instruction']
            others = [(topic, ids) for kind, topic, ids in tick.segments
                      if kind != 'instruction']
            det = next((k for k, (topic, _) in enumerate(others) if topic == DETECTIONS), None)
            observed.append(([ids for _, ids in others],
                             instruction[0] if instruction else None, det))
        starts = [t for t, row in enumerate(observed) if row[1] is not None]
        tables = (observed, starts)
        episode._tick_tables = tables
    return tables


DETECTIONS = '/detections'


class SparseDetections:
    """Thins a rendered detections line.

    The instructed object's entry stays, with 0, 1 or 2 of the others (in their order, nearest
    first), rendered again by the node's codec.

    Works on the text (the tokenizer's decode is exact: byte-level BPE), so it holds for
    any tokenizer, whole object tokens or not.

    """

    def __init__(self, tokenizer, inputs=INPUTS):
        self.tokenizer = tokenizer
        self.codec = ObservationCodec(tokenizer, [s for s in inputs if s.topic == DETECTIONS])
        self.prefix = self.codec.inputs[DETECTIONS].prefix + ' '
        self.factory = MessageFactory(ros=False)

    def thin(self, ids, instruction, rng):
        """Thin a detections segment around the instructed object.

        ``ids`` (a detections segment) with the entry of the object ``instruction`` (an instruction
        segment's ids) names kept and 0-2 of the others drawn uniformly. As is when the line does
        not parse or does not show that object (nothing then keeps the label exact).
        """
        text = self.tokenizer.decode(ids)
        target = parse_instruction(self.tokenizer.decode(instruction))
        if target is None or not (text.startswith(self.prefix) and text.endswith('\n')):
            return ids
        entries = text[len(self.prefix):-1].split('; ')
        names = [parse_detections(e) for e in entries]
        if any(len(n) != 1 for n in names):
            return ids
        at = next((k for k, n in enumerate(names) if n[0][:2] == target), None)
        if at is None:
            return ids
        others = [k for k in range(len(entries)) if k != at]
        keep = {at}
        if others:
            keep.update(rng.choice(others, size=min(len(others), int(rng.integers(3))),
                                   replace=False).tolist())
        line = '; '.join(entries[k] for k in sorted(keep))
        return self.codec.encode(DETECTIONS, self.factory.string(line))


_EPISODES, _SYSTEM, _KEYFRAME, _DISTRACTOR = None, None, 1.0, 1.0   # set before the fork
_COUNTERFACTUAL = 0.0   # --counterfactual
_SHORT_FIRST = 0   # round 0's first steps that draw the two shortest budgets (--short-first)
_SPARSE = None     # (share, SparseDetections) of --sparse-detections
_LOOKUP_SHARE = 0.0  # --lookup-share
_MEANING_SHARE = 0.0  # --meaning-share
_STALE = 0  # --stale-ticks
# --meaning-share contexts: the budgets a meaning cache is run at (config/demo.yaml: 256) and
# the loss weight of their one supervised tick (an ordinary context supervises ~8)
MEANING_BUDGETS = (192, 256, 384)
MEANING_WEIGHT = 4.0
LOOKUP_BUDGET = 48  # the system prompt, the instruction and the newest tick's detections
LOOKUP_BATCH = 256  # the least batch of --lookup-first
# --lookup-first trains at this constant rate: the one the match emerged at (3e-3 stayed at
# chance, and round 0's one-cycle, 2e-3 decaying, had not found it by step 2000)
LOOKUP_LR = 1e-3
LOOKUP_EVERY = 250  # --lookup-first: steps between checks of the aim on held-out contexts
LOOKUP_DONE = 0.95  # --lookup-first ends early at this held-out aim accuracy
LOOKUP_STREAM = 1 << 20  # the lookup stage's batches: a random stream apart from any round's


def _build_batch(job):
    """One training batch, built in a worker.

    (ids, labels) int16, attention int8 and the loss weights float32, each [batch, width], and the
    layout of ``build_sample(stale=...)`` int16 [3, batch, width] (None when no row has hidden
    observations).

    Step ``step`` of round ``round_`` of run ``seed`` draws from its own generator, so a
    run's batches do not depend on how many workers built them or in what order they
    finished. ``round_`` LOOKUP_STREAM: a batch of the --lookup-first stage, lookup
    contexts only.
    """
    seed, round_, step, size = job
    rng = np.random.default_rng((seed, round_, step))
    episodes = _EPISODES
    batch_ids, batch_labels, batch_weights, batch_layouts = [], [], [], []
    short = round_ == 0 and step < _SHORT_FIRST
    budget = int(rng.choice(BUDGETS[:2] if short else BUDGETS))
    lookup_all = round_ == LOOKUP_STREAM
    for _ in range(size):
        lookup = lookup_all or (_LOOKUP_SHARE > 0 and rng.random() < _LOOKUP_SHARE)
        meaning = not lookup and _MEANING_SHARE > 0 and rng.random() < _MEANING_SHARE
        episode = episodes[rng.integers(len(episodes))]
        if rng.random() < 0.2:  # oversample the first ticks of a goal (no useful history)
            start = int(rng.choice(episode.goal_starts))
            end = min(len(episode.ticks) - 1, start + int(rng.integers(30)))
        else:
            end = int(rng.integers(len(episode.ticks)))
        # a lookup context draws its instruction over the objects in view (--lookup-first)
        width, drawn = (LOOKUP_BUDGET, 1.0) if lookup else (budget, _COUNTERFACTUAL)
        if meaning:
            width = int(rng.choice(MEANING_BUDGETS))
        stale = _STALE if meaning else 0
        sample = build_sample(episode, _SYSTEM, end, width, rng, _KEYFRAME, _DISTRACTOR,
                              drawn, _SPARSE, lookup, meaning, stale)
        if max(sample[1]) == -100:  # the newest tick alone outgrew the budget
            # (a lookup context: a line of many objects; twice the budget holds any, where
            # the largest budget would bring hundreds of tokens of older lines along)
            sample = build_sample(episode, _SYSTEM, end,
                                  2 * LOOKUP_BUDGET if lookup else max(BUDGETS), rng,
                                  _KEYFRAME, _DISTRACTOR, drawn, _SPARSE, lookup, meaning,
                                  stale)
        if meaning:
            sample = (sample[0], sample[1], [w * MEANING_WEIGHT for w in sample[2]],
                      *sample[3:])
        batch_ids.append(sample[0])
        batch_labels.append(sample[1])
        batch_weights.append(sample[2])
        batch_layouts.append(sample[3] if stale else None)
    width = max(len(i) for i in batch_ids)
    # int16 ids and labels, int8 mask: a third of the bytes of int64 through the worker
    # pipe and to the GPU (the trainer widens them there); the vocabulary fits (checked)
    ids = np.zeros((size, width), np.int16)
    labels = np.full((size, width), -100, np.int16)
    attention = np.zeros((size, width), np.int8)
    weights = np.zeros((size, width), np.float32)
    for b, (i, lab, wts) in enumerate(zip(batch_ids, batch_labels, batch_weights)):
        ids[b, :len(i)] = i
        labels[b, :len(i)] = lab
        attention[b, :len(i)] = 1
        weights[b, :len(i)] = wts
    layout = None   # (positions, owner, tick) [3, batch, width] where a row is stale
    if any(lay is not None and max(lay[1]) >= 0 for lay in batch_layouts):
        layout = np.full((3, size, width), -1, np.int16)
        layout[0] = np.arange(width)   # pads and rows without hidden tokens: in order
        for b, lay in enumerate(batch_layouts):
            if lay is not None:
                layout[:, b, :len(lay[0])] = lay
    return ids, labels, attention, weights, layout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default='rt_llm_node/demo/model')
    parser.add_argument('--episodes', type=int, default=1600)
    parser.add_argument('--steps', type=int, default=5500)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--lr', type=float, default=2e-3)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--workers', type=int, default=os.cpu_count())
    parser.add_argument('--max-minutes', type=float, default=None,
                        help='stop early and export what was learned once this much wall time '
                             'has passed (a run under a hard time limit still yields a model)')
    # three episodes in four are noisy: DART noise on the executed command and, at
    # --hold-rate per tick, a random command held for 5-20 ticks, the labels staying the
    # expert's; the more the executed turn rate (the context's last action) differs from
    # the label, the less a learner gains by copying it (training/diagnose.py measures
    # the copying)
    parser.add_argument('--noise-v', type=float, default=0.2, help='std of v noise, m/s')
    parser.add_argument('--noise-w', type=float, default=0.6, help='std of w noise, rad/s')
    parser.add_argument('--hold-rate', type=float, default=0.02)
    parser.add_argument('--dagger', default=None, metavar='MODEL[,MODEL...]',
                        help='DAgger: roll these checkpoints (earlier iterations) out on further '
                             'training seeds and add those episodes, labelled by the expert, '
                             'to the data')
    parser.add_argument('--dagger-episodes', type=int, default=256,
                        help='rollouts per model and per round')
    parser.add_argument('--dagger-rounds', type=int, default=0,
                        help='after training, this many times: the model just trained drives '
                             '--dagger-episodes further seeds, the expert labels them, and '
                             'training goes on with them added (DAgger in one command)')
    parser.add_argument('--dagger-lr', type=float, default=None,
                        help='peak learning rate of the DAgger rounds (default: --lr). Each '
                             'round restarts a one-cycle schedule, and a restart at --lr '
                             'undoes part of what the round before learned (loss 0.38 -> 0.51 '
                             'at the start of a round; rounds of 65 s did not recover)')
    parser.add_argument('--select-episodes', type=int, default=0,
                        help='after each round, drive this many validation episodes (seeds '
                             f'{VALIDATION_SEED0} on, meaning eviction at --select-capacity) '
                             'and export the round that reached most goals, not the last '
                             '(0: off). Closed-loop success moved by 0.3-0.4 between runs '
                             'whose losses differed by 0.06')
    parser.add_argument('--select-capacity', type=int, default=256)
    parser.add_argument('--init', default=None, metavar='MODEL',
                        help='start from this checkpoint, its weights and its tokenizer, '
                             'instead of from scratch (e.g. DAgger rounds or '
                             '--keyframe-weight on the shipped model, which from-scratch '
                             'retrains have not matched)')
    parser.add_argument('--distractor-weight', type=float, default=None,
                        help='loss weight factor of a tick whose target is 30 deg or more off '
                             'the heading while another object lies within 15 deg of it '
                             '(default: none). The shipped policy turns toward the target '
                             'on 26-30%% of its own such ticks, the expert on 72-81%%')
    parser.add_argument('--size', default=None, metavar='HIDDEN,LAYERS,HEADS,INTERMEDIATE',
                        help='model shape of a from-scratch run (default: '
                             f"{MODEL['hidden_size']},{MODEL['num_hidden_layers']},"
                             f"{MODEL['num_attention_heads']},{MODEL['intermediate_size']}; "
                             'head_dim 32 and two key/value heads either way). The shipped '
                             "policy's loss stays near 0.3 nats a token on labels that are "
                             'a function of its context: a capacity test')
    parser.add_argument('--keyframe-weight', type=float, default=None,
                        help='loss weight of a tick whose label differs from the command '
                             'executed the tick before (others weigh 1; default: no '
                             'weights: the model loss as it is). The shipped policy repeats '
                             'its last turn rate where the expert would change it')
    parser.add_argument('--inputs', default=None, metavar='TOPIC[,TOPIC...]',
                        help='the demo inputs the policy sees (default: all of them, '
                             f"{','.join(s.topic for s in INPUTS)}); e.g. without /odom, "
                             'whose measured turn rate the shipped policy copies into a spin '
                             'in place (docs/history.md). Recorded in training.json, '
                             'which rt-llm-eval reads')
    parser.add_argument('--object-tokens', action='store_true',
                        help="a from-scratch tokenizer that keeps each object name (' red "
                             "box') one token, in the instruction and in the detections: the "
                             'shipped policy, with a colour and a shape token each, turns '
                             'toward objects that share one of the two with the target '
                             '(docs/history.md), with or without its action history')
    parser.add_argument('--aim', action='store_true',
                        help="actions start with the plan field '_aim' (task.AIM_FIELD): the "
                             "policy first states the instructed object's bearing, labelled "
                             'by the expert, then v and w. Finding the target among the '
                             'detections gets a label of its own instead of being learned '
                             'through the turn rate only (the shipped policy turns to the '
                             'target with another object ahead on 0.26 of such ticks, the '
                             'expert 0.94); never published, recorded in training.json')
    parser.add_argument('--aim-noise', type=float, default=45.0, metavar='DEG',
                        help='with --aim: std (deg) of the noise on the aim the context shows '
                             'for each tick, a random aim on a quarter of them (the label '
                             "stays the expert's). 0 shows the expert's aim, which the policy "
                             'then copies from the tick before instead of finding the target; '
                             'at run time it copies its own wrong ones (stated aims within 15 '
                             'deg of the expert on 15-44%% of ticks)')
    parser.add_argument('--counterfactual', type=float, default=0.0, metavar='P',
                        help='the share of training contexts whose instruction names an '
                             'object in view drawn uniformly (the real target among them), '
                             'every tick labelled with the expert command '
                             'for that instruction (a function of the instruction, the newest '
                             'observation and the last command, so the '
                             'label is exact). Without it a policy can steer at the object '
                             'it heads for and still fit most ticks: an aiming policy, '
                             'given only its newest observation, named the target on 4%% of '
                             'closed-loop ticks with another object ahead, on 82%% with that '
                             'object removed from the detections (docs/history.md)')
    parser.add_argument('--sparse-detections', type=float, default=0.0, metavar='P',
                        help='the share of training contexts whose newest detections line '
                             'shows only the instructed object and 0-2 others (labels stay '
                             "exact: the expert reads only the instructed object's "
                             'detection). A fresh model matches the instructed object among '
                             'two or three within ~1000 steps, among six not in 6000 '
                             '(docs/history.md)')
    parser.add_argument('--lookup-first', type=int, default=0, metavar='STEPS',
                        help='with --aim: before round 0, at most STEPS steps of the lookup '
                             'alone: the instruction drawn over the objects in view, only it '
                             'and the newest detections rendered, only the aim supervised, '
                             f'at least {LOOKUP_BATCH} a batch, a constant rate of {LOOKUP_LR}; '
                             f'ends once the aim is right on {LOOKUP_DONE} of held-out such '
                             'contexts. A fresh model learns that in ~1500 steps of 256 '
                             '(H200, 96 s), and with the scan and odometry between not in '
                             '2500 (docs/history.md)')
    parser.add_argument('--lookup-share', type=float, default=0.0, metavar='P',
                        help='after --lookup-first, the share of every batch that stays '
                             'lookup contexts (keeps the skill in the mix)')
    parser.add_argument('--meaning-share', type=float, default=0.0, metavar='P',
                        help='the share of training contexts rendered as a meaning cache of '
                             f'{"/".join(map(str, MEANING_BUDGETS))} tokens holds them once '
                             "full: the newest tick's observations, the instruction and older "
                             'actions thinned, no older observation; their newest tick is '
                             f'supervised at {MEANING_WEIGHT:g}x weight. The demo runs '
                             'meaning at 256 tokens; alone these contexts kept 89%% of the '
                             'full-cache success there, as retrains without them did (81%%, '
                             '89%%); with --stale-ticks 8, 105%% (docs/history.md)')
    parser.add_argument('--stale-ticks', type=int, default=0, metavar='N',
                        help='with --meaning-share: in those contexts the observations of the '
                             'N newest older ticks whose action is shown stay in the '
                             "sequence, seen only by their own tick's tokens: the keys and "
                             'values of a kept action carry what it saw when encoded, as in '
                             "the engine's compacted cache (build_sample, stale); those "
                             'ticks are supervised too')
    parser.add_argument('--kv-heads', type=int, default=None,
                        help='key/value heads of a from-scratch model (default: '
                             f"{MODEL['num_key_value_heads']}, grouped-query attention; the "
                             'head count for one key per query head). Finding the instructed '
                             "object's bearing in the newest detections line is a lookup an "
                             'aiming policy states wrongly on most ticks (docs/history.md, stop '
                             '23), and two keys a layer leave it few patterns to look up with')
    parser.add_argument('--short-first', type=int, default=0, metavar='STEPS',
                        help="round 0's first STEPS steps draw only the shortest context "
                             f'budgets ({BUDGETS[0]} and {BUDGETS[1]} tokens), where the '
                             'instruction and the newest observation lie close together, '
                             'before the full mix: a curriculum for the lookup above')
    parser.add_argument('--online-dagger', type=float, default=None, metavar='START',
                        help='DAgger during one continuous training run instead of rounds: '
                             'from this fraction of the training time on, --dagger-workers '
                             'processes keep rolling out the newest weights on '
                             '--dagger-episodes fresh seeds at a time, the expert labels the '
                             'states reached, and the episodes join the training data as '
                             'they land (no optimizer restart, no GPU idle during rollouts; '
                             'rounds restarted a one-cycle schedule, and the loss jumped '
                             '0.38 -> 0.51). Excludes --dagger-rounds')
    parser.add_argument('--dagger-workers', type=int, default=None,
                        help='rollout processes of --online-dagger (default: half of --workers; '
                             '--workers stays the number of batch builders)')
    parser.add_argument('--dagger-ticks', type=int, default=300,
                        help='ticks per rollout (the first goal or two)')
    parser.add_argument('--dagger-capacity', type=int, default=1024,
                        help='KV budget of the rollouts (1024: the full cache, where the '
                             'shipped policy fails)')
    args = parser.parse_args()
    dagger_models = [m for m in (args.dagger or '').split(',') if m]
    if args.init:
        # an --init run goes on in the checkpoint's own action grammar and inputs (as with its
        # tokenizer): an aiming policy taught actions without the aim first starts at a loss
        # of ~5 instead of ~0.2
        if not Path(args.init, 'config.json').is_file():
            parser.error(f'--init {args.init}: no checkpoint there (config.json missing)')
        args.aim = args.aim or model_aim(args.init)
        if args.inputs is None:
            args.inputs = ','.join(spec.topic for spec in model_inputs(args.init))
    shape = dict(MODEL)
    assert shape['vocab_size'] <= np.iinfo(np.int16).max   # batches carry ids as int16
    if args.size is not None:
        try:
            hidden, layers, heads, inter = (int(v) for v in args.size.split(','))
        except ValueError:
            parser.error(f'--size wants four integers HIDDEN,LAYERS,HEADS,INTERMEDIATE, got '
                         f'{args.size!r}')
        if args.init or min(hidden, layers, heads, inter) <= 0 or heads % 2 \
                or heads * shape['head_dim'] != hidden:
            parser.error(f'--size {args.size}: needs no --init, positive values, an even '
                         f'head count and HIDDEN = HEADS x {shape["head_dim"]}')
        shape.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=inter)
    if args.kv_heads is not None:
        heads = shape['num_attention_heads']
        if args.init or args.kv_heads <= 0 or heads % args.kv_heads:
            parser.error(f'--kv-heads {args.kv_heads}: needs no --init and a divisor of the '
                         f'head count ({heads})')
        shape['num_key_value_heads'] = args.kv_heads
    if not (args.aim_noise >= 0 and np.isfinite(args.aim_noise)):
        parser.error(f'--aim-noise must be a finite std >= 0, got {args.aim_noise}')
    if not 0.0 <= args.counterfactual <= 1.0:
        parser.error(f'--counterfactual must be a share in [0, 1], got {args.counterfactual}')
    if not 0.0 <= args.sparse_detections <= 1.0:
        parser.error(f'--sparse-detections must be a share in [0, 1], got '
                     f'{args.sparse_detections}')
    if not 0.0 <= args.meaning_share < 1.0:
        parser.error(f'--meaning-share must be a share in [0, 1), got {args.meaning_share}')
    if args.stale_ticks < 0 or (args.stale_ticks and not args.meaning_share):
        parser.error('--stale-ticks must be >= 0 and needs --meaning-share (its contexts)')
    if args.lookup_first < 0 or not 0.0 <= args.lookup_share < 1.0:
        parser.error('--lookup-first must be a step count >= 0 and --lookup-share a share in '
                     '[0, 1)')
    if (args.lookup_first or args.lookup_share) and not args.aim:
        parser.error('--lookup-first/--lookup-share supervise the stated aim: they need --aim')
    if args.short_first < 0:
        parser.error(f'--short-first must be a step count >= 0, got {args.short_first}')
    if args.inputs is not None:
        try:
            args.inputs = [spec.topic for spec in demo_inputs(
                [t for t in args.inputs.split(',') if t])]
        except ValueError as err:
            parser.error(f'--inputs: {err}')
    if args.object_tokens and args.init:
        parser.error('--object-tokens trains a new tokenizer: not with --init (whose '
                     'tokenizer the checkpoint was trained with)')
    if args.online_dagger is not None:
        if args.dagger_rounds or not 0.0 <= args.online_dagger < 1.0 \
                or args.max_minutes is None:
            parser.error('--online-dagger START wants 0 <= START < 1, --max-minutes (its '
                         'schedule runs on the clock) and no --dagger-rounds')
        args.dagger_workers = args.dagger_workers or max(1, args.workers // 2)
    for name in ('keyframe_weight', 'distractor_weight'):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    # training and DAgger seeds run up from seed * 100000; they must stay below the
    # validation seeds (when selecting) and the held-out ones
    last = (args.seed * 100000 + args.episodes
            + (args.dagger_rounds + len(dagger_models)) * args.dagger_episodes)
    if args.online_dagger is not None:   # each iteration takes fresh seeds, up to a bound
        last += ONLINE_DAGGER_MAX_ITERATIONS * args.dagger_episodes
    limit = VALIDATION_SEED0 if args.select_episodes else HELD_OUT_SEED0
    if args.seed < 0 or last > limit:
        which = 'validation' if args.select_episodes else 'held-out'
        parser.error(f'--seed {args.seed} with these episode counts uses seeds up to '
                     f'{last - 1}, which reach the {which} seeds ({limit} on)')
    import torch
    import transformers
    started = time.time()
    torch.manual_seed(args.seed)
    seeds = list(range(args.seed * 100000, args.seed * 100000 + args.episodes))
    # the expert episodes use every core (with --online-dagger, --workers builders and
    # --dagger-workers rollouts share them later; --workers 6 here took 167 s instead of 64)
    with ProcessPoolExecutor(max(args.workers, os.cpu_count() or 1)) as pool:
        if args.init:   # the checkpoint's own token ids
            tokenizer = Tokenizer.from_file(str(Path(args.init) / 'tokenizer.json'))
        else:
            texts = [line for lines in pool.map(_texts, [(s, args.inputs) for s in seeds[:200]])
                     for line in lines]
            tokenizer = train_tokenizer(texts, MODEL['vocab_size'],
                                        whole_words=whole_words(args.aim),
                                        phrases=object_phrases() if args.object_tokens else ())
        tokenizer_json = tokenizer.to_str()
        noisy = ((args.noise_v, args.noise_w), args.hold_rate)
        jobs = [(s, tokenizer_json, *(noisy if i % 4 else ((0.0, 0.0), 0.0)), None,
                 (args.inputs, args.aim, args.aim_noise, _alternatives(args)))
                for i, s in enumerate(seeds)]
        first = seeds[-1] + 1
        episodes = _with_goal_starts(list(pool.map(_episode, jobs, chunksize=8)))
        # three clean validation episodes with counterfactual labels: the stated aim with
        # the instruction drawn, on held-out contexts (--lookup-first's stop, every round)
        held_episodes = _with_goal_starts(list(pool.map(_episode, [
            (VALIDATION_SEED0 + i, tokenizer_json, (0.0, 0.0), 0.0, None,
             (args.inputs, True, args.aim_noise, True)) for i in range(3)]))) \
            if args.aim else []
        rollout_s = None
        if dagger_models:   # each on its own seeds: the data of every earlier iteration
            t0 = time.time()
            new, first = _dagger_episodes(pool, dagger_models, first, args, tokenizer_json)
            episodes += new
            rollout_s = (time.time() - t0) / len(dagger_models)
            print(f'DAgger: {args.dagger_episodes} rollouts of each of {dagger_models}, '
                  f'{time.time() - t0:.0f} s', flush=True)
        dagger_end = first   # the seeds of later rounds start here
    data_s = time.time() - started
    clean = [e for i, e in enumerate(episodes[:len(seeds)]) if i % 4 == 0]
    n_ticks = sum(len(e.ticks) for e in episodes)
    print(f'{len(episodes)} episodes, {n_ticks} ticks, expert success on clean episodes '
          f'{success_rate([r for e in clean for r in e.results]):.3f}, data {data_s:.0f} s',
          flush=True)
    system = system_ids(tokenizer)
    args.sparse = None
    if args.sparse_detections:
        args.sparse = (args.sparse_detections,
                       SparseDetections(tokenizer, demo_inputs(args.inputs)))
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.init:
        model = transformers.LlamaForCausalLM.from_pretrained(
            args.init, dtype=torch.float32).to(device)
    else:
        config = transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None)
        model = transformers.LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    held = {}
    if held_episodes:
        # held-out contexts with the instruction drawn over the objects in view
        held = {'lookup': draw_contexts(np.random.default_rng(1), held_episodes, system,
                                        LOOKUP_BUDGET, 200, lookup=True, device=device),
                'drawn_256': draw_contexts(np.random.default_rng(1), held_episodes, system,
                                           256, 200, device=device)}
    lookup_record = None
    if args.lookup_first:
        lookup_record = _lookup_stage(model, episodes, system, args, device, held['lookup'])
    # Under --max-minutes each round's one-cycle schedule follows whichever runs out first,
    # its steps or its share of the time left (15 s kept for the export, and the expected
    # rollouts of the rounds still to come), so a run cut by the clock ends annealed.
    end_by = None if args.max_minutes is None else started + 60.0 * args.max_minutes - 15.0
    # before any rollout was timed, a fifth of the time is set aside for all of them (a
    # fifth for each round once starved round 0: 18 s of 490 with --dagger-rounds 4)
    if not rollout_s and end_by is not None and args.dagger_rounds:
        rollout_s = 0.2 * (end_by - time.time()) / args.dagger_rounds
    # and a twentieth of it for each round's validation, until the first one is timed
    validate_s = 0.0
    if args.select_episodes and end_by is not None:
        validate_s = 0.05 * (end_by - time.time()) / (1 + args.dagger_rounds)
    best = None   # (success, round, weights) of the best validated round
    rounds = []
    for round_ in range(1 + args.dagger_rounds):
        if round_:   # DAgger: the model of the round before drives, the expert labels
            t0 = time.time()
            with tempfile.TemporaryDirectory() as tmp:
                _export(model, tokenizer, tmp, args.inputs, args.aim)
                with ProcessPoolExecutor(args.workers, mp_context=_FORK) as pool:
                    new, next_seed = _dagger_episodes(pool, [tmp], first, args,
                                                      tokenizer_json)
            episodes += new
            rollout_s = time.time() - t0
            rounds[-1]['rollouts'] = {'episodes': len(new), 'seconds': round(rollout_s, 1),
                                      'seeds': [first, next_seed - 1]}
            first = next_seed
            print(f'DAgger round {round_}: {len(new)} rollouts of the round-{round_ - 1} '
                  f'model, {rollout_s:.0f} s', flush=True)
        seconds = None
        if end_by is not None:
            left = 1 + args.dagger_rounds - round_
            seconds = (end_by - time.time() - (rollout_s or 0.0) * (left - 1)
                       - validate_s * left) / left
            if seconds <= 0:
                sys.exit(f'--max-minutes {args.max_minutes}: no time left for round {round_}')
        online = None
        if args.online_dagger is not None:
            online = _OnlineDagger(tokenizer, args, first, tokenizer_json)
        try:
            rounds.append(_train_round(model, episodes, system, args, round_, seconds, device,
                                       started, online))
        finally:
            if online is not None:
                online.close()
        if online is not None:
            rounds[-1]['online_dagger'] = online.record()
            first = online.first
        if held:   # does the round keep (or find) the lookup?
            rounds[-1]['aim_drawn'] = {key: round(aim_accuracy(model, *contexts), 3)
                                       for key, contexts in held.items()}
            print(f'round {round_}: stated aim with the instruction drawn '
                  f"{rounds[-1]['aim_drawn']}", flush=True)
        if args.select_episodes:
            t0 = time.time()
            success = _validation(model, tokenizer, args)
            validate_s = time.time() - t0
            rounds[-1]['validation'] = {
                'success': round(success, 4), 'episodes': args.select_episodes,
                'capacity': args.select_capacity, 'seeds': [
                    VALIDATION_SEED0, VALIDATION_SEED0 + args.select_episodes - 1],
                'seconds': round(validate_s, 1)}
            print(f'round {round_}: validation success {success:.3f} at '
                  f'{args.select_capacity} tokens, {validate_s:.0f} s', flush=True)
            if best is None or success >= best[0]:   # a tie goes to the later round
                best = (success, round_, copy.deepcopy(model.state_dict()))
    if best is not None:
        model.load_state_dict(best[2])
        print(f'exporting round {best[1]} (validation success {best[0]:.3f})', flush=True)
    out = Path(args.out)
    _export(model, tokenizer, out)
    ticks = sum(len(e.ticks) for e in episodes)
    record = {
        'command': 'python training/train.py ' + ' '.join(sys.argv[1:]),
        'seed': args.seed, 'train_seeds': [seeds[0], seeds[-1]], 'episodes': len(episodes),
        'dagger': None if not dagger_models else {
            'models': dagger_models, 'episodes_per_model': args.dagger_episodes,
            'ticks': args.dagger_ticks, 'capacity': args.dagger_capacity,
            'seeds': [seeds[-1] + 1, dagger_end - 1]},
        'dagger_rounds': args.dagger_rounds,
        'online_dagger': None if args.online_dagger is None else {
            'start': args.online_dagger, 'workers': args.dagger_workers,
            'episodes_per_iteration': args.dagger_episodes, 'ticks': args.dagger_ticks,
            'capacity': args.dagger_capacity,
            'note': 'the batches depend on when each iteration landed: not bit-reproducible'},
        'ticks': ticks, 'tokens_seen': sum(r['tokens_seen'] for r in rounds),
        'steps': sum(r['steps'] for r in rounds),
        'skipped_steps': sum(r['skipped_steps'] for r in rounds),
        'steps_planned': args.steps * len(rounds), 'rounds': rounds,
        'schedule': ('one-cycle over the steps of each round' if end_by is None else
                     'one-cycle over the steps or the time share of each round, what ends '
                     'first'),
        'batch': args.batch, 'lr': args.lr, 'dagger_lr': args.dagger_lr or args.lr,
        'parameters': n_params,
        'noise': [args.noise_v, args.noise_w], 'hold_rate': args.hold_rate,
        'keyframe_weight': args.keyframe_weight, 'distractor_weight': args.distractor_weight,
        # the tokenizer's: an --init run keeps the checkpoint's
        'object_tokens': args.object_tokens or bool(args.init and model_object_tokens(args.init)),
        'inputs': [spec.topic for spec in demo_inputs(args.inputs)],
        'aim': args.aim, 'aim_noise': args.aim_noise if args.aim else None,
        'counterfactual': args.counterfactual,
        'sparse_detections': args.sparse_detections,
        'lookup_first': args.lookup_first, 'lookup_share': args.lookup_share,
        'lookup_stage': lookup_record,
        'meaning_share': args.meaning_share,
        'meaning_contexts': None if not args.meaning_share else {
            'budgets': list(MEANING_BUDGETS), 'weight': MEANING_WEIGHT,
            'stale_ticks': args.stale_ticks},
        'dagger_capacity': args.dagger_capacity if args.dagger_rounds else None,
        'kv_heads': model.config.num_key_value_heads, 'short_first': args.short_first,
        'init': args.init,
        'selected_round': None if best is None else best[1],
        'final_loss': rounds[-1 if best is None else best[1]]['final_loss'],
        'wall_s': round(time.time() - started, 1),
        'device': torch.cuda.get_device_name() if device == 'cuda' else 'cpu',
        'torch': torch.__version__, 'transformers': transformers.__version__,
    }
    (out / 'training.json').write_text(json.dumps(record, indent=2) + '\n')
    print(json.dumps(record))


_FORK = multiprocessing.get_context('fork')


def _alternatives(args):
    """Whether the episodes carry counterfactual labels (``expert_episode``).

    For --counterfactual and for the lookup contexts, which draw the instruction.
    """
    return args.counterfactual > 0 or args.lookup_first > 0 or args.lookup_share > 0


def _with_goal_starts(episodes):
    for episode in episodes:
        episode.goal_starts = [t for t, tick in enumerate(episode.ticks)
                               if any(s[0] == 'instruction' for s in tick.segments)]
    return episodes


def _dagger_episodes(pool, models, first, args, tokenizer_json):
    """Each model drives ``--dagger-episodes`` seeds of its own from ``first`` on.

    The expert labels every state reached. Returns (episodes, the next unused seed).
    """
    jobs = []
    for model in models:
        rollouts = [(seed, executed) for seed, executed, _, _ in pool.map(_drive, [
            (model, seed, args.dagger_capacity, args.dagger_ticks)
            for seed in range(first, first + args.dagger_episodes)])]
        first += args.dagger_episodes
        # rendered with this run's inputs, whatever the driving model saw
        jobs += [(seed, tokenizer_json, (0.0, 0.0), 0.0, executed,
                  (args.inputs, args.aim, args.aim_noise, _alternatives(args)))
                 for seed, executed in rollouts]
    return _with_goal_starts(list(pool.map(_episode, jobs, chunksize=8))), first


ONLINE_DAGGER_MAX_ITERATIONS = 64   # bounds the seeds --online-dagger may take


class _OnlineDagger:
    """DAgger beside the training loop.

    Rollouts of a snapshot of the weights on ``--dagger-episodes`` fresh seeds in
    ``--dagger-workers`` forked processes, then the expert's labels of the states reached
    (``_episode`` with ``executed``), then the next iteration from the newest weights. ``poll``
    never waits.
    """

    def __init__(self, tokenizer, args, first, tokenizer_json):
        self.tokenizer, self.args, self.first = tokenizer, args, first
        self.tokenizer_json = tokenizer_json
        self.pool = None
        self.tmp = tempfile.TemporaryDirectory()
        self.iterations = []
        self.rollouts = self.labels = None
        self.exhausted = False

    def _launch(self, model):
        if len(self.iterations) >= ONLINE_DAGGER_MAX_ITERATIONS:   # the seeds allowed for
            self.exhausted = True
            return
        if self.pool is None:   # forked on first use: the builders are running by then
            # niced: the training loop is one Python thread launching GPU work, and with
            # rollouts on every core it ran 25 steps a second instead of 35 (H200 host)
            self.pool = ProcessPoolExecutor(self.args.dagger_workers, mp_context=_FORK,
                                            initializer=os.nice, initargs=(10,))
        path = str(Path(self.tmp.name) / f'iteration{len(self.iterations)}')
        _export(model, self.tokenizer, path, self.args.inputs, self.args.aim)
        seeds = range(self.first, self.first + self.args.dagger_episodes)
        self.first += self.args.dagger_episodes
        self.started = time.time()
        self.seeds = seeds
        self.rollouts = [self.pool.submit(_drive, (path, seed, self.args.dagger_capacity,
                                                   self.args.dagger_ticks)) for seed in seeds]
        self.labels = None

    def poll(self, model):
        """Collect the newest labelled episodes.

        The newest iteration's labelled episodes once it is done (and the next one launched from
        ``model``), else [].
        """
        if self.exhausted:
            return []
        if self.rollouts is None:
            self._launch(model)
            return []
        if self.labels is None:
            if not all(f.done() for f in self.rollouts):
                return []
            driven = [f.result() for f in self.rollouts]
            self.goals = (sum(r[2] for r in driven), sum(r[3] for r in driven))
            self.labels = [self.pool.submit(_episode, (seed, self.tokenizer_json, (0.0, 0.0),
                                                       0.0, executed,
                                                       (self.args.inputs, self.args.aim,
                                                        self.args.aim_noise,
                                                        _alternatives(self.args))))
                           for seed, executed, _, _ in driven]
            return []
        if not all(f.done() for f in self.labels):
            return []
        episodes = _with_goal_starts([f.result() for f in self.labels])
        record = {'seeds': [self.seeds[0], self.seeds[-1]],
                  'rollout_goals': list(self.goals), 'ticks': sum(len(e.ticks) for e in episodes),
                  'seconds': round(time.time() - self.started, 1)}
        self.iterations.append(record)
        print(f'online DAgger iteration {len(self.iterations)}: {len(episodes)} episodes, '
              f'{record["ticks"]} ticks, the snapshot reached {self.goals[0]} / '
              f'{self.goals[1]} goals ({self.args.dagger_ticks} ticks at '
              f'{self.args.dagger_capacity} tokens), {record["seconds"]} s', flush=True)
        self._launch(model)
        return episodes

    def record(self):
        return {'iterations': self.iterations,
                'episodes': len(self.iterations) * self.args.dagger_episodes}

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.tmp.cleanup()


def _validation(model, tokenizer, args):
    """Goal success of ``model`` over the validation episodes (forked numpy workers)."""
    with tempfile.TemporaryDirectory() as tmp:
        _export(model, tokenizer, tmp, args.inputs, args.aim)
        jobs = [(tmp, VALIDATION_SEED0 + i, args.select_capacity, None)
                for i in range(args.select_episodes)]
        with ProcessPoolExecutor(args.workers, mp_context=_FORK) as pool:
            results = list(pool.map(_drive, jobs))
    return sum(r[2] for r in results) / max(1, sum(r[3] for r in results))


def _export(model, tokenizer, path, inputs=None, aim=False, object_tokens=False):
    """Return an HF-layout checkpoint (bf16) of ``model``, which stays as it is.

    ``inputs`` (topics) and ``aim``: recorded in its training.json, where rollouts and rt-llm-eval
    read them; ``object_tokens``: recorded too (its tokenizer keeps each object name one token,
    which an --init run from it inherits).
    """
    import torch
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to('cpu').to(torch.bfloat16).save_pretrained(path)
    tokenizer.save(str(path / 'tokenizer.json'))
    for extra in ('generation_config.json',):
        if (path / extra).exists():
            (path / extra).unlink()
    if inputs is not None or aim or object_tokens:
        record = {'inputs': list(inputs)} if inputs is not None else {}
        record.update({'aim': True} if aim else {})
        record.update({'object_tokens': True} if object_tokens else {})
        (path / 'training.json').write_text(json.dumps(record) + '\n')


def aim_accuracy(model, ids, labels):
    """Measure how often the stated aim is right.

    Share of contexts (right-padded [batch, width] tensors) whose newest stated aim is the arg-max
    of the model, teacher-forced: the fourth-last label of a full action (aim, v, w, newline) or
    the one label of a lookup context.
    """
    import torch
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    right = 0
    for b in range(ids.shape[0]):
        taught = (labels[b] != -100).nonzero().flatten()
        at = int(taught[-1] if len(taught) == 1 else taught[-4])
        right += int(logits[b, at - 1].argmax() == labels[b, at])
    return right / ids.shape[0]


def draw_contexts(rng, episodes, system, budget, size, counterfactual=1.0, lookup=False,
                  sparse=None, device='cpu', transform=None):
    """Draw held-out contexts.

    (ids, labels) int64 tensors, right-padded, of up to ``size`` contexts, each ending at a random
    tick after the first instruction of one of ``episodes`` and kept only where its newest tick
    fits ``budget`` (``build_sample``: ``counterfactual``, ``lookup``, ``sparse``);
    ``transform(ids, labels)`` rewrites each kept one. Fewer than ``size`` only where 50 draws a
    context found none to fit (a short budget); none: ValueError.
    """
    import torch
    rows = []
    for _ in range(50 * size):
        if len(rows) == size:
            break
        episode = episodes[rng.integers(len(episodes))]
        end = int(rng.integers(episode.goal_starts[0] + 1, len(episode.ticks)))
        ids, labels, _ = build_sample(episode, system, end, budget, rng,
                                      counterfactual=counterfactual, sparse=sparse,
                                      lookup=lookup)
        if max(labels) != -100:   # the newest tick fit
            rows.append(transform(ids, labels) if transform else (ids, labels))
    if not rows:
        raise ValueError(f'no context fits {budget} tokens: the newest tick alone is longer')
    width = max(len(i) for i, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for b, (i, lab) in enumerate(rows):
        ids[b, :len(i)] = torch.tensor(i)
        labels[b, :len(lab)] = torch.tensor(lab)
    return ids.to(device), labels.to(device)


def _share_with_builders(episodes, system, args=None):
    """Share the episodes with the batch builders before they fork.

    Set what ``_build_batch`` reads (the episodes, the system prompt and, for a round, the batch
    options of ``args``; a lookup stage's contexts take none of them) and each episode's tick
    tables, before the builders fork: every builder inherits them.
    """
    global _EPISODES, _SYSTEM, _KEYFRAME, _DISTRACTOR, _SHORT_FIRST, _COUNTERFACTUAL, _SPARSE
    global _LOOKUP_SHARE, _MEANING_SHARE, _STALE
    _EPISODES, _SYSTEM = episodes, system
    if args is not None:
        _MEANING_SHARE = args.meaning_share
        _STALE = args.stale_ticks
        _SHORT_FIRST = args.short_first
        _SPARSE = args.sparse
        _LOOKUP_SHARE = args.lookup_share
        _COUNTERFACTUAL = args.counterfactual
        _KEYFRAME = 1.0 if args.keyframe_weight is None else args.keyframe_weight
        _DISTRACTOR = 1.0 if args.distractor_weight is None else args.distractor_weight
    for episode in episodes:
        _tick_tables(episode)


class _Steps:
    """Backward, clip and apply one loss.

    A non-finite loss or gradient is skipped, never applied (one such step turned every weight into
    NaN: batch 128, bf16, step 3088 of a GPU run), and 20 in a row end the run with nothing
    exported.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.in_a_row = self.skipped = 0

    def apply(self, loss, where):
        """Return the loss's value if applied, else None."""
        import torch
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        value = loss.item()
        if not (np.isfinite(value) and torch.isfinite(norm)):
            self.in_a_row += 1
            self.skipped += 1
            print(f'{where}: non-finite loss {value} or gradient norm {float(norm)}, '
                  f'skipped ({self.in_a_row} in a row)', flush=True)
            if self.in_a_row >= 20:
                sys.exit('training diverged: 20 non-finite steps in a row; nothing exported')
            return None
        self.in_a_row = 0
        self.optimizer.step()
        return value


def _lookup_stage(model, episodes, system, args, device, held):
    """Train the lookup alone before round 0.

    --lookup-first: before round 0, at most ``args.lookup_first`` steps of lookup contexts alone
    (``build_sample(lookup=True)``, the instruction drawn, at least LOOKUP_BATCH a step) at the
    constant LOOKUP_LR, ended once the aim is right on LOOKUP_DONE of ``held`` (held-out lookup
    contexts, checked every LOOKUP_EVERY steps). A fresh model sits at a guess for ~1000-1500 steps
    of 256, then finds the match at once (docs/history.md). Returns its record.
    """
    import torch
    _share_with_builders(episodes, system)
    size = max(args.batch, LOOKUP_BATCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LOOKUP_LR, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    stepper = _Steps(model, optimizer)
    started = time.time()
    curve, steps = [], 0
    builders = ProcessPoolExecutor(args.workers, mp_context=_FORK)
    try:
        ahead = deque(builders.submit(_build_batch, (args.seed, LOOKUP_STREAM, step, size))
                      for step in range(min(args.lookup_first, 2 * args.workers)))
        for step in range(args.lookup_first):
            ids, labels = (torch.from_numpy(a) for a in ahead.popleft().result()[:2])
            later = step + len(ahead) + 1
            if later < args.lookup_first:
                ahead.append(builders.submit(_build_batch,
                                             (args.seed, LOOKUP_STREAM, later, size)))
            ids, labels = (t.to(device).long() for t in (ids, labels))
            with torch.autocast(device_type=device, dtype=torch.bfloat16,
                                enabled=device == 'cuda'):
                loss = model(input_ids=ids, labels=labels).loss
            stepper.apply(loss, f'lookup step {step}')
            steps = step + 1
            if steps % LOOKUP_EVERY == 0 or steps == args.lookup_first:
                accuracy = aim_accuracy(model, *held)
                curve.append([steps, round(accuracy, 3)])
                print(f'lookup step {steps} loss {loss.item():.4f} held-out aim accuracy '
                      f'{accuracy:.2f} {time.time() - started:.0f} s', flush=True)
                if accuracy >= LOOKUP_DONE:
                    break
    finally:
        builders.shutdown(wait=True, cancel_futures=True)
    return {'steps': steps, 'batch': size, 'lr': LOOKUP_LR, 'accuracy': curve,
            'seconds': round(time.time() - started, 1)}


def weighted_loss(model, ids, attention, labels, weights, positions=None):
    """Cross-entropy of the next token at every labelled position, weighted.

    Sum(w * ce) / sum(w), with the same shift as the model's own loss (position i predicts label i
    + 1); all weights 1 give the model's own mean. ``attention``: None, a [batch, width] padding
    mask or a 4-D boolean one (``stale_mask``); ``positions``: the tokens' position ids.
    """
    import torch
    logits = model(input_ids=ids, attention_mask=attention,
                   position_ids=positions).logits[:, :-1].float()
    target, w = labels[:, 1:], weights[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           target.reshape(-1), ignore_index=-100,
                                           reduction='none')
    w = w.reshape(-1) * (target.reshape(-1) != -100)
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def _train_round(model, episodes, system, args, round_, seconds, device, started,
                 online=None):
    """One round of ``args.steps`` steps (or ``seconds``).

    Fresh AdamW and one-cycle schedule; batches built by forked workers (the episodes are
    inherited, not pickled), kept two per worker ahead of the GPU, which otherwise waited on
    Python.

    ``online`` (an ``_OnlineDagger``): polled every step from ``--online-dagger`` of the
    round's time on; the episodes it returns join ``episodes`` and the builders are forked
    again to inherit them (batches already queued come from the old ones).
    """
    import torch
    _share_with_builders(episodes, system, args)
    builders = ProcessPoolExecutor(args.workers, mp_context=_FORK)
    batches = deque(builders.submit(_build_batch, (args.seed, round_, step, args.batch))
                    for step in range(min(args.steps, 2 * args.workers)))
    peak = args.lr if round_ == 0 or args.dagger_lr is None else args.dagger_lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    # torch divides by the warm-up's length, pct_start * steps - 1, which is 0 at --steps 20
    pct_start = 0.05 if abs(0.05 * args.steps - 1.0) > 1e-9 else 2.0 / args.steps
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak,
                                                   total_steps=args.steps, pct_start=pct_start)
    train_started = time.time()
    losses = []
    tokens_seen = 0
    stepper = _Steps(model, optimizer)
    try:
        for step in range(args.steps):
            if seconds is not None:   # where the one-cycle schedule would be, by time or steps
                done = max(step / args.steps, (time.time() - train_started) / seconds)
                if done >= 1.0:
                    print(f'round {round_}: its time is up after {step} steps (last lr '
                          f"{optimizer.param_groups[0]['lr']:.2e})", flush=True)
                    break
                position = min(args.steps - 1, int(done * args.steps))
                for group, lr in zip(optimizer.param_groups,
                                     _one_cycle_lrs(schedule, position)):
                    group['lr'] = lr
            if online is not None and seconds is not None and \
                    time.time() - train_started >= args.online_dagger * seconds:
                new = online.poll(model)
                if new:
                    for episode in new:
                        _tick_tables(episode)
                    episodes += new
                    old, builders = builders, ProcessPoolExecutor(args.workers,
                                                                  mp_context=_FORK)
                    old.shutdown(wait=False)
            ids, labels, attention, weights, layout = batches.popleft().result()
            ids, labels, attention, weights = (torch.from_numpy(a)
                                               for a in (ids, labels, attention, weights))
            tokens_seen += int(attention.sum())
            if step + len(batches) + 1 < args.steps:
                batches.append(builders.submit(
                    _build_batch, (args.seed, round_, step + len(batches) + 1, args.batch)))
            ids, labels = (t.to(device).long() for t in (ids, labels))
            # no attention mask: the batches are right-padded, so under the causal mask no
            # real token sees a pad (same loss, test_training_data), and SDPA can take its
            # causal fast path instead of a padded 4-D mask; stale rows need theirs
            mask = positions = None
            if layout is not None:
                layout = torch.from_numpy(layout).to(device).long()
                positions = layout[0]
                mask = stale_mask(layout[1], layout[2], attention.to(device))
            with torch.autocast(device_type=device, dtype=torch.bfloat16,
                                enabled=device == 'cuda'):
                if args.keyframe_weight is not None or args.distractor_weight is not None \
                        or args.meaning_share:
                    loss = weighted_loss(model, ids, mask, labels, weights.to(device),
                                         positions)
                else:
                    loss = model(input_ids=ids, labels=labels).loss
            value = stepper.apply(loss, f'step {step}')
            if value is None:
                continue
            if seconds is None:   # else the rates (and momentum) are set from the position
                schedule.step()
            losses.append(value)
            if step % 200 == 0 or step == args.steps - 1:
                print(f'round {round_} step {step} width {ids.shape[1]} loss '
                      f'{np.mean(losses[-50:]):.4f} lr {optimizer.param_groups[0]["lr"]:.2e} '
                      f'{time.time() - started:.0f} s', flush=True)
    finally:
        builders.shutdown(wait=True, cancel_futures=True)
    if not losses:
        sys.exit(f'round {round_}: no step was applied; nothing exported')
    return {'round': round_, 'episodes': len(episodes), 'steps': len(losses),
            'skipped_steps': stepper.skipped, 'tokens_seen': tokens_seen,
            'seconds': round(time.time() - train_started, 1),
            'final_loss': float(np.mean(losses[-100:]))}


if __name__ == '__main__':
    main()
