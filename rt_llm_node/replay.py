"""``rt-llm-replay``: run a recorded rosbag2 through the node's own tick engine.

Messages reach the engine on the bag's own timeline at the node's rate: tick k starts
at ``bag start + start + k / rate_hz`` and sees, per input topic, the newest message
logged at or before that instant (its log time is its receive time, so staleness is
judged as on the robot). ``--clock model`` advances time by the cost model's
predictions, so the same bag, parameters and cost model give byte-identical streams;
``--clock wall`` lets the real backend's timing decide.

Output (``--out DIR``): ``replay/`` (a rosbag2, MCAP: the inputs, then the actions,
refusals and per-tick records the node would publish), ``actions.jsonl`` (one line a
tick: the decision stream that ``--expect`` compares), ``summary.json``,
``cost_model.json`` and ``timeline.png``. ``--expect GOLDEN`` compares with an earlier
output directory (and, with ``--clock model``, reuses its cost model) and exits 1 with
a readable diff when they differ. ``--live`` instead publishes the bag's messages on
their topics with their timing, for a running node.

    rt-llm-replay BAG --params config/demo.yaml --out out/replay
    rt-llm-replay BAG --params config/demo.yaml --out out/new --expect out/replay
    rt-llm-replay BAG --live [--publish-clock]
"""

import argparse
from collections import Counter
import json
import math
from pathlib import Path
import shutil
import sys
import time
from types import SimpleNamespace

import numpy as np

from rt_llm_node.admission import CostModel
from rt_llm_node.codec import action_message
from rt_llm_node.codec import fallback_values
from rt_llm_node.codec import normalize_type
from rt_llm_node.engine import ModelClock
from rt_llm_node.engine import WallClock
from rt_llm_node.params import PARAMETERS

EXIT_DIFFERENT = 1
EXIT_ERROR = 2
REFUSAL_TOPIC = '/rt_llm_node/refusal'
RECORD_TOPIC = '/rt_llm_node/tick_record'


class ReplayError(RuntimeError):
    """A bag, parameter file or golden output that cannot be replayed (the message says why)."""


# -- parameters --------------------------------------------------------------------------
def load_params(path=None):
    """Defaults of every node parameter, overridden by a node YAML file's ros__parameters."""
    values = {p.name: p.default for p in PARAMETERS}
    if path is None:
        return values
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text(encoding='utf-8'))
    except (OSError, yaml.YAMLError) as exc:
        raise ReplayError(f'cannot read parameters {path}: {exc}') from None
    found = None
    for entry in (data or {}).values() if isinstance(data, dict) else ():
        if isinstance(entry, dict) and isinstance(entry.get('ros__parameters'), dict):
            found = entry['ros__parameters']
            break
    if found is None:
        raise ReplayError(f'{path}: no "<node>: ros__parameters:" section')
    unknown = sorted(set(found) - set(values))
    if unknown:
        raise ReplayError(f'{path}: unknown parameters {", ".join(unknown)}')
    values.update(found)
    return values


def parse_remaps(items):
    """['/scan:=/robot/scan', ...] -> {'/scan': '/robot/scan'} (node topic -> bag topic)."""
    remaps = {}
    for item in items or ():
        if ':=' not in item:
            raise ReplayError(f'--topics takes NODE_TOPIC:=BAG_TOPIC, got {item!r}')
        node_topic, bag_topic = item.split(':=', 1)
        remaps[node_topic.strip()] = bag_topic.strip()
    return remaps


# -- rosbags message conversion ----------------------------------------------------------
def _base_value(value, kind):
    if kind == 'string':
        return '' if value is None else str(value)
    if kind == 'bool':
        return bool(value)
    if kind in ('float32', 'float64'):
        return 0.0 if value is None else float(value)
    return 0 if value is None else int(value)


