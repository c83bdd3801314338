"""How would admission have decided with another scale quantile? A trace of a real run.

    python tools/admission_trace.py [--seconds 20] [--trace T.json] [--ticks 3000]

Runs ``rt-llm-demo`` (the demo world and the node over DDS, config/demo.yaml) for
``--seconds`` and records, for every tick that ran, the cost model's raw prediction and
the measured model time (``Admission.observe`` wrapped), and for every tick refused at
admission the time it had left. Then it replays the measured/predicted ratios, in their
order and repeated to ``--ticks``, through ``Admission`` at several ``quantile`` values
(the same margin, window and probes as the run): a tick is admitted or refused by the
admission under test and, admitted, takes the time its ratio says; it is an action when
that fits the time left (the run's median), else an overrun (refused by the watchdog).
``--trace T.json``: replay a recorded trace instead of running the demo (T.json as written
by a run: ``--save T.json``).
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np

from rt_llm_node.admission import Admission
from rt_llm_node.admission import CostModel

QUANTILES = (1.0, 0.95, 0.9, 0.8)


def record_run(seconds):
    """(ran, refused): [(raw ms, measured ms)] of ticks that ran, [time left ms] of ticks
    refused at admission, from one ``rt-llm-demo`` run of ``seconds``."""
    from rt_llm_node.demo import run
    ran, refused = [], []
    observe, probe_instead = Admission.observe, Admission.probe_instead

    def observing(self, n_prefill, cache_length, n_decode, kept, measured_ms, probe=False,
                  in_time=True):
        ran.append((self.model.tick_ms(n_prefill, cache_length, n_decode, kept), measured_ms))
        return observe(self, n_prefill, cache_length, n_decode, kept, measured_ms, probe,
                       in_time)

    def refusing(self, n_prefill, cache_length, n_decode, kept, available_ms):
        refused.append(available_ms)
        return probe_instead(self, n_prefill, cache_length, n_decode, kept, available_ms)
    Admission.observe, Admission.probe_instead = observing, refusing
    try:
        with tempfile.TemporaryDirectory() as tmp:   # the demo's plot is not wanted here
            run.main(['--seconds', str(seconds), '--out', os.path.join(tmp, 'demo.png')])
    finally:
        Admission.observe, Admission.probe_instead = observe, probe_instead
    return ran, refused


def replay(ratios, raw_ms, available_ms, quantile, ticks, margin_ms, window, probe_ticks):
    """(actions, deadline refusals, overruns) of ``ticks`` ticks whose measured/predicted
    ratios are ``ratios`` in turn, under an Admission with ``quantile``."""
    admission = Admission(CostModel(prefill=(raw_ms, 0.0, 0.0)), margin_ms=margin_ms,
                          window=window, probe_ticks=probe_ticks, quantile=quantile)
    actions = refusals = overruns = 0
    for i in range(ticks):
        ratio = ratios[i % len(ratios)]
        admission.new_tick()
        if not (admission.admit(admission.predict_ms(1, 0, 0), available_ms)
                or admission.probe_instead(1, 0, 0, None, available_ms)):
            refusals += 1
            continue
        in_time = ratio * raw_ms + margin_ms <= available_ms
        admission.observe(1, 0, 0, None, ratio * raw_ms, in_time=in_time)
        actions += in_time
        overruns += not in_time
    return actions, refusals, overruns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=20.0)
    parser.add_argument('--trace', help='replay this recorded trace (no demo run)')
    parser.add_argument('--save', help='write the recorded trace here')
    parser.add_argument('--ticks', type=int, default=3000)
    args = parser.parse_args(argv)
    if args.trace:
        with open(args.trace, encoding='utf-8') as f:
            trace = json.load(f)
    else:
        ran, refused = record_run(args.seconds)
        trace = {'ran': ran, 'refused': refused}
        if args.save:
            with open(args.save, 'w', encoding='utf-8') as f:
                json.dump(trace, f)
    if not trace['ran']:
        print('no tick ran: nothing to replay', file=sys.stderr)
        return 1
    raw = np.array([r for r, _ in trace['ran']])
    ratios = [m / r for r, m in trace['ran'] if r > 0]
    # the time a tick had: where ticks were refused the run recorded it, else 33.3 ms less
    # the demo's 3 ms margin and the typical render
    left = float(np.median(trace['refused'])) if trace['refused'] else 28.5
    print(f'{len(ratios)} ticks ran, {len(trace["refused"])} refused at admission; '
          f'ratio measured/predicted p50 {np.median(ratios):.2f}, p90 '
          f'{np.quantile(ratios, 0.9):.2f}, p99 {np.quantile(ratios, 0.99):.2f}, max '
          f'{max(ratios):.2f}; predicted {np.median(raw):.2f} ms, time left {left:.1f} ms')
    print(f'{"quantile":>8s} {"actions":>8s} {"refused":>8s} {"overruns":>8s}  of {args.ticks}')
    for q in QUANTILES:
        actions, refusals, overruns = replay(ratios, float(np.median(raw)), left, q,
                                             args.ticks, 3.0, 60, 30)
        print(f'{q:8.2f} {actions:8d} {refusals:8d} {overruns:8d}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
