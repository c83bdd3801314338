"""``rt-llm-replay-fleet``: replay a fleet's rosbags on Ray; one report of what changed.

    rt-llm-replay-fleet BAGS... --params P.yaml --golden GOLDEN --out OUT [--address ADDR]
    rt-llm-replay-fleet BAGS... --params P.yaml --write-golden GOLDEN [--cost-model F]

BAGS: bag folders, folders of bags, ``.mcap`` files or globs of them. Each bag is one Ray task
(``--gpus-per-bag`` for the CUDA backend; ``backend: auto`` is numpy without it) running
``rt-llm-replay`` under the model clock, so a bag's decisions depend on the bag, the
parameters, the model and the cost model alone, never on the number or kind of workers: with
``--golden`` each bag uses its golden's ``cost_model.json`` (as ``rt-llm-replay --expect``);
writing goldens, every bag uses one cost model (``--cost-model``, else one calibrated here
first). ``ray.init()`` starts a local cluster of ``--workers`` CPUs; ``--address`` joins a
running one (its workers need this package and the bags at the same paths). Results stream in
as bags finish (a line each, and a progress line: bags done, ticks/s, ETA); each is kept in
OUT/bags/NAME.json, so an interrupted run goes on with ``--resume``. A bag that fails (corrupt,
or its worker died) is retried once, then reported; the others' results are kept. The report:
OUT/report.json (each bag: ticks, actions, refusals by reason, late, the first difference
against its golden; totals), OUT/report.md with refusal rate and differences per bag (SVG bar
charts drawn here, no plotting library). Exit status: 0 every bag as its golden (or goldens
written), 1 a difference or a failed bag, 2 an error of the run itself. A bag's replay output
is rt-llm-replay's but for timeline.png, drawn only with ``--timelines``: its matplotlib
process would run beside every task on a CPU Ray does not count.
"""

import argparse
from collections import Counter
import glob
import hashlib
from html import escape
import json
import math
import os
from pathlib import Path
import platform
import sys
import time

from rt_llm_node.admission import CostModel
from rt_llm_node.bags import BagError
from rt_llm_node.files import FileError
from rt_llm_node.files import MARKER
from rt_llm_node.files import MB
from rt_llm_node.files import read_json
from rt_llm_node.files import write_atomic
from rt_llm_node.replay import check_tolerance
from rt_llm_node.replay import differences
from rt_llm_node.replay import EXIT_DIFFERENT
from rt_llm_node.replay import EXIT_ERROR
from rt_llm_node.replay import load_params
from rt_llm_node.replay import read_cost_model
from rt_llm_node.replay import replay
from rt_llm_node.replay import ReplayError

TOOL = 'rt-llm-replay-fleet'
INSTALL = "pip install 'rt_llm_node[fleet]' (Ray)"
MAX_RECORD = 4 * MB
ATTEMPTS = 2           # a bag that fails is tried once more, then reported
LABELLED = 40          # bags on the report's plots; a larger fleet shows its worst


class FleetError(RuntimeError):
    """The run itself cannot go on (not one bag's failure)."""


def find_bags(items):
    """Return (name, path) of every bag ``items`` name, in order; FleetError where none.

    An item is a bag folder (it holds metadata.yaml), a folder of bag folders, an ``.mcap``
    file, or a glob of those. Names are the folders' (or files') names, made unique with
    their parent's where two agree.
    """
    found = []
    for item in items:
        paths = sorted(glob.glob(item)) if any(c in item for c in '*?[') else [item]
        if not paths:
            raise FleetError(f'{item}: matches no bag')
        for path in map(Path, paths):
            if path.is_dir() and not (path / 'metadata.yaml').exists():
                inner = sorted(p for p in path.iterdir()
                               if (p.is_dir() and (p / 'metadata.yaml').exists())
                               or p.suffix == '.mcap')
                if not inner:
                    raise FleetError(f'{path}: neither a bag nor a folder of bags')
                found += inner
            elif path.exists():
                found.append(path)
            else:
                raise FleetError(f'{path}: no such bag')
    names = Counter(p.stem if p.suffix == '.mcap' else p.name for p in found)
    out, seen = [], set()
    for path in found:
        name = path.stem if path.suffix == '.mcap' else path.name
        if names[name] > 1:
            name = f'{path.parent.name}-{name}'
        if name in seen:
            raise FleetError(f'{path}: named twice')
        seen.add(name)
        out.append((name, str(path)))
    if not out:
        raise FleetError('no bags given')
    return out