def to_store_message(obj, msgtype, store):
    """A rosbags message of ``msgtype`` with the fields of ``obj`` (any object, by name)."""
    from rosbags.typesys.base import Nodetype
    _, fields = store.fielddefs[msgtype]
    kwargs = {}
    for name, (node, spec) in fields:
        value = getattr(obj, name, None)
        if node == Nodetype.BASE:
            kwargs[name] = _base_value(value, spec[0])
        elif node == Nodetype.NAME:
            kwargs[name] = to_store_message(value if value is not None else SimpleNamespace(),
                                            spec, store)
        else:  # ARRAY (fixed length) or SEQUENCE: ((node, spec), length)
            (inner, inner_spec), length = spec
            items = list(value) if value is not None else []
            if node == Nodetype.ARRAY and not items:
                items = [0] * length if inner == Nodetype.BASE else [SimpleNamespace()] * length
            if inner == Nodetype.BASE and inner_spec[0] != 'string':
                dtype = {'float32': np.float32, 'float64': np.float64, 'bool': np.bool_,
                         'int8': np.int8, 'uint8': np.uint8, 'int16': np.int16,
                         'uint16': np.uint16, 'int32': np.int32, 'uint32': np.uint32,
                         'int64': np.int64, 'uint64': np.uint64}.get(inner_spec[0], np.float64)
                kwargs[name] = np.asarray(items, dtype=dtype)
            elif inner == Nodetype.BASE:
                kwargs[name] = [str(v) for v in items]
            else:
                kwargs[name] = [to_store_message(v, inner_spec, store) for v in items]
    return store.types[msgtype](**kwargs)


