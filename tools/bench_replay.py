"""Offline replay speed: a 60 s demo bag through rt-llm-replay (model clock, shipped model).

    python tools/bench_replay.py [--seconds 60] [--write]
"""

import argparse
from pathlib import Path
import tempfile

from rt_llm_node.bench_report import markdown_table
from rt_llm_node.bench_report import print_table
from rt_llm_node.bench_report import write_section
from rt_llm_node.demo.recorder import record_demo_bag
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.replay import load_params
from rt_llm_node.replay import read_cost_model
from rt_llm_node.replay import replay

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=60.0)
    parser.add_argument('--write', action='store_true')
    args = parser.parse_args()
    values = load_params(ROOT / 'config' / 'demo.yaml')
    cost_model = read_cost_model(Path(default_model_path()) / 'cost_model.json')
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for storage in ('mcap', 'sqlite3'):
            bag = record_demo_bag(Path(tmp) / storage, args.seconds, storage=storage)
            s = replay(bag, values, Path(tmp) / f'out_{storage}', 'model', cost_model,
                       log=lambda text: None)
            per_tick = s['wall_seconds'] / s['ticks'] * 1e3
            rows.append([storage, f"{s['bag_seconds']:.1f}", s['ticks'],
                         f"{s['wall_seconds']:.1f}", f'{per_tick:.2f}',
                         f"{s['speed_x_realtime']:.1f}x", s['actions'], s['refusals']])
    header = ['storage', 'bag s', 'ticks', 'replay s', 'ms / tick', 'speed vs real time',
              'actions', 'refusals']
    print_table(header, rows)
    if args.write:
        write_section('replay', 'Offline replay speed (numpy backend, shipped model)',
                      'A demo bag recorded by rt-llm-demo-record, replayed with '
                      '`--clock model`, config/demo.yaml and the cost model shipped beside the '
                      'model (engine, bag reading and writing, summary and PNG included; '
                      'calibration excluded).\n\n' + markdown_table(header, rows))


if __name__ == '__main__':
    main()
