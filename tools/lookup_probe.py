"""Does a model of the demo policy's shape learn a lookup at all? A synthetic learning curve.

    python tools/lookup_probe.py --mode copy|bin [--objects 3,6] [--batch 256] [--steps 6000]

The demo policy must find the instructed object in the newest detections line and state
its bearing (tools/binding_curve.py). This strips that to token ids drawn at random, no
world and no tokenizer: ``task X / det O1 B1 D1 O2 B2 D2 ... / act`` -> the bearing token
of the object X (``copy``) or its 15-degree bin (``bin``, like the demo's aim), with 9
object ids, 361 bearing ids and 50 distance ids, and a fresh Llama of
tools/train_demo_policy.py's MODEL shape trained on the answer alone (AdamW, constant
rate, optional linear warm-up). Every ``--every`` steps it prints the arg-max accuracy on
1000 held-out contexts; one line at the end. A guess among the objects in view scores
about 1 / objects. Offline tooling: torch (``--device cuda`` on the GPU host); several
runs side by side fit on one GPU (BENCHMARKS.md, stop 26).
"""

import argparse
from pathlib import Path
import sys
import time

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_policy import MODEL  # noqa: E402  (tools/, beside this script)

OBJECTS, BEARINGS, DISTANCES, BINS = 9, 361, 50, 25
TASK, DET, ACT, NEWLINE = 1, 2, 3, 4
OBJECT0, BEARING0, DISTANCE0, BIN0 = 10, 20, 400, 500
VOCAB = 640


def sample(rng, args):
    """(ids, answer) of one context."""
    n = int(rng.integers(args.objects[0], args.objects[1] + 1))
    objects = rng.choice(OBJECTS, n, replace=False)
    bearings = rng.integers(0, BEARINGS, n)
    target = int(rng.integers(n))
    ids = [TASK, OBJECT0 + int(objects[target]), NEWLINE, DET]
    for o, b in zip(objects, bearings):
        ids += [OBJECT0 + int(o), BEARING0 + int(b)]
        if not args.no_distance:
            ids.append(DISTANCE0 + int(rng.integers(DISTANCES)))
    ids += [NEWLINE, ACT]
    bearing = int(bearings[target])   # 0..360 for -180..180 degrees
    if args.mode == 'copy':
        return ids, BEARING0 + bearing
    return ids, BIN0 + int(round((bearing - 180) / 15)) + BINS // 2


def batch(rng, args, size):
    """(ids, position of the answer's prediction, answer) tensors on ``args.device``."""
    import torch
    drawn = [sample(rng, args) for _ in range(size)]
    width = max(len(ids) for ids, _ in drawn)
    ids = torch.zeros(size, width, dtype=torch.long)
    at = torch.zeros(size, dtype=torch.long)
    answer = torch.zeros(size, dtype=torch.long)
    for row, (i, a) in enumerate(drawn):
        ids[row, :len(i)] = torch.tensor(i)
        at[row] = len(i) - 1
        answer[row] = a
    return ids.to(args.device), at.to(args.device), answer.to(args.device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--mode', choices=('copy', 'bin'), default='bin')
    parser.add_argument('--objects', default='3,6', metavar='MIN,MAX',
                        help='objects in the line, drawn uniformly')
    parser.add_argument('--no-distance', action='store_true', help='no distance tokens')
    parser.add_argument('--layers', type=int, default=MODEL['num_hidden_layers'])
    parser.add_argument('--kv-heads', type=int, default=MODEL['num_key_value_heads'])
    parser.add_argument('--steps', type=int, default=2000)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--lr', type=float, default=1e-3)
    parser.add_argument('--warmup', type=int, default=0, help='linear warm-up steps')
    parser.add_argument('--every', type=int, default=100)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    try:
        args.objects = tuple(int(v) for v in args.objects.split(','))
        if len(args.objects) != 2 or not 1 <= args.objects[0] <= args.objects[1] <= OBJECTS:
            raise ValueError
    except ValueError:
        parser.error(f'--objects wants MIN,MAX within 1..{OBJECTS}')
    import torch
    import transformers
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    shape = dict(MODEL, vocab_size=VOCAB, num_hidden_layers=args.layers,
                 num_key_value_heads=args.kv_heads)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **shape, bos_token_id=None, eos_token_id=None)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) if args.warmup else 1.0)
    test = batch(np.random.default_rng(10**6 + args.seed), args, 1000)
    started, curve = time.time(), []
    for step in range(args.steps + 1):
        if step % args.every == 0:
            with torch.no_grad():
                logits = model(input_ids=test[0]).logits[torch.arange(1000), test[1]]
            accuracy = float((logits.argmax(-1) == test[2]).float().mean())
            curve.append(f'{step}:{accuracy:.2f}')
            print(f'step {step:6d} accuracy {accuracy:.2f} {time.time() - started:5.0f} s',
                  flush=True)
        if step == args.steps:
            break
        ids, at, answer = batch(rng, args, args.batch)
        logits = model(input_ids=ids).logits[torch.arange(args.batch), at]
        loss = torch.nn.functional.cross_entropy(logits, answer)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    options = ' '.join(f'{k}={v}' for k, v in vars(args).items() if k not in ('every',))
    print(f'{options}: {" ".join(curve)}', flush=True)


if __name__ == '__main__':
    main()