def task_backend(backend, gpus_per_bag):
    """Return the backend every bag's task runs, fixed on the driver for the whole run.

    ``auto`` is the CUDA backend where bags ask Ray for a GPU share and numpy where they do
    not, never what each worker happens to find: a CPU task on a host with a GPU would
    otherwise open it, and one fleet would mix two arithmetics (and every task would compile
    the kernels at once). ``cuda`` without a GPU share is an error.
    """
    if backend == 'auto':
        return 'cuda' if gpus_per_bag > 0 else 'numpy'
    if backend == 'cuda' and gpus_per_bag <= 0:
        raise FleetError("backend cuda: give each bag's task a GPU share (--gpus-per-bag, "
                         'e.g. 0.25)')
    return backend


def replay_one(name, bag, values, cost_model_json, out, golden, tolerance, timeline=False):
    """Replay one bag (a Ray task); returns its result record.

    Raises on a failed replay: the driver tries it once more, then reports the error.
    """
    started = time.monotonic()
    warnings = []
    cost_model = None
    if golden:
        cost_model = read_cost_model(Path(golden) / 'cost_model.json')
    elif cost_model_json:
        cost_model = CostModel.from_json(cost_model_json)
    summary = replay(bag, values, out, 'model', cost_model, log=lambda text: None,
                     warn=warnings.append, force=False, timeline=timeline)
    record = {'bag': name, 'path': bag, 'status': 'written', 'ticks': summary['ticks'],
              'actions': summary['actions'], 'refusals': summary['refusals'],
              'refusals_by_reason': summary['refusals_by_reason'], 'late': summary['late'],
              'bag_seconds': summary['bag_seconds'], 'warnings': warnings[:5],
              'host': platform.node()}
    if golden:
        found = differences(out, golden, tolerance)
        record['status'] = 'different' if found else 'same'
        record['differences'] = len(found)
        record['kinds'] = dict(Counter(kind for kind, _, _ in found))
        if found:
            kind, was, now = found[0]
            record['first'] = {'kind': kind, 'tick': now.get('tick'), 'golden': was,
                               'now': now}
    record['seconds'] = round(time.monotonic() - started, 3)
    return record


