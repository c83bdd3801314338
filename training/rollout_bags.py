"""DAgger data: bags of the states a model drives the demo world into, labelled by the expert.

    python training/rollout_bags.py --model BASE.gguf --adapter ADAPTER --out DIR
        [--params config/demo_smollm2.yaml] [--seeds 20000:20032] [--budgets 256,512]
        [--policy meaning] [--backend cuda] [--workers 16] [--threads 2]

Each episode runs the model in closed loop exactly as rt-llm-eval does (the node's engine on
the model clock, ``evaluate.episode_job``), then is recorded again as a bag
(``record_demo_bag`` with the commands the robot executed): the robot's inputs at every state
the model reached, and on /cmd_vel the expert's command there. finetune.py trains on these
beside the expert's own bags. A learner trained only where the expert drives meets, in closed
loop, states its own mistakes lead to and nobody showed it the way back from; labelling those
states (Ross et al., "A Reduction of Imitation Learning and Structured Prediction to No-Regret
Online Learning", 2011) is what closes that gap. Seeds are training seeds: below rt-llm-eval's
held-out 1,000,000. The samples' contexts show the bag's commands as the earlier actions (the
expert's, with finetune.py's history noise), not the model's own.

One bag an episode and cache budget, named ``{policy}{budget}_{seed}``; a line each with its
goals reached, the share of ticks the model agreed with the expert, and the bag's ticks.
``--resume`` keeps the bags a cut run finished (each is written whole or not at all).
Offline tooling; with ``--backend cuda`` on the GPU machine.
"""

import argparse
import json
import os
from pathlib import Path
import sys
import time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rt_llm_node.demo.evaluate import EPISODE_ERRORS  # noqa: E402
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0  # noqa: E402
from rt_llm_node.demo.evaluate import input_names  # noqa: E402
from rt_llm_node.demo.evaluate import run_episodes  # noqa: E402
from rt_llm_node.demo.recorder import record_demo_bag  # noqa: E402
from rt_llm_node.files import FileError  # noqa: E402
from rt_llm_node.files import read_json  # noqa: E402
from rt_llm_node.files import write_atomic  # noqa: E402

MANIFEST = '.rollout.json'   # what drove the folder's bags (hidden: not a bag for a glob)


def seed_range(text):
    """'A:B' -> range(A, B) of training seeds (0 <= A < B <= 1,000,000)."""
    try:
        first, stop = (int(x) for x in text.split(':'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'seeds are FIRST:STOP, not {text!r}') from None
    if not 0 <= first < stop <= HELD_OUT_SEED0:
        raise argparse.ArgumentTypeError(
            f'seeds {text}: training seeds from 0 up to {HELD_OUT_SEED0} (held out above)')
    return range(first, stop)


def kept_bags(out, settings, resume=True):
    """Return the names of the finished bags in ``out``, which a --resume run keeps.

    ValueError where the folder's manifest names other settings (its bags came from another
    driver), or, for ``resume``, is missing beside bags.
    """
    bags = {p.name for p in out.iterdir() if (p / 'metadata.yaml').is_file()}
    if not (out / MANIFEST).exists():
        if bags and resume:
            raise ValueError(f'{out}: bags but no {MANIFEST} saying what drove them: '
                             '--resume cannot keep them')
        return bags
    earlier = read_json(out / MANIFEST, 'rollout settings')
    if earlier != settings:
        raise ValueError(f'{out}: its bags were driven by {earlier}, not {settings}: give '
                         'another --out')
    return bags


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True, help='the base model (GGUF or folder)')
    parser.add_argument('--adapter', default='', help='the LoRA adapter that drives')
    parser.add_argument('--params', default=str(ROOT / 'config' / 'demo_smollm2.yaml'))
    parser.add_argument('--out', required=True, help='folder of the bags (created)')
    parser.add_argument('--seeds', type=seed_range, default=seed_range('20000:20032'))
    parser.add_argument('--budgets', default='256')
    parser.add_argument('--policy', default='meaning')
    parser.add_argument('--backend', default='cuda', choices=('numpy', 'cuda'))
    parser.add_argument('--workers', type=int, default=os.cpu_count())
    parser.add_argument('--threads', type=int, default=1,
                        help="episodes a worker runs at once (rt-llm-eval's --threads)")
    parser.add_argument('--resume', action='store_true',
                        help='keep the bags already in --out (written by a run of the same '
                             'model, adapter, parameter file, policy and backend) and run only '
                             'the other episodes')
    args = parser.parse_args(argv)
    if args.workers < 1 or args.threads < 1:
        parser.error('--workers and --threads must be at least 1')
    try:
        budgets = [int(b) for b in args.budgets.split(',')]
    except ValueError:
        parser.error(f'--budgets: token counts, not {args.budgets!r}')
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(input_names(args.model, args.adapter, args.params), policy=args.policy,
                    backend=args.backend)
    try:   # bags of other settings are never mixed in: with or without --resume
        finished = kept_bags(out, settings, args.resume)
    except (FileError, ValueError) as exc:
        print(f'rollout_bags: error: {exc}', file=sys.stderr)
        return 2
    kept = finished if args.resume else set()
    write_atomic(out / MANIFEST, json.dumps(settings, indent=2) + '\n', 'rollout settings')
    jobs = {(args.model, args.policy, budget, seed, 0, args.backend, 'native', 'native',
             args.adapter, args.params): budget for seed in args.seeds for budget in budgets
            if f'{args.policy}{budget}_{seed}' not in kept}
    if args.resume:
        print(f'{out}: {len(kept)} bags kept, {len(jobs)} episodes to run', flush=True)
    started = time.monotonic()
    ticks = 0
    try:
        for job, episode in run_episodes(jobs, args.workers, args.threads, args.backend):
            _, policy, budget, seed = job[:4]
            name = f'{policy}{budget}_{seed}'
            record_demo_bag(out / name, seed=seed, commands=True, executed=episode['executed'])
            reached = sum(r == 'reached' for r in episode['results'])
            ticks += len(episode['executed'])
            elapsed = time.monotonic() - started
            print(f'{name}: {reached} of {len(episode["results"])} goals, agreed '
                  f"{episode['agree'] / max(1, episode['ticks']):.2f}, "
                  f"{len(episode['executed'])} ticks ({elapsed:.0f} s, "
                  f'{ticks / elapsed:.0f} ticks/s)', flush=True)
    except EPISODE_ERRORS as exc:
        print(f'rollout_bags: error: {exc}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
