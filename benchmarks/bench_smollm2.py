"""The real SmolLM2-135M-Instruct and an adapter replayed at 30 Hz, speculation off and on.

    PYTHONPATH=. python3 benchmarks/bench_smollm2.py --model SmolLM2-135M-Instruct.Q4_1.gguf
        [--adapter rt_llm_node/demo/smollm2] [--params config/demo_smollm2.yaml]
        [--seconds 60] [--seeds 1000000,1000123] [--speculative 2] [--backend cuda] [--write]

Records a demo bag a seed (the expert driving; 1000000 is the recorder's default, 1000123 a
held-out world of ours), then replays each through the node's engine (``replay.replay``) with
``speculative_tokens`` 0 and ``--speculative``, on the wall clock (each tick gets the period
from when it starts, as on the robot; host included, ROS callbacks not) and on the model clock
(time advanced by the cost model's predictions: the decisions admission takes with that
model). One cost model for every run, calibrated by the first. Per run: ticks, actions,
refusals by reason, admitted-but-late, forward passes an action (prefill, decode steps and
verify passes), drafts kept, and tick latency read back from the replay's own tick records;
then the wall-clock ticks of both bags pooled per setting (p50, p99, p99.9).
"""

import argparse
import json
from pathlib import Path
import sys
import tempfile

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import markdown_table  # noqa: E402
from report import print_table  # noqa: E402
from report import write_section  # noqa: E402

HEADER = ['bag', 'speculation', 'clock', 'ticks', 'actions', 'refusals', 'late',
          'passes an action', 'drafts kept', 'p50 ms', 'p99 ms', 'p99.9 ms']
POOLED = ['speculation', 'wall-clock ticks', 'admitted', 'admitted but late', 'p50 ms',
          'p99 ms', 'p99.9 ms', 'max ms']


def tick_records(out):
    """Return the replay's per-tick records (its /rt_llm_node/tick_record messages)."""
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    from rt_llm_node.bags import open_bag
    from rt_llm_node.replay import RECORD_TOPIC
    store = get_typestore(Stores.LATEST)
    reader = open_bag(Path(out) / 'replay')
    try:
        connections = [c for c in reader.connections if c.topic == RECORD_TOPIC]
        return [json.loads(store.deserialize_cdr(raw, c.msgtype).data)
                for c, _, raw in reader.messages(connections=connections)]
    finally:
        reader.close()


def percentiles(latencies, top=False):
    values = np.asarray(latencies, float)
    shown = [f'{np.percentile(values, q):.2f}' for q in (50, 99, 99.9)]
    return shown + [f'{values.max():.2f}'] if top else shown


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', required=True, help='the SmolLM2 GGUF (or any model_path)')
    parser.add_argument('--adapter', default=str(ROOT / 'rt_llm_node' / 'demo' / 'smollm2'))
    parser.add_argument('--params', default=str(ROOT / 'config' / 'demo_smollm2.yaml'))
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--seeds', default='1000000,1000123')
    parser.add_argument('--speculative', type=int, default=None,
                        help="drafts when on (default: the parameter file's, else 2)")
    parser.add_argument('--backend', default='cuda')
    parser.add_argument('--write', action='store_true')
    args = parser.parse_args()
    from rt_llm_node.admission import CostModel
    from rt_llm_node.demo.recorder import record_demo_bag
    from rt_llm_node.replay import load_params
    from rt_llm_node.replay import replay
    values = load_params(args.params)
    values.update(model_path=args.model, adapter_path=args.adapter or '', backend=args.backend)
    drafts = args.speculative or values.get('speculative_tokens') or 2
    seeds = [int(s) for s in args.seeds.split(',')]
    rows, pooled, cost_model = [], {}, None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in seeds:
            record_demo_bag(root / f'bag{seed}', args.seconds, seed=seed)
        for seed in seeds:
            for speculative in (drafts, 0):
                for clock in ('wall', 'model'):
                    out = root / f'out_{seed}_{speculative}_{clock}'
                    run = dict(values, speculative_tokens=speculative)
                    summary = replay(root / f'bag{seed}', run, out, clock, cost_model,
                                     log=lambda text: None, timeline=False)
                    if cost_model is None:
                        cost_model = CostModel.from_json((out / 'cost_model.json').read_text())
                    records = tick_records(out)
                    latencies = [r['total_ms'] for r in records]
                    setting = f'{speculative} drafts' if speculative else 'off'
                    if clock == 'wall':
                        pooled.setdefault(setting, []).extend(records)
                    reasons = summary['refusals_by_reason']
                    kept = (f"{summary['drafted_kept']} / {summary['drafted']}"
                            if speculative else '-')
                    rows.append([seed, setting, clock, summary['ticks'], summary['actions'],
                                 f"{summary['refusals']} {reasons}" if reasons else '0',
                                 summary['late'], f"{summary['forward_passes_per_action']:.2f}",
                                 kept, *percentiles(latencies)])
                    print_table(HEADER, rows[-1:])
    pooled_rows = []
    for setting, records in pooled.items():
        admitted = [r for r in records if r['decision'] == 'action']
        pooled_rows.append([setting, len(records), len(admitted),
                            sum(bool(r['late']) for r in records),
                            *percentiles([r['total_ms'] for r in records], top=True)])
    print_table(HEADER, rows)
    print_table(POOLED, pooled_rows)
    if args.write:
        adapter = Path(args.adapter).name if args.adapter else 'none'
        body = (f'Demo bags of {args.seconds:g} s (seeds {args.seeds}), '
                f'`{Path(args.params).name}`, adapter `{adapter}`, backend {args.backend}, one '
                "cost model (the first run's). Wall: a tick gets the period from its start "
                "(host included, ROS not); model: the cost model's time. Passes: prefill, "
                'decode steps, verify passes.\n\n' + markdown_table(HEADER, rows)
                + '\n\n' + markdown_table(POOLED, pooled_rows))
        machine = None   # this CPU's description
        if args.backend == 'cuda':
            from bench_cuda import gpu_machine
            machine = gpu_machine()
        write_section('smollm2_replay', 'SmolLM2-135M-Instruct replayed at 30 Hz, '
                      'speculation off and on', body, machine=machine)


if __name__ == '__main__':
    main()