def fingerprint(values, cost_model_json, golden, tolerance):
    """Return what a kept result must match to be reused by --resume."""
    def stat(path):
        try:
            info = os.stat(path)
            return [info.st_size, info.st_mtime_ns]
        except OSError:
            return None
    from rt_llm_node.model.embedded import default_model_path
    model = values['model_path'] or default_model_path() / 'model.safetensors'
    key = {'values': values, 'cost_model': cost_model_json, 'golden': golden,
           'tolerance': tolerance, 'model': stat(model),
           'adapter': stat(values['adapter_path']) if values['adapter_path'] else None}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def open_output(out, force):
    """Make ``out`` the fleet's folder: new, empty, or an earlier run's; FileError otherwise."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileError(f'{TOOL} output', out, 'not a folder (a file is there)')
    if out.is_dir() and any(out.iterdir()) and not force:
        try:
            marker = read_json(out / MARKER, f'{TOOL} output marker', MB)
        except FileError:
            marker = None
        if not isinstance(marker, dict) or marker.get('tool') != TOOL:
            raise FileError(f'{TOOL} output', out, f'holds what {TOOL} did not write: choose '
                            'another folder, or --force to write beside it')
    (out / 'bags').mkdir(parents=True, exist_ok=True)
    write_atomic(out / MARKER, json.dumps({'tool': TOOL, 'files': [
        'bags', 'report.json', 'report.md', 'refusals.svg', 'differences.svg']}) + '\n',
        f'{TOOL} marker')
    return out


class Progress:
    """Bags done, ticks a second and the time left, on one line (stderr)."""

    def __init__(self, total, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.started = time.monotonic()
        self.done = self.ticks = 0

    def update(self, record):
        self.done += 1
        self.ticks += record.get('ticks', 0)
        elapsed = max(time.monotonic() - self.started, 1e-6)
        eta = elapsed / self.done * (self.total - self.done)
        end = '\r' if self.stream.isatty() and self.done < self.total else '\n'
        self.stream.write(f'[{self.done}/{self.total} bags] {self.ticks / elapsed:,.0f} '
                          f'ticks/s, ETA {int(eta) // 60}:{int(eta) % 60:02d}{end}')
        self.stream.flush()


def line(record):
    """Return one line about a finished bag."""
    status = record['status']
    if status == 'error':
        return f"{record['bag']}: ERROR {record['error']}"
    text = (f"{record['bag']}: {record['ticks']} ticks, {record['actions']} actions, "
            f"{record['refusals']} refusals, late {record['late']}")
    if status == 'different':
        first = record['first']
        text += (f"; {record['differences']} differences, first at tick {first['tick']} "
                 f"({first['kind']})")
    return f'{text}: {status}'


def totals(records):
    """Return the sums over the bags, and how many ended each way."""
    ran = [r for r in records if r['status'] != 'error']
    reasons = Counter()
    for r in ran:
        reasons.update(r['refusals_by_reason'])
    return {'bags': len(records), 'by_status': dict(Counter(r['status'] for r in records)),
            'ticks': sum(r['ticks'] for r in ran), 'actions': sum(r['actions'] for r in ran),
            'refusals': sum(r['refusals'] for r in ran), 'refusals_by_reason': dict(reasons),
            'late': sum(r['late'] for r in ran),
            'differences': sum(r.get('differences', 0) for r in ran)}


def write_report(out, records, run):
    """Write report.json, report.md and its two SVG plots."""
    records = sorted(records, key=lambda r: r['bag'])
    report = {'run': run, 'totals': totals(records), 'bags': records}
    write_atomic(out / 'report.json', json.dumps(report, indent=2, default=str) + '\n',
                 'fleet report')
    plots = _plots(out, records)
    t = report['totals']
    md = [f'# Fleet replay: {t["bags"]} bags', '',
          f"- command: `{run['command']}`", f"- machine: {run['machine']}",
          f"- date: {run['date']}", '',
          f"{t['ticks']} ticks, {t['actions']} actions, {t['refusals']} refusals "
          f"{t['refusals_by_reason']}, late {t['late']}; bags: {t['by_status']}", '']
    md += [f'![{p}]({p})' for p in plots] + ([''] if plots else [])
    md += ['| bag | status | ticks | actions | refusals | late | differences | first |',
           '|---|---|---|---|---|---|---|---|']
    for r in records:
        if r['status'] == 'error':
            md.append(f"| {r['bag']} | error | | | | | | {r['error']} |")
            continue
        first = r.get('first')
        where = f"tick {first['tick']}: {first['kind']}" if first else ''
        md.append(f"| {r['bag']} | {r['status']} | {r['ticks']} | {r['actions']} | "
                  f"{r['refusals']} | {r['late']} | {r.get('differences', '')} | {where} |")
    write_atomic(out / 'report.md', '\n'.join(md) + '\n', 'fleet report')
    return report


def plotted(bars):
    """Return the (bag, value) bars a report plot shows, and its title.

    Every bag in order up to ``LABELLED``; a larger fleet's worst (report.json has them all):
    a bar a bag of hundreds is neither readable nor cheap to draw.
    """
    if len(bars) <= LABELLED:
        return bars, f'{len(bars)} bags'
    worst = sorted(bars, key=lambda bar: -bar[1])[:LABELLED]
    return worst, f'the {LABELLED} worst of {len(bars)} bags'


def _plots(out, records):
    """Write refusals.svg and differences.svg: a bar a bag (a large fleet: its worst)."""
    ran = [r for r in records if r['status'] != 'error']
    made = []
    for name, values, label, colour in (
            ('refusals.svg', [100.0 * r['refusals'] / max(1, r['ticks']) for r in ran],
             'refused ticks (%)', '#1f77b4'),
            ('differences.svg', [r.get('differences', 0) for r in ran],
             'decisions unlike the golden', '#d62728')):
        bars, title = plotted([(r['bag'], v) for r, v in zip(ran, values)])
        write_atomic(out / name, bar_chart(bars, label, title, colour), 'fleet report plot')
        made.append(name)
    return made


def axis_step(top):
    """Return a step of 1, 2 or 5 times a power of ten that splits [0, top] in at most 5."""
    if top <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(top / 5))
    return next(power * m for m in (1, 2, 5, 10) if top / (power * m) <= 5)


def bar_chart(bars, label, title, colour):
    """Return an SVG bar chart of (name, value) bars (drawn here: no plotting library).

    Each bar carries a <title> with its bag and value (shown on hover), names run below at
    an angle, the y axis has gridlines at ``axis_step``.
    """
    height, left, top, bottom, pitch = 150, 56, 26, 100, 22
    width = max(320, left + 16 + pitch * len(bars))
    highest = max([v for _, v in bars] + [0.0])
    step = axis_step(highest)
    peak = step * max(1, math.ceil(highest / step))
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{top + height + bottom}" font-family="sans-serif" font-size="9">',
             f'<rect width="{width}" height="{top + height + bottom}" fill="white"/>',
             f'<text x="{width / 2:.0f}" y="14" text-anchor="middle">{escape(title)}</text>',
             f'<text transform="translate(12 {top + height / 2:.0f}) rotate(-90)" '
             f'text-anchor="middle">{escape(label)}</text>']
    for k in range(round(peak / step) + 1):
        y = top + height - height * k * step / peak
        lines.append(f'<line x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#ddd"/><text x="{left - 4}" y="{y + 3:.1f}" '
                     f'text-anchor="end">{k * step:g}</text>')
    for i, (name, value) in enumerate(bars):
        x, h = left + 4 + i * pitch, height * value / peak
        lines.append(f'<rect class="bar" x="{x}" y="{top + height - h:.1f}" '
                     f'width="{pitch - 6}" height="{h:.1f}" fill="{colour}"><title>'
                     f'{escape(name)}: {value:g}</title></rect>')
        lines.append(f'<text transform="translate({x + (pitch - 6) / 2:.0f} '
                     f'{top + height + 8}) rotate(-60)" text-anchor="end">'
                     f'{escape(name)}</text>')
    lines.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + height}" '
                 'stroke="black"/></svg>')
    return '\n'.join(lines) + '\n'


def build_parser():
    parser = argparse.ArgumentParser(prog=TOOL, description=__doc__.split('\n')[0])
    parser.add_argument('bags', nargs='+', help='bags, folders of bags, .mcap files, globs')
    parser.add_argument('--params', help="the node's parameter YAML")
    parser.add_argument('--model', help='overrides model_path')
    parser.add_argument('--adapter', help='overrides adapter_path')
    goldens = parser.add_mutually_exclusive_group(required=True)
    goldens.add_argument('--golden', help='a folder of goldens, one a bag name (an earlier '
                         '--write-golden): compare each bag with its own')
    goldens.add_argument('--write-golden', metavar='DIR', help="write each bag's replay "
                         'there as its golden')
    parser.add_argument('--out', help="the run's folder (report, per-bag results and, with "
                        "--golden, outputs); default: --write-golden's folder")
    parser.add_argument('--cost-model', help='cost_model.json for every bag when writing '
                        'goldens (default: one calibrated here before the run)')
    parser.add_argument('--tolerance', type=float, default=1e-6)
    parser.add_argument('--address', help='a running Ray cluster (ray start --head); default '
                        'a local one')
    parser.add_argument('--workers', type=int, default=os.cpu_count(),
                        help='CPUs of the local cluster (bags replayed at once)')
    parser.add_argument('--gpus-per-bag', type=float, default=0.0,
                        help="GPUs a bag's task asks Ray for (the CUDA backend: e.g. 0.25)")
    parser.add_argument('--timelines', action='store_true',
                        help="draw each bag's timeline.png too (a matplotlib process beside "
                        'each task, on a CPU Ray does not count: slower where the workers '
                        'fill the machine)')
    parser.add_argument('--resume', action='store_true',
                        help='keep the results an interrupted run left in --out')
    parser.add_argument('--force', action='store_true',
                        help='write into an --out that holds other files too')
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        import ray
    except ImportError:
        print(f'{TOOL}: error: Ray is not installed: {INSTALL}; rt-llm-replay replays one '
              'bag without it', file=sys.stderr)
        return EXIT_ERROR
    ray_started = False
    try:
        if args.workers < 1 or not 0.0 <= args.gpus_per_bag < math.inf:
            raise FleetError('--workers must be at least 1 and --gpus-per-bag not negative')
        check_tolerance(args.tolerance)
        if args.address:
            check_reachable(args.address)
        bags = find_bags(args.bags)
        values = load_params(args.params)
        if args.model:
            values['model_path'] = args.model
        if args.adapter:
            values['adapter_path'] = args.adapter
        values['backend'] = task_backend(values['backend'], args.gpus_per_bag)
        golden = Path(args.golden) if args.golden else None
        if golden is not None and not args.out:
            raise FleetError('--golden needs --out (where this run writes its outputs)')
        out = open_output(args.out or args.write_golden, args.force)
        cost_model_json = None
        if golden is None:
            cost_model_json = (read_cost_model(args.cost_model).to_json() if args.cost_model
                               else _calibrate(values))
        print(f'{TOOL}: {len(bags)} bags', file=sys.stderr)
        key = fingerprint(values, cost_model_json, str(golden), args.tolerance)
        records, pending = [], []
        for name, bag in bags:
            kept = _kept(out, name, key) if args.resume else None
            if kept is not None:
                records.append(kept)
            else:
                pending.append((name, bag))
        if records:
            print(f'{TOOL}: {len(records)} bags kept from the interrupted run', file=sys.stderr)
        if pending:
            try:
                if args.address:
                    ray.init(address=args.address, log_to_driver=False)
                else:
                    ray.init(num_cpus=min(args.workers, len(pending)), include_dashboard=False,
                             log_to_driver=False)
            except (ConnectionError, RuntimeError) as exc:
                raise FleetError(f'Ray did not start: {_cause(exc)}') from None
            ray_started = True
            gpus = ray.cluster_resources().get('GPU', 0.0)
            if args.gpus_per_bag > gpus:   # the tasks would wait for ever
                text = (f'each bag asks for {args.gpus_per_bag:g} GPU and the cluster has '
                        f'{gpus:g}')
                if not args.address:
                    raise FleetError(f'{text}: --gpus-per-bag 0 replays on the CPUs')
                print(f'{TOOL}: warning: {text} now: the bags wait until one joins',
                      file=sys.stderr)
            # retried here, not by Ray: a failure (a corrupt bag, a worker that died) is tried
            # once more and then reported with its attempts; the other bags go on
            task = ray.remote(replay_one).options(num_cpus=1, num_gpus=args.gpus_per_bag,
                                                  max_retries=0)

            def submit(name, bag, attempt):
                bag_out = (Path(args.write_golden) / name if golden is None
                           else out / 'bags' / name)
                ref = task.remote(name, bag, values, cost_model_json, str(bag_out),
                                  str(golden / name) if golden else None, args.tolerance,
                                  args.timelines)
                refs[ref] = (name, bag, attempt)
                return ref
            refs = {}
            waiting = [submit(name, bag, 1) for name, bag in pending]
            progress = Progress(len(pending))
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                name, bag, attempt = refs.pop(done[0])
                try:
                    record = ray.get(done[0])
                except Exception as exc:
                    if attempt < ATTEMPTS:
                        print(f'{name}: failed ({_cause(exc)}), trying again', file=sys.stderr)
                        waiting.append(submit(name, bag, attempt + 1))
                        continue
                    record = {'bag': name, 'path': bag, 'status': 'error',
                              'error': _cause(exc)}
                record['attempts'] = attempt
                record['fingerprint'] = key
                write_atomic(out / 'bags' / f'{name}.json', json.dumps(record, default=str)
                             + '\n', 'fleet bag result')
                records.append(record)
                print(line(record), file=sys.stderr)
                progress.update(record)
        run = {'command': f'{TOOL} ' + ' '.join(argv if argv is not None else sys.argv[1:]),
               'machine': f'{platform.node()}, {os.cpu_count()} CPUs here, Ray '
                          f'{ray.__version__}',
               'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}
        report = write_report(out, records, run)
        t = report['totals']
        print(f"{t['bags']} bags: {t['by_status']}; {t['ticks']} ticks, {t['differences']} "
              f"differences -> {out / 'report.md'}")
        failed = t['by_status'].get('different', 0) + t['by_status'].get('error', 0)
        return EXIT_DIFFERENT if failed else 0
    except (FleetError, BagError, FileError) as exc:   # ReplayError included
        print(f'{TOOL}: error: {exc}', file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f'{TOOL}: interrupted: --resume goes on from the bags that finished',
              file=sys.stderr)
        return 130
    finally:
        if ray_started:
            ray.shutdown()


def check_reachable(address, timeout_s=5.0):
    """Raise FleetError unless a HOST:PORT ``address`` accepts a connection within timeout_s.

    Ray itself waits minutes for a head that is not there; ``auto`` and ``ray://`` addresses
    are left to it.
    """
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit() or '://' in address:
        return
    import socket
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise FleetError(f'--address {address}: no Ray head answers there '
                         f'({exc.strerror or exc}); start one with ray start --head') from None


def _kept(out, name, key):
    """Return an earlier run's result for ``name`` if made the same way, else None."""
    path = out / 'bags' / f'{name}.json'
    if not path.exists():
        return None
    try:
        record = read_json(path, 'fleet bag result', MAX_RECORD)
    except FileError:
        return None
    ok = isinstance(record, dict) and record.get('fingerprint') == key
    return record if ok and record.get('status') != 'error' else None


def _cause(exc):
    """Return the line that says why a bag's task failed (Ray wraps the worker's error)."""
    cause = getattr(exc, 'cause', None) or exc
    if isinstance(cause, (ReplayError, BagError, FileError)):
        return ' '.join(str(cause).split())
    text = ' '.join(str(cause).split())
    return f'{type(cause).__name__}: {text[:300]}'


def _calibrate(values):
    """One cost model for every bag, calibrated on this machine (as the node does)."""
    from rt_llm_node.configure import configure_engine
    from rt_llm_node.engine import ModelClock
    print(f'{TOOL}: calibrating one cost model for every bag (--cost-model to give one)',
          file=sys.stderr)
    engine = configure_engine(values, clock=ModelClock(), log=lambda text: None)
    return engine.admission.model.to_json()


if __name__ == '__main__':
    sys.exit(main())
