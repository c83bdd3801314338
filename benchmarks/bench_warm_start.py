"""Cold and warm starts: time from configure to the first admitted action, with state_dir.

    python benchmarks/bench_warm_start.py [--models demo,smollm2-135m] [--backend numpy]
        [--write]

Per model, in one process, one after another: a cold start (an empty ``state_dir``: load,
allocate, prefill the system prompt, calibrate, store both) and a warm start (the same
folder: restore the prompt's KV state, check the stored cost model at four points, keep it).
Each start is timed from the call of ``configure_engine`` to the first admitted action of the
demo world on the wall clock (``--backend``: numpy, or cuda on a GPU, where the cold start
also compiles the kernels: the kernel cache starts empty too). Models: ``demo``, the
shipped policy at its 30 Hz profile; ``smollm2-135m``, random weights of the SmolLM2-135M
shape (30 layers, 576 wide) with the demo's tokenizer and its 1280-token vocabulary, at 2 Hz
(its decode step takes tens of milliseconds on a CPU; 30 Hz on cuda).
"""

import argparse
import os
from pathlib import Path
import sys
import tempfile
import time

from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.model.synthetic import random_weights
from rt_llm_node.model.synthetic import shape_config
from rt_llm_node.model.synthetic import write_checkpoint
from rt_llm_node.replay import load_params

DEMO_PARAMS = str(Path(__file__).resolve().parents[1] / 'config' / 'demo.yaml')
RATES = {'demo': 30.0, 'smollm2-135m': 2.0}


def model_path(name, folder):
    """Return the checkpoint of ``name``: the shipped one, or a random one written to folder."""
    if name == 'demo':
        return str(default_model_path())
    demo = load_checkpoint(default_model_path())
    config = shape_config(name)
    config.vocab_size = demo.config.vocab_size
    return str(write_checkpoint(f'{folder}/{name}', config, random_weights(config, 0),
                                demo.tokenizer))


def start(values, ticks=600):
    """Configure and tick the demo world until an action: (seconds, configure s, log lines)."""
    from rt_llm_node.configure import configure_engine
    lines = []
    began = time.monotonic()
    engine = configure_engine(values, log=lines.append)
    configured = time.monotonic() - began
    world = DemoWorld(3, messages=MessageFactory(ros=False))
    period = 1.0 / values['rate_hz']
    snapshot = {}
    for _ in range(ticks):
        now = time.monotonic()
        snapshot.update({topic: (msg, now) for topic, msg in world.observe().items()})
        result = engine.tick(snapshot, now, now + period)
        if result.action is not None:
            return time.monotonic() - began, configured, lines
        world.step(0.0, 0.0)
        time.sleep(max(0.0, now + period - time.monotonic()))
    raise RuntimeError(f'no action in {ticks} ticks: {result.refusal}')


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_warm_start.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--models', default='demo,smollm2-135m')
    parser.add_argument('--backend', default='numpy', choices=('numpy', 'cuda'))
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    header = ['model', 'start', 'configure s', 'to first action s', 'warm / cold',
              'prompt KV', 'cost model']
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(','):
            values = load_params(DEMO_PARAMS)
            values.update(backend=args.backend, model_path=model_path(name, tmp),
                          state_dir=f'{tmp}/state-{name}',
                          rate_hz=RATES[name] if args.backend == 'numpy' else 30.0)
            os.environ['RT_LLM_KERNEL_CACHE'] = f'{tmp}/kernels-{name}'

            cold = None
            for kind in ('cold', 'warm'):
                total, configured, lines = start(values)
                cold = cold or total
                restored = any('KV state restored' in line for line in lines)
                kept = next((line.split(':', 1)[0] for line in lines
                             if line.startswith('stored cost model')), 'calibrated')
                check = next((line.rsplit('checked in ', 1)[1] for line in lines
                              if 'checked in' in line), '')
                rows.append([name, kind, f'{configured:.2f}', f'{total:.2f}',
                             f'{total / cold:.2f}', 'restored' if restored else 'prefilled',
                             kept.replace('stored cost model ', 'stored, ')
                             + (f' (check {check})' if check else '')])
                print(f'{name} {kind}: {total:.2f} s', file=sys.stderr, flush=True)
    print_table(header, rows)
    if args.write:
        where = 'numpy, CPU' if args.backend == 'numpy' else 'CUDA'
        write_section('warm_start' if args.backend == 'numpy' else 'warm_start_cuda',
                      f'Cold and warm starts ({where})',
                      markdown_table(header, rows)
                      + '\n\nFrom the call of configure_engine to the first admitted action '
                      'of the demo world on the wall clock; cold: an empty state_dir, warm: '
                      'the folder the cold start left. The check times a decode step and a '
                      '24-token prefill over an empty and a half-full cache and keeps the '
                      'stored cost model when each is within 1.5x of its prediction.')
    return 0


if __name__ == '__main__':
    sys.exit(main())
