"""How fast does a fresh demo policy learn to find the instructed object? A CPU learning curve.

    python training/lookup_stage.py --counterfactual 1.0 [--steps 600] [--budget 128]

Trains a fresh model of the demo policy's shape (training/train.py's MODEL) on the
contexts ``build_sample`` makes from ``--episodes`` expert episodes (DART noise, aim noise,
``--aim``), at one ``--budget`` (128: the instruction and the newest tick, no history),
and every 100 steps prints the stated aim's accuracy (teacher-forced arg-max) on 200
contexts of three validation seeds built the same way. ``--counterfactual 0``: the real
instruction, so the target can also be told from where the robot is heading (/odom, the
bearings); ``1``: an instruction drawn uniformly over the objects in view, so only the
instruction tells (docs/history.md). ``--model M --steps 0``: the same accuracy of a
trained aiming checkpoint (its tokenizer), no training. ``--shape KEY=VALUE`` (repeatable):
a fresh model of another shape (e.g. num_key_value_heads=6); ``--bearing-step N``: the
detector's bearings rounded to N degrees (WorldConfig.bearing_step_deg), for the world the
episodes are made in; ``--topics /instruction,/detections``: only those inputs rendered
(docs/history.md). Offline tooling: torch on the CPU.
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
import os
import time

import numpy as np

from rt_llm_node.demo.episodes import episode_texts
from rt_llm_node.demo.episodes import system_ids
from rt_llm_node.demo.task import demo_inputs
from rt_llm_node.demo.task import INPUTS
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.demo.task import model_object_tokens
from rt_llm_node.demo.task import object_phrases
from rt_llm_node.demo.task import whole_words
from rt_llm_node.demo.world import WorldConfig
from rt_llm_node.model import load_checkpoint
from tokenizer import train_tokenizer
from train import _episode
from train import _export
from train import _with_goal_starts
from train import aim_accuracy
from train import draw_contexts
from train import MODEL
from train import SparseDetections
from train import VALIDATION_SEED0
from train import weighted_loss


def with_hint(ids, labels, hint):
    """``hint`` = (task id, act id, object ids).

    The instruction's object token put before every action prefix, unlabelled (what a plan field
    naming the target first would show).
    """
    task, act, objects = hint
    start = ids.index(task)
    target = next(t for t in ids[start:] if t in objects)
    out_ids, out_labels = [], []
    for t, lab in zip(ids, labels):
        if t == act:
            out_ids.append(target)
            out_labels.append(-100)
        out_ids.append(t)
        out_labels.append(lab)
    return out_ids, out_labels


def batch(rng, episodes, size, system, budget, counterfactual, hint=None, sparse=None,
          device='cpu'):
    """(ids, labels) int64 tensors of ``size`` contexts ending at random ticks of a goal."""
    try:
        return draw_contexts(rng, episodes, system, budget, size, counterfactual,
                             sparse=sparse, device=device,
                             transform=None if hint is None else
                             lambda ids, labels: with_hint(ids, labels, hint))
    except ValueError as err:
        raise SystemExit(f'--budget {budget}: {err} (every input rendered needs about 128 '
                         'tokens; 48 fits --topics /instruction,/detections)') from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--counterfactual', type=float, default=1.0)
    parser.add_argument('--budget', type=int, default=128)
    parser.add_argument('--steps', type=int, default=600)
    parser.add_argument('--every', type=int, default=100, help='steps between accuracies')
    parser.add_argument('--batch', type=int, default=32)
    parser.add_argument('--lr', type=float, default=1e-3)
    parser.add_argument('--episodes', type=int, default=20)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--model', default=None, help='start from this checkpoint (--aim)')
    parser.add_argument('--target-hint', action='store_true',
                        help="put the instruction's object token before every action: the "
                             'lookup left is one token matched in the newest detections, '
                             'what a plan field naming the target before its bearing gives')
    parser.add_argument('--shape', action='append', default=[], metavar='KEY=VALUE',
                        help="a fresh model's shape: train.MODEL with this key "
                             'set to this integer (repeatable)')
    parser.add_argument('--bearing-step', type=int, default=1, metavar='DEG',
                        help="the detector's bearing resolution in the episodes' world")
    parser.add_argument('--sparse-detections', type=float, default=0.0, metavar='P',
                        help="train's --sparse-detections: the share of training "
                             'contexts whose newest detections line shows the instructed '
                             'object and 0-2 others; accuracy is then also printed on '
                             'contexts thinned so')
    parser.add_argument('--device', default='cpu', help='torch device (cuda on the GPU host)')
    parser.add_argument('--save', default=None, metavar='DIR',
                        help='export the trained model here (an aiming checkpoint that '
                             '--model reads: a second stage can go on from it, e.g. with '
                             'other --topics)')
    parser.add_argument('--topics', default=None, metavar='T1,T2',
                        help='render only these inputs (e.g. /instruction,/detections: the '
                             'lookup alone; the expert still reads every message)')
    args = parser.parse_args()
    shape = dict(MODEL)
    for item in args.shape:
        key, _, value = item.partition('=')
        if key not in MODEL or not value.isdigit():
            parser.error(f'--shape {item!r}: need KEY=INTEGER with KEY one of {sorted(MODEL)}')
        shape[key] = int(value)
    if not 1 <= args.bearing_step <= 90:
        parser.error('--bearing-step must be 1..90 degrees')
    world_config = WorldConfig(bearing_step_deg=args.bearing_step)
    import torch
    import transformers
    torch.manual_seed(args.seed)
    if args.topics:   # before the model's own inputs, which may be these (--save)
        try:
            inputs = demo_inputs(args.topics.split(','),
                                 required=('/instruction', '/detections'))
        except ValueError as err:
            parser.error(f'--topics: {err}')
    else:
        inputs = model_inputs(args.model) if args.model else INPUTS
    if args.model:
        if not model_aim(args.model):
            parser.error(f'{args.model} does not state an aim (its training.json has no "aim")')
        tokenizer = load_checkpoint(args.model).tokenizer
    else:
        texts = [line for seed in range(20) for line in episode_texts(seed)]
        tokenizer = train_tokenizer(texts, MODEL['vocab_size'], whole_words=whole_words(True),
                                    phrases=object_phrases())

    tokenizer_json = tokenizer.to_str()
    topics = [spec.topic for spec in inputs]

    def episodes(seeds, noisy):
        # one process a seed (the same episodes as in order: each is a function of its seed);
        # in one process the 43 episodes of a stage took ~1 min of the retrain's ~9
        noise = ((0.2, 0.6), 0.02) if noisy else ((0.0, 0.0), 0.0)
        jobs = [(s, tokenizer_json, *noise, None, (topics, True, 45.0, True), world_config)
                for s in seeds]
        with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1) or 1) as pool:
            return _with_goal_starts(list(pool.map(_episode, jobs)))
    train = episodes(range(args.episodes), True) if args.steps else []
    system = system_ids(tokenizer)
    hint = None
    if args.target_hint:
        found = [tokenizer.encode(p).ids for p in object_phrases()]
        if any(len(ids) != 1 for ids in found):
            parser.error('--target-hint needs one token an object name (not this tokenizer)')
        hint = (tokenizer.encode('task').ids[0], tokenizer.encode('act').ids[0],
                {ids[0] for ids in found})
    rng = np.random.default_rng(args.seed)
    sparse = None
    if args.sparse_detections:
        sparse = (args.sparse_detections, SparseDetections(tokenizer, inputs))
    held = episodes(range(VALIDATION_SEED0, VALIDATION_SEED0 + 3), False)
    test = batch(np.random.default_rng(1), held, 200, system, args.budget,
                 args.counterfactual, hint, device=args.device)
    sparse_test = None if sparse is None else batch(
        np.random.default_rng(1), held, 200, system, args.budget, args.counterfactual, hint,
        (1.0, sparse[1]), args.device)
    if args.model:
        model = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **shape, bos_token_id=None, eos_token_id=None))
    model = model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    started = time.time()
    thinned = '' if sparse is None else f' {"thinned":>8s}'
    print(f'{"step":>5s} {"aim accuracy":>12s}{thinned} {"loss":>6s} {"s":>5s}', flush=True)
    loss = float('nan')
    for step in range(args.steps + 1):
        if step % args.every == 0:
            shown = f'{aim_accuracy(model, *test):12.2f}'
            if sparse_test is not None:
                shown += f' {aim_accuracy(model, *sparse_test):8.2f}'
            print(f'{step:5d} {shown} {loss:6.3f} {time.time() - started:5.0f}', flush=True)
        if step == args.steps:
            break
        ids, labels = batch(rng, train, args.batch, system, args.budget, args.counterfactual,
                            hint, sparse, args.device)
        value = weighted_loss(model, ids, None, labels, (labels != -100).float())
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = float(value.detach())
    if args.save:
        # a fresh model's tokenizer keeps object names whole (object_phrases, above)
        _export(model, tokenizer, args.save, [spec.topic for spec in inputs], aim=True,
                object_tokens=not args.model or model_object_tokens(args.model))


if __name__ == '__main__':
    main()
