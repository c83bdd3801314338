"""Fine-tune a LoRA adapter for a base model from recorded rosbags.

    python training/finetune.py --params config/demo_smollm2.yaml --base MODEL \
        --bags BAG [BAG ...] --out ADAPTER [--steps 1500] [--device cuda] \
        [--holdout BAG ...] [--max-minutes M]

The bags hold the robot's inputs and the commands it was driven by (``rt-llm-demo-record
--commands`` for the demo's expert). Each recorded tick becomes a sample exactly as the node
would feed the model at that tick (``bag_samples.py``: the node's engine replays the bag with
the recorded actions in its cache; the attention the ``meaning`` policy evicts by comes from
the base model, run beside it on the node's own backend). The loss is the action's tokens
given the context, at the positions the cache's slots hold. The adapter is written as PEFT
saves it (``adapter_config.json``, ``adapter_model.safetensors``), with ``training.json``
(command, base and its sha256, bags, samples, steps, losses), and loads with
``adapter_path`` / ``--adapter``.

The learning rate warms up over the first 5% of the run and then falls on a cosine to 1e-4 of
its peak, the run's progress being its steps or, with ``--max-minutes``, its share of the time
left for training, whichever is further: a run cut by the clock still ends annealed.
``--holdout``: bags never trained on, their samples built as the node would feed the model
(no augmentation); the share of their actions the adapter gets exactly right (teacher-forced
greedy tokens, no grammar: what the node decodes when every token is right) is printed every
``--eval-every`` steps and at the end, and kept in training.json.

Offline tooling (torch, transformers, peft), best on a GPU; nothing here runs on the robot.
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
import json
import math
import multiprocessing
from pathlib import Path
import sys
import time

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rt_llm_node.backends import make_backend  # noqa: E402
from rt_llm_node.configure import action_grammar  # noqa: E402
from rt_llm_node.configure import verify_tokens  # noqa: E402
from rt_llm_node.files import file_sha256  # noqa: E402
from rt_llm_node.files import write_atomic  # noqa: E402
from rt_llm_node.model import load_model  # noqa: E402
from rt_llm_node.replay import load_params  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bag_samples import Augment  # noqa: E402,I100
from bag_samples import bag_samples  # noqa: E402

TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


_WORKER = {}


def _bag_job(job):
    """Return the samples of one bag in a worker.

    job: (bag, params, base, attention, Augment, seed, cache capacity or None: the params').
    """
    bag, params, base, attention, augment, seed, capacity = job
    values = load_params(params)
    if capacity:
        values['kv_capacity_tokens'] = capacity
    if 'checkpoint' not in _WORKER:   # one model a worker, for all its bags
        _WORKER['checkpoint'] = load_model(base)
    scorers = _WORKER.setdefault('scorers', {})   # and a backend a cache capacity
    capacity = values['kv_capacity_tokens']
    if attention == 'base' and capacity not in scorers:
        grammar = action_grammar(values, _WORKER['checkpoint'].tokenizer)
        scorers[capacity] = make_backend(values['backend'], _WORKER['checkpoint'], capacity,
                                         verify_tokens=verify_tokens(0, grammar))
    return bag_samples(bag, values, _WORKER['checkpoint'].tokenizer, scorers.get(capacity),
                       log=lambda text: print(f'  {bag}: {text}', flush=True),
                       augment=augment, seed=seed)


def hf_model(base, torch):
    """Return the base as a transformers model in float32 (a GGUF dequantized)."""
    import transformers
    base = Path(base)
    if base.suffix == '.gguf':
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(base.parent), gguf_file=base.name, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)


def batches(samples, batch, rng):
    """Yield lists of samples: shuffled, each epoch over all of them."""
    while True:
        order = rng.permutation(len(samples))
        for at in range(0, len(order) - batch + 1, batch):
            yield [samples[i] for i in order[at:at + batch]]


def collate(chunk, torch, device):
    """Right-padded ids, labels on the action tokens only, and their attention mask."""
    width = max(len(s.context) + len(s.action) for s in chunk)
    ids = np.zeros((len(chunk), width), np.int64)
    labels = np.full((len(chunk), width), -100, np.int64)
    mask = np.zeros((len(chunk), width), np.int64)
    for row, s in enumerate(chunk):
        n, m = len(s.context), len(s.action)
        ids[row, :n], ids[row, n:n + m] = s.context, s.action
        labels[row, n:n + m] = s.action
        mask[row, :n + m] = 1
    return (torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device),
            torch.from_numpy(mask).to(device))


def lr_factor(progress, warmup=0.05, start=1 / 25, end=1e-4):
    """Return the learning rate's share of its peak at ``progress`` in [0, 1] of the run."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return start + (1.0 - start) * progress / warmup
    return end + (1.0 - end) * 0.5 * (1.0 + np.cos(np.pi * (progress - warmup) / (1 - warmup)))


def evenly(samples, n):
    """Up to ``n`` of ``samples``, spread evenly over them (the first always in)."""
    if len(samples) <= n:
        return list(samples)
    return [samples[i] for i in np.linspace(0, len(samples) - 1, n).round().astype(int)]


def holdout_accuracy(model, samples, torch, device, batch=32):
    """Return (share of actions exactly right, share of action tokens right), teacher-forced."""
    exact = right = tokens = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for at in range(0, len(samples), batch):
            chunk = samples[at:at + batch]
            ids, labels, mask = collate(chunk, torch, device)
            with torch.autocast('cuda', torch.bfloat16, enabled=device.startswith('cuda')):
                logits = slot_logits(model, ids, mask)
            chosen, wanted = logits[:, :-1].argmax(-1), labels[:, 1:]
            scored = wanted != -100
            hit = (chosen == wanted) & scored
            right += int(hit.sum())
            tokens += int(scored.sum())
            exact += int((hit.sum(1) == scored.sum(1)).sum())
    model.train(was_training)
    return exact / len(samples), right / max(tokens, 1)


def slot_logits(model, ids, mask):
    """Return the logits at positions 0..n-1 (the cache's slots), as the node runs the model."""
    import torch
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def action_loss(model, ids, labels, mask):
    """Mean cross-entropy of the action tokens (positions 0..n-1: the cache's slots)."""
    import torch
    logits = slot_logits(model, ids, mask)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--params', required=True, help="the node's parameter file")
    parser.add_argument('--base', default='', help="base model (default: the params' "
                        'model_path)')
    parser.add_argument('--bags', nargs='+', required=True)
    parser.add_argument('--out', required=True, help='adapter folder to write')
    parser.add_argument('--rank', type=int, default=16)
    parser.add_argument('--alpha', type=float, default=32.0)
    parser.add_argument('--targets', default=','.join(TARGETS))
    parser.add_argument('--steps', type=int, default=1500)
    parser.add_argument('--batch', type=int, default=32)
    parser.add_argument('--lr', type=float, default=1e-3)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--max-minutes', type=float, default=None,
                        help='stop training after this long (from the start), whatever '
                        '--steps says; training.json records the steps run')
    parser.add_argument('--workers', type=int, default=1,
                        help='processes that build the samples, a bag each at a time')
    parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16',
                        help='the adapter as written (training runs in float32 with bf16 '
                        'autocast on a GPU)')
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--attention', choices=('base', 'none'), default='base',
                        help='whose attention the eviction policy reads while the samples are '
                        "built: the base model's (run on the node's backend) or none (every "
                        'mass 0: exact for recency and sink_window)')
    parser.add_argument('--holdout', nargs='*', default=[], metavar='BAG',
                        help='bags never trained on: exact-action share of their samples')
    parser.add_argument('--eval-every', type=int, default=0, metavar='STEPS',
                        help='also score --holdout every STEPS steps (0: at the end only)')
    parser.add_argument('--eval-samples', type=int, default=256,
                        help='holdout samples scored, spread evenly over them')
    parser.add_argument('--history-noise', default='', metavar='STD[,STD...]',
                        help='Gaussian noise (one standard deviation per action field, in its '
                        'units) on the actions the context shows of earlier ticks, labels '
                        'clean: keeps the adapter from repeating its last action '
                        "(bag_samples.py); e.g. 0.2,0.6 for the demo's v, w")
    parser.add_argument('--history-hold', type=float, default=0.0, metavar='RATE',
                        help='the chance a tick starts showing a random action in the history '
                        'instead, held for 1-30 ticks (labels clean)')
    parser.add_argument('--capacities', default='', metavar='TOKENS[,TOKENS...]',
                        help='KV cache budgets the samples are built at, each bag at each '
                        "(default: the params' kv_capacity_tokens): what the context holds "
                        'beside the newest tick depends on the budget, and an adapter shown '
                        'one budget meets other contexts at another')
    parser.add_argument('--restart-every', type=float, default=0.0, metavar='SECONDS',
                        help='mean seconds between simulated node restarts (the cache emptied): '
                        'decisions with no history, which a long bag holds once')
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.rank, args.workers, args.eval_samples) < 1 \
            or args.eval_every < 0:
        parser.error('--steps, --batch, --rank, --workers and --eval-samples must be at least '
                     '1, --eval-every at least 0')
    if not (0.0 < args.lr < math.inf and 0.0 < args.alpha < math.inf
            and (args.max_minutes is None or 0.0 < args.max_minutes < math.inf)):
        parser.error('--lr, --alpha and --max-minutes must be finite numbers above 0')
    unknown = sorted(set(args.targets.split(',')) - set(TARGETS))
    if unknown:
        parser.error(f'--targets: {", ".join(unknown)} not among {", ".join(TARGETS)}')
    try:
        augment = Augment(tuple(float(x) for x in args.history_noise.split(','))
                          if args.history_noise else (), args.history_hold,
                          restart_s=args.restart_every)
    except ValueError as exc:
        parser.error(f'--history-noise, --history-hold, --restart-every: {exc} (noise >= 0, '
                     'a hold rate in [0, 1], seconds >= 0)')
    try:
        capacities = [int(c) for c in args.capacities.split(',') if c] or [None]
        if any(c is not None and c < 64 for c in capacities):
            raise ValueError
    except ValueError:
        parser.error(f'--capacities: whole numbers of tokens >= 64, got {args.capacities!r}')
    import peft
    import torch
    started = time.monotonic()
    values = load_params(args.params)
    base = args.base or values['model_path']
    if not base:
        parser.error('no base model: --base or model_path in the parameters')
    samples, per_bag, held = [], {}, []
    # each worker process runs the base on its own backend (CUDA: its own context, started
    # fresh, never forked from a parent that touched the GPU); held-out bags as the node
    # would see them, never augmented
    # (the held-out bags at the params' budget, the one the node runs with)
    jobs = ([(bag, args.params, base, args.attention, augment, args.seed, capacity)
             for capacity in capacities for bag in args.bags]
            + [(bag, args.params, base, args.attention, Augment(), args.seed, None)
               for bag in args.holdout])
    trained = len(jobs) - len(args.holdout)
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context('spawn')
                             ) as pool:
        for i, found in enumerate(pool.map(_bag_job, jobs)):
            bag, capacity = jobs[i][0], jobs[i][-1]
            if i < trained:
                name = Path(bag).name + (f'@{capacity}' if capacity else '')
                per_bag[name] = len(found)
                samples += found
            else:
                held += found
            print(f'{bag}: {len(found)} samples ({time.monotonic() - started:.0f} s)',
                  flush=True)
    if not samples:
        sys.exit('finetune: no samples (no tick with a recorded command)')
    if args.holdout and not held:
        sys.exit('finetune: the --holdout bags hold no tick with a recorded command')
    held = evenly(held, args.eval_samples)
    torch.manual_seed(args.seed)
    model = hf_model(base, torch).to(args.device)
    config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                             target_modules=args.targets.split(','), task_type='CAUSAL_LM')
    model = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    losses, feed = [], batches(samples, min(args.batch, len(samples)), rng)
    curve = []

    def score(step):
        exact, token = holdout_accuracy(model, held, torch, args.device)
        curve.append([step, round(exact, 4), round(token, 4)])
        print(f'step {step}: holdout {exact:.3f} of actions exact, {token:.3f} of tokens '
              f'({len(held)} samples)', flush=True)
    model.train()
    steps = 0
    training_started = time.monotonic()
    budget = args.max_minutes * 60 - (training_started - started) if args.max_minutes else 0
    if args.max_minutes and budget <= 0:
        sys.exit(f'finetune: --max-minutes {args.max_minutes} was spent before the first step '
                 f'(samples and the base took {training_started - started:.0f} s)')
    for step in range(args.steps):
        progress = step / args.steps
        if args.max_minutes:
            progress = max(progress, (time.monotonic() - training_started) / budget)
            if progress >= 1.0:
                print(f'stopped at step {step}: --max-minutes {args.max_minutes}')
                break
        for group in optimizer.param_groups:
            group['lr'] = args.lr * lr_factor(progress)
        with torch.autocast('cuda', torch.bfloat16, enabled=args.device.startswith('cuda')):
            loss = action_loss(model, *collate(next(feed), torch, args.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        steps = step + 1
        if step % 100 == 0 or step == args.steps - 1:
            print(f'step {step}: loss {np.mean(losses[-100:]):.4f} lr {group["lr"]:.2e} '
                  f'({time.monotonic() - started:.0f} s)', flush=True)
        if held and args.eval_every and steps % args.eval_every == 0 and steps < args.steps:
            score(steps)
    if held:
        score(steps)
    out = Path(args.out)
    if args.dtype == 'bfloat16':   # half the bytes; merged on load in float32 all the same
        model = model.to(torch.bfloat16)
    for config in model.peft_config.values():   # PEFT records where it loaded the base from
        config.base_model_name_or_path = Path(base).name
    model.save_pretrained(str(out))
    (out / 'README.md').unlink(missing_ok=True)   # PEFT's model card template
    record = {'command': 'python training/finetune.py ' + ' '.join(argv or sys.argv[1:]),
              'base': Path(base).name,
              'base_sha256': (file_sha256(base, 'base model', 1 << 36)
                              if Path(base).is_file() else None),
              'params': Path(args.params).name, 'bags': per_bag,
              'capacities': [c or values['kv_capacity_tokens'] for c in capacities],
              'samples': len(samples), 'steps': steps, 'batch': args.batch,
              'lr': args.lr, 'rank': args.rank, 'alpha': args.alpha, 'seed': args.seed,
              'attention': args.attention, 'history_noise': list(augment.noise),
              'history_hold': augment.hold_rate, 'restart_every': augment.restart_s,
              'loss_first_100': float(np.mean(losses[:100])),
              'loss_last_100': float(np.mean(losses[-100:])),
              'holdout': ({'bags': [Path(b).name for b in args.holdout], 'samples': len(held),
                           'exact': curve[-1][1], 'token_accuracy': curve[-1][2],
                           'curve': curve} if held else None),
              'seconds': round(time.monotonic() - started, 1)}
    write_atomic(out / 'training.json', json.dumps(record, indent=2) + '\n', 'training record')
    print(f'wrote {out} ({record["seconds"]} s)')


if __name__ == '__main__':
    main()