def _stamp(ns):
    return SimpleNamespace(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def action_namespace(action, action_type, period_s):
    """The action message as plain fields (the node builds the same with rclpy classes)."""
    return action_message(action, action_type, period_s,
                          lambda name, **fields: SimpleNamespace(**fields))


# -- reading the bag ---------------------------------------------------------------------
def open_bag(path):
    """An opened rosbags Reader (MCAP or sqlite3 storage); ReplayError when unreadable."""
    from rosbags.rosbag2 import Reader
    path = Path(path)
    if not path.exists():
        raise ReplayError(f'{path}: no such bag')
    try:
        reader = Reader(path)
        reader.open()
    except Exception as exc:  # rosbags raises ReaderError and storage-specific errors
        raise ReplayError(f'{path}: not a readable rosbag2 ({type(exc).__name__}: {exc})'
                          ) from None
    return reader


def input_connections(reader, values, remaps, store, warn):
    """{node topic: connection} for the configured inputs; errors for missing required ones."""
    by_topic = {}
    for connection in reader.connections:
        by_topic.setdefault(connection.topic, connection)
    chosen, problems = {}, []
    for i, topic in enumerate(values['input_topics']):
        bag_topic = remaps.get(topic, topic)
        want = normalize_type(values['input_types'][i])
        connection = by_topic.get(bag_topic)
        if connection is None:
            problems.append(f'{bag_topic} (for input {topic}) is not in the bag')
            continue
        if connection.msgtype != want:
            problems.append(f'{bag_topic} has type {connection.msgtype}, the parameters '
                            f'expect {want}')
            continue
        if connection.msgtype not in store.types and not register_definition(
                connection, store, warn):
            problems.append(f'{bag_topic}: message type {connection.msgtype} is unknown '
                            'and the bag carries no usable definition')
            continue
        chosen[topic] = connection
    if problems:
        raise ReplayError('the bag does not provide the configured inputs: '
                          + '; '.join(problems))
    inputs = {c.topic for c in chosen.values()}
    for connection in reader.connections:
        if connection.topic not in inputs and connection.msgtype not in store.types and \
                not register_definition(connection, store, warn):
            warn(f'skipping {connection.topic}: unknown message type '
                 f'{connection.msgtype} and no definition in the bag')
    return chosen


def register_definition(connection, store, warn):
    """Teach ``store`` a type from the definition the bag carries (MCAP does); True if done."""
    from rosbags.typesys import get_types_from_idl
    from rosbags.typesys import get_types_from_msg
    msgdef = getattr(connection, 'msgdef', None)
    text = getattr(msgdef, 'data', msgdef) if msgdef is not None else None
    if not text:
        return False
    fmt = str(getattr(msgdef, 'format', 'msg')).lower()
    try:
        types = (get_types_from_idl(text) if 'idl' in fmt
                 else get_types_from_msg(text, connection.msgtype))
        store.register(types)
    except Exception as exc:  # a definition rosbags cannot parse
        warn(f'{connection.topic}: cannot use the definition of {connection.msgtype} in the '
             f'bag ({exc})')
        return False
    warn(f'{connection.topic}: {connection.msgtype} registered from the bag (its definition)')
    return True


# -- the replay ----------------------------------------------------------------------------
def decision_line(result, stamp_ns):
    """One canonical JSON line per tick (sorted keys, rounded floats): the compared stream."""
    record = result.record
    line = {'tick': record.tick, 'stamp_ns': stamp_ns, 'decision': record.decision}
    if result.action is not None:
        if result.action.values:
            line['values'] = {k: round(float(v), 6) for k, v in result.action.values.items()}
        else:
            line['text'] = result.action.text
    else:
        line['reason'] = result.refusal.reason
    return json.dumps(line, sort_keys=True)


def replay(bag, values, out, clock_mode='model', cost_model=None, start_s=0.0, end_s=None,
           remaps=None, log=print, warn=None):
    """Replay ``bag`` through a freshly configured engine; write ``out``; return the summary."""
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    from rt_llm_node.configure import configure_engine
    warn = warn or (lambda text: print(f'rt-llm-replay: warning: {text}', file=sys.stderr))
    store = get_typestore(Stores.LATEST)
    reader = open_bag(bag)
    try:
        connections = input_connections(reader, values, remaps or {}, store, warn)
        clock = ModelClock() if clock_mode == 'model' else WallClock()
        engine = configure_engine(values, clock=clock, log=lambda text: log(f'  {text}'),
                                  cost_model=cost_model)
        return _run(reader, connections, engine, clock, clock_mode, values, store, Path(out),
                    start_s, end_s, log, warn)
    finally:
        reader.close()


def _run(reader, connections, engine, clock, clock_mode, values, store, out, start_s, end_s,
         log, warn):
    from rosbags.rosbag2 import StoragePlugin
    from rosbags.rosbag2 import Writer
    period = 1.0 / values['rate_hz']
    margin = values['deadline_margin_ms'] / 1e3
    t_begin = reader.start_time + int(start_s * 1e9)
    t_stop = reader.end_time if end_s is None else min(reader.end_time,
                                                       reader.start_time + int(end_s * 1e9))
    if t_stop <= t_begin:
        raise ReplayError(f'nothing to replay between {start_s} s and {end_s} s '
                          f'(the bag lasts {(reader.end_time - reader.start_time) / 1e9:.2f} s)')
    topic_of = {c.topic: node_topic for node_topic, c in connections.items()}
    out.mkdir(parents=True, exist_ok=True)
    bag_out = out / 'replay'
    if bag_out.exists():
        shutil.rmtree(bag_out)
    writer = Writer(bag_out, version=9, storage_plugin=StoragePlugin.MCAP)
    writer.open()
    copies = {}
    for connection in reader.connections:
        if connection.msgtype in store.types:
            copies[connection.id] = writer.add_connection(
                connection.topic, connection.msgtype, typestore=store,
                offered_qos_profiles=getattr(connection.ext, 'offered_qos_profiles', ()) or ())
    action_type = values['action_type']
    action_conn = writer.add_connection(values['action_topic'], action_type, typestore=store)
    refusal_conn = writer.add_connection(REFUSAL_TOPIC, 'diagnostic_msgs/msg/DiagnosticArray',
                                         typestore=store)
    record_conn = writer.add_connection(RECORD_TOPIC, 'std_msgs/msg/String', typestore=store)
    # from the bag's start: an instruction sent long before --start is still in force
    messages = reader.messages(stop=t_stop + 1)
    pending = next(messages, None)
    snapshot, lines, records = {}, [], []
    last_action = None
    bad_messages = Counter()
    n_ticks = int((t_stop - t_begin) // int(period * 1e9)) + 1
    wall_started = time.perf_counter()
    # model clock: the plotter imports matplotlib on another core while the engine ticks; a
    # wall-clock replay's latencies are the point, so there it starts after the last tick
    plotter = TimelinePlotter() if clock_mode == 'model' else None
    try:
        try:
            for k in range(n_ticks):
                tick_ns = t_begin + int(round(k * period * 1e9))
                while pending is not None and pending[1] <= tick_ns:
                    connection, stamp_ns, raw = pending
                    if connection.id in copies and stamp_ns >= t_begin:
                        writer.write(copies[connection.id], stamp_ns, raw)
                    node_topic = topic_of.get(connection.topic)
                    if node_topic is not None:
                        try:
                            msg = store.deserialize_cdr(raw, connection.msgtype)
                            snapshot[node_topic] = (msg, stamp_ns / 1e9)
                        except Exception as exc:  # a corrupt message: skip it, keep going
                            bad_messages[connection.topic] += 1
                            if bad_messages[connection.topic] == 1:
                                warn(f'{connection.topic}: undecodable message skipped ({exc})')
                    pending = next(messages, None)
                stamp = tick_ns / 1e9
                if clock_mode == 'model':
                    clock.advance_to(stamp)
                    deadline = stamp + period - margin
                else:
                    now = clock.now()
                    deadline = now + period - margin
                result = engine.tick(dict(snapshot), stamp, deadline)
                done_ns = tick_ns + int(max(0.0, result.record.total_ms) * 1e6)
                if result.action is not None:
                    last_action = result.action
                    published = result.action
                else:
                    published = None
                    writer.write(refusal_conn, done_ns, store.serialize_cdr(
                        refusal_message(result.refusal, tick_ns, done_ns, period, store),
                        'diagnostic_msgs/msg/DiagnosticArray'))
                    mode = values['on_refusal']
                    if mode != 'none':
                        published = fallback_values(engine.grammar, mode, last_action)
                if published is not None:
                    writer.write(action_conn, done_ns, store.serialize_cdr(
                        to_store_message(action_namespace(published, action_type, period),
                                         action_type, store), action_type))
                record = result.record
                writer.write(record_conn, done_ns, store.serialize_cdr(
                    store.types['std_msgs/msg/String'](data=json.dumps(record.__dict__)),
                    'std_msgs/msg/String'))
                lines.append(decision_line(result, tick_ns))
                records.append(record)
        finally:
            writer.close()
        (out / 'actions.jsonl').write_text('\n'.join(lines) + '\n', encoding='utf-8')
        model = engine.admission.model
        (out / 'cost_model.json').write_text(model.to_json(), encoding='utf-8')
        plotter = plotter or TimelinePlotter()
        plotter.draw(records, period * 1e3, margin * 1e3, out / 'timeline.png', warn)
    finally:
        if plotter is not None:
            plotter.close()
    wall_s = time.perf_counter() - wall_started   # every output but summary.json written
    summary = summarize(records, (t_stop - t_begin) / 1e9, wall_s, clock_mode)
    summary['backend'] = engine.backend.name
    summary['skipped_messages'] = dict(bad_messages)
    (out / 'summary.json').write_text(json.dumps(summary, indent=2) + '\n', encoding='utf-8')
    log(f'{summary["ticks"]} ticks: {summary["actions"]} actions, {summary["refusals"]} '
        f'refusals {summary["refusals_by_reason"]}, late {summary["late"]}; '
        f'{summary["bag_seconds"]:.1f} s of bag in {wall_s:.1f} s '
        f'({summary["speed_x_realtime"]:.1f}x real time) -> {out}')
    return summary


def refusal_message(refusal, tick_ns, done_ns, period, store):
    """The ~/refusal DiagnosticArray the node publishes, as a rosbags message."""
    deadline_ns = tick_ns + int(round(period * 1e9))   # the end of the tick's period
    keys = [('tick', str(refusal.tick)), ('reason', refusal.reason),
            ('predicted_ms', f'{refusal.predicted_ms:.3f}'),
            ('available_ms', f'{refusal.available_ms:.3f}'),
            ('deadline_stamp', str(deadline_ns)), ('detail', refusal.detail[:200]),
            ('published_stamp', str(done_ns))]
    status = SimpleNamespace(level=1, name='/rt_llm_node', message=refusal.reason,
                             hardware_id='rt_llm_node',
                             values=[SimpleNamespace(key=k, value=v) for k, v in keys])
    array = SimpleNamespace(header=SimpleNamespace(stamp=_stamp(tick_ns), frame_id=''),
                            status=[status])
    return to_store_message(array, 'diagnostic_msgs/msg/DiagnosticArray', store)


def summarize(records, bag_seconds, wall_s, clock_mode):
    """Counts and latency percentiles of a replay."""
    latencies = np.array([r.total_ms for r in records]) if records else np.zeros(1)
    reasons = Counter(r.reason for r in records if r.decision == 'refusal')
    return {
        'clock': clock_mode,
        'ticks': len(records),
        'actions': sum(r.decision == 'action' for r in records),
        'refusals': sum(reasons.values()),
        'refusals_by_reason': dict(sorted(reasons.items())),
        'late': sum(r.late for r in records),
        'probes': sum(r.probe for r in records),
        'latency_ms': {'p50': round(float(np.percentile(latencies, 50)), 3),
                       'p99': round(float(np.percentile(latencies, 99)), 3),
                       'max': round(float(latencies.max()), 3)},
        'bag_seconds': round(bag_seconds, 3),
        'wall_seconds': round(wall_s, 3),
        'speed_x_realtime': round(bag_seconds / max(wall_s, 1e-9), 2),
    }


class TimelinePlotter:
    """Draws timeline.png in a child process started before the replay's first tick.

    Importing matplotlib and drawing take about 1 s, a fifth of a 60 s bag's whole replay on
    2 cores with the shipped policy; in a child process started first they run on another
    core while the engine ticks, and the child then only waits for the records. Tick
    latency against the deadline, refusals by reason, cache occupancy.
    """

    NO_MATPLOTLIB = 3   # the child's exit status when matplotlib cannot be imported

    def __init__(self):
        import os
        import subprocess
        # this package where the parent found it, installed or not
        package_root = str(Path(__file__).resolve().parents[1])
        path = os.environ.get('PYTHONPATH')
        env = dict(os.environ, PYTHONPATH=package_root + (os.pathsep + path if path else ''))
        self._proc = subprocess.Popen(
            [sys.executable, '-c', 'from rt_llm_node.replay import TimelinePlotter; '
             'TimelinePlotter.child()'],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def draw(self, records, period_ms, margin_ms, path, warn):
        """Send the records, wait for the PNG; a failure is a warning, never an error."""
        job = {'path': str(path), 'period_ms': period_ms, 'margin_ms': margin_ms,
               'stamp': [r.stamp for r in records], 'total_ms': [r.total_ms for r in records],
               'predicted_ms': [r.predicted_ms for r in records],
               'refusal': [r.reason if r.decision == 'refusal' else None for r in records],
               'cache_length': [r.cache_length for r in records]}
        try:
            _, err = self._proc.communicate(json.dumps(job).encode(), timeout=120)
        except Exception as exc:   # a child that hangs or died: the replay's outputs stand
            self.close()
            warn(f'timeline.png not drawn ({exc})')
            return
        if self._proc.returncode == self.NO_MATPLOTLIB:
            warn('matplotlib is not installed: no timeline.png')
        elif self._proc.returncode:
            tail = err.decode(errors='replace').strip().splitlines()[-1:] or ['no message']
            warn(f'timeline.png not drawn: {tail[0]}')

    def close(self):
        """Stop a child that has not finished (never given records, or hung) and reap it."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    @classmethod
    def child(cls):
        """The child process: import matplotlib now, then draw what stdin brings."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            sys.stdin.read()
            sys.exit(cls.NO_MATPLOTLIB)
        text = sys.stdin.read()
        if not text:          # the parent closed without a job
            return
        job = json.loads(text)
        if not job['stamp']:
            return
        t = np.array(job['stamp'])
        t = t - t[0]
        period_ms = job['period_ms']
        fig = Figure(figsize=(11, 6))
        ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={'height_ratios': [3, 1]})
        ax.plot(t, job['total_ms'], lw=0.8, label='tick latency (ms)')
        ax.plot(t, job['predicted_ms'], lw=0.6, alpha=0.7, label='predicted (ms)')
        ax.axhline(period_ms, color='red', ls='--', lw=1, label='tick deadline')
        ax.axhline(period_ms - job['margin_ms'], color='orange', ls=':', lw=1,
                   label='engine budget (deadline - margin)')
        reasons = sorted({r for r in job['refusal'] if r is not None})
        for i, reason in enumerate(reasons):
            xs = [tt for tt, r in zip(t, job['refusal']) if r == reason]
            ax.scatter(xs, [period_ms * (1.05 + 0.05 * i)] * len(xs), s=8, marker='|',
                       label=f'refusal: {reason}')
        ax.set_ylabel('ms')
        ax.legend(loc='upper right', fontsize=7)
        ax2.plot(t, job['cache_length'], lw=0.8, color='tab:green')
        ax2.set_ylabel('cache tokens')
        ax2.set_xlabel('bag time (s)')
        fig.tight_layout()
        fig.savefig(job['path'], dpi=90)


# -- comparing with a golden output ------------------------------------------------------------
def compare(out, golden, tolerance=1e-6, max_lines=10):
    """Differences between two output directories' decision streams, as text lines."""
    def load(directory):
        path = Path(directory) / 'actions.jsonl'
        try:
            return [json.loads(line) for line in path.read_text(encoding='utf-8').splitlines()
                    if line]
        except (OSError, ValueError) as exc:
            raise ReplayError(f'cannot read {path}: {exc}') from None
    new, old = load(out), load(golden)
    kinds, first = Counter(), []
    for a, b in zip(new, old):
        kind = None
        if a['decision'] != b['decision']:
            kind = f"{b['decision']} -> {a['decision']}"
        elif a['decision'] == 'refusal' and a.get('reason') != b.get('reason'):
            kind = 'refusal reason'
        elif a['decision'] == 'action':
            va, vb = a.get('values'), b.get('values')
            if (va is None) != (vb is None) or (va is None and a.get('text') != b.get('text')):
                kind = 'action text'
            elif va is not None and (set(va) != set(vb) or any(
                    not math.isclose(va[k], vb[k], abs_tol=tolerance) for k in va)):
                kind = 'action values'
        if kind:
            kinds[kind] += 1
            if len(first) < max_lines:
                first.append(f"  tick {a['tick']}: golden {_brief(b)} | now {_brief(a)}")
    if len(new) != len(old):
        kinds['tick count'] += 1
        first.append(f'  golden has {len(old)} ticks, this replay {len(new)}')
    if not kinds:
        return []
    return ([f'{sum(kinds.values())} differences against {golden}: '
             + ', '.join(f'{k} x{v}' for k, v in sorted(kinds.items())), 'first ones:'] + first)


def _brief(line):
    if line['decision'] == 'refusal':
        return f"refusal {line.get('reason')}"
    if 'values' in line:
        return 'action ' + ' '.join(f'{k}={v:g}' for k, v in line['values'].items())
    return f"action {line.get('text')!r}"


def choose_cost_model(args, values):
    """--cost-model, else (model clock) the golden's, else the one shipped beside the model.

    None means: calibrate on this machine, which makes admission decisions near the
    deadline depend on this machine's timing noise (a warning says so).
    """
    if args.cost_model:
        return read_cost_model(args.cost_model)
    if args.clock != 'model':
        return None
    candidates = []
    if args.expect:  # decide admission exactly as the golden run did
        candidates.append(Path(args.expect) / 'cost_model.json')
    from rt_llm_node.model.embedded import default_model_path
    candidates.append(Path(values['model_path'] or default_model_path()) / 'cost_model.json')
    for path in candidates:
        if path.exists():
            print(f'rt-llm-replay: cost model from {path}', file=sys.stderr)
            return read_cost_model(path)
    print('rt-llm-replay: warning: no cost model given: calibrating on this machine, so '
          'decisions near the deadline may differ between runs; pass --cost-model '
          '(e.g. the cost_model.json this run writes) for reproducible replays',
          file=sys.stderr)
    return None


def read_cost_model(path):
    """A CostModel from a cost_model.json (as replay writes it)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding='utf-8'))
        return CostModel(prefill=tuple(data['prefill']), decode=tuple(data['decode']),
                         compact=tuple(data['compact']))
    except OSError as exc:
        raise ReplayError(f'cannot read {path}: {exc}') from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ReplayError(f'{path}: not a cost model ({exc})') from None


# -- live mode ---------------------------------------------------------------------------------
def recorded_qos(connection):
    """{'reliable', 'transient_local', 'depth'} a player should offer for ``connection``,
    from the QoS its publishers offered when the bag was recorded; None if none recorded.

    As ``ros2 bag play`` does: reliable only if every recorded publisher was, transient
    local only if every one was (a best-effort or volatile publisher among them could not
    have served a subscriber that needs more), the deepest history of them.
    """
    from rosbags.rosbag2.metadata import QosDurability
    from rosbags.rosbag2.metadata import QosHistory
    from rosbags.rosbag2.metadata import QosReliability
    ext = getattr(connection, 'ext', None)
    profiles = list(getattr(ext, 'offered_qos_profiles', None) or ())
    if not profiles:
        return None
    # a keep-all publisher recorded depth 0: give the player a deep queue instead
    keep_all = any(p.history == QosHistory.KEEP_ALL for p in profiles)
    return {'reliable': all(p.reliability == QosReliability.RELIABLE for p in profiles),
            'transient_local': all(p.durability == QosDurability.TRANSIENT_LOCAL
                                   for p in profiles),
            'depth': 1000 if keep_all else max(1, max(int(p.depth) for p in profiles))}


def live(bag, remaps=None, publish_clock=False, rate=1.0, delay=1.0, log=print, warn=None):
    """Publish the bag's messages on their topics with the bag's timing (real rclpy)."""
    import importlib
    import rclpy
    from rclpy.qos import DurabilityPolicy
    from rclpy.qos import qos_profile_sensor_data
    from rclpy.qos import QoSProfile
    from rclpy.qos import ReliabilityPolicy
    from rclpy.serialization import deserialize_message
    from rt_llm_node.node import INSTRUCTION_QOS
    warn = warn or (lambda text: print(f'rt-llm-replay: warning: {text}', file=sys.stderr))
    reader = open_bag(bag)
    inverse = {bag_topic: node_topic for node_topic, bag_topic in (remaps or {}).items()}
    rclpy.init()
    node = rclpy.create_node('rt_llm_replay')
    try:
        publishers, classes = {}, {}
        for connection in reader.connections:
            package, _, name = connection.msgtype.split('/')
            try:
                cls = getattr(importlib.import_module(f'{package}.msg'), name)
            except (ImportError, AttributeError):
                warn(f'skipping {connection.topic}: {connection.msgtype} is not importable here')
                continue
            recorded = recorded_qos(connection)
            if recorded is not None:   # what the robot's publishers offered
                qos = QoSProfile(
                    depth=recorded['depth'],
                    reliability=(ReliabilityPolicy.RELIABLE if recorded['reliable']
                                 else ReliabilityPolicy.BEST_EFFORT),
                    durability=(DurabilityPolicy.TRANSIENT_LOCAL if recorded['transient_local']
                                else DurabilityPolicy.VOLATILE))
            else:
                # a bag without recorded QoS: sensor QoS for sensor data, the rest (an
                # instruction) reliable and transient local, as the node subscribes it (a
                # volatile publisher would not match that subscription)
                sensor = (package == 'sensor_msgs'
                          or connection.topic in ('/odom', '/detections'))
                qos = qos_profile_sensor_data if sensor else INSTRUCTION_QOS
                warn(f'{connection.topic}: no QoS recorded in the bag; publishing '
                     f"{'best effort (sensor data)' if sensor else 'reliable, transient local'}")
            topic = inverse.get(connection.topic, connection.topic)
            publishers[connection.id] = node.create_publisher(cls, topic, qos)
            classes[connection.id] = cls
        clock_pub = None
        if publish_clock:
            from rosgraph_msgs.msg import Clock
            clock_pub = node.create_publisher(Clock, '/clock', 10)
        ready = time.monotonic() + delay   # let DDS discovery match the subscribers first
        while time.monotonic() < ready:
            rclpy.spin_once(node, timeout_sec=0.05)
        t0_bag, t0_wall = reader.start_time, time.monotonic()
        count = 0
        for connection, stamp_ns, raw in reader.messages():
            if connection.id not in publishers:
                continue
            due = t0_wall + (stamp_ns - t0_bag) / 1e9 / rate
            while True:
                left = due - time.monotonic()
                if left <= 0:
                    break
                rclpy.spin_once(node, timeout_sec=min(left, 0.01))
            if clock_pub is not None:
                clock_msg = Clock()
                clock_msg.clock.sec, clock_msg.clock.nanosec = divmod(stamp_ns, 1_000_000_000)
                clock_pub.publish(clock_msg)
            publishers[connection.id].publish(deserialize_message(raw, classes[connection.id]))
            count += 1
        log(f'published {count} messages over {(reader.end_time - t0_bag) / 1e9 / rate:.1f} s')
        return count
    finally:
        reader.close()
        node.destroy_node()
        rclpy.try_shutdown()


# -- the command line ----------------------------------------------------------------------------
def build_parser():
    parser = argparse.ArgumentParser(prog='rt-llm-replay', description=__doc__.split('\n')[0])
    parser.add_argument('bag', help='rosbag2 directory (MCAP or sqlite3 storage) or .mcap file')
    parser.add_argument('--params', help="the node's parameter YAML (e.g. config/demo.yaml)")
    parser.add_argument('--out', default='out/replay', help='output directory')
    parser.add_argument('--clock', choices=('model', 'wall'), default='model')
    parser.add_argument('--cost-model', help='cost_model.json to use instead of calibrating')
    parser.add_argument('--expect', metavar='GOLDEN_DIR',
                        help='compare with an earlier --out directory; exit 1 on differences')
    parser.add_argument('--tolerance', type=float, default=1e-6,
                        help='absolute tolerance for action fields in --expect')
    parser.add_argument('--start', type=float, default=0.0, help='seconds into the bag')
    parser.add_argument('--end', type=float, default=None, help='seconds into the bag')
    parser.add_argument('--topics', nargs='*', default=[], metavar='NODE:=BAG',
                        help='remap: the node input NODE is the bag topic BAG')
    parser.add_argument('--live', action='store_true',
                        help='publish the bag on its topics in real time instead')
    parser.add_argument('--publish-clock', action='store_true', help='with --live: /clock too')
    parser.add_argument('--rate', type=float, default=1.0, help='with --live: playback speed')
    parser.add_argument('--delay', type=float, default=1.0,
                        help='with --live: seconds to wait for subscribers before playing')
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        remaps = parse_remaps(args.topics)
        if args.live:
            if args.rate <= 0 or args.delay < 0:
                raise ReplayError('--rate must be positive and --delay not negative')
            live(args.bag, remaps, args.publish_clock, args.rate, args.delay)
            return 0
        values = load_params(args.params)
        cost_model = choose_cost_model(args, values)
        replay(args.bag, values, args.out, args.clock, cost_model, args.start, args.end,
               remaps)
        if args.expect:
            diff = compare(args.out, args.expect, args.tolerance)
            if diff:
                print('\n'.join(diff))
                return EXIT_DIFFERENT
            print(f'same decisions as {args.expect}')
        return 0
    except ReplayError as exc:
        print(f'rt-llm-replay: error: {exc}', file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # configuration errors from the engine, model loading, ...
        from rt_llm_node.configure import ConfigurationError
        from rt_llm_node.model import CheckpointError
        if isinstance(exc, (ConfigurationError, CheckpointError, ValueError, OSError)):
            print(f'rt-llm-replay: error: {exc}', file=sys.stderr)
            return EXIT_ERROR
        raise


if __name__ == '__main__':
    sys.exit(main())
