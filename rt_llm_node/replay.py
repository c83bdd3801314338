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
import os
from pathlib import Path
import sys
import time
from types import SimpleNamespace

import numpy as np

from rt_llm_node.admission import CostModel
from rt_llm_node.bags import _stamp
from rt_llm_node.bags import BagError
from rt_llm_node.bags import input_connections
from rt_llm_node.bags import open_bag
from rt_llm_node.bags import root_topic
from rt_llm_node.bags import to_store_message
from rt_llm_node.codec import action_message
from rt_llm_node.codec import refusal_values
from rt_llm_node.engine import header_stamp_lag
from rt_llm_node.engine import ModelClock
from rt_llm_node.engine import WallClock
from rt_llm_node.files import FileError
from rt_llm_node.files import OutputFolder
from rt_llm_node.files import read_text
from rt_llm_node.files import read_yaml
from rt_llm_node.params import node_sections
from rt_llm_node.params import PARAMETERS
from rt_llm_node.player import live
from rt_llm_node.timeline import TimelinePlotter

EXIT_DIFFERENT = 1
EXIT_ERROR = 2
MAX_DECISIONS = 1 << 30      # a golden's actions.jsonl: ~100 bytes a tick
MAX_COST_MODEL = 1 << 20
REFUSAL_TOPIC = '/rt_llm_node/refusal'
RECORD_TOPIC = '/rt_llm_node/tick_record'
DIAGNOSTICS_TOPIC = '/diagnostics'


class ReplayError(BagError):
    """A bag, parameter file or golden output that cannot be replayed (the message says why)."""


# -- parameters --------------------------------------------------------------------------
def load_params(path=None, node_name='rt_llm_node'):
    """Defaults of every node parameter, overridden by a node YAML file's ros__parameters.

    The sections that apply are those ``ros2 run`` would apply to ``node_name``, under any
    namespace (``/ns/rt_llm_node``, ``rt_llm_node``, ``/**``), merged in file order.
    """
    values = {p.name: p.default for p in PARAMETERS}
    if path is None:
        return values
    try:
        data = read_yaml(path, 'parameters file')
    except FileError as exc:
        raise ReplayError(str(exc)) from None
    found, matched, looked_for = node_sections(data, '/' + node_name, any_namespace=True)
    if not matched:
        keys = ', '.join(map(str, data)) if isinstance(data, dict) else 'none'
        raise ReplayError(f'{path}: no "<node>: ros__parameters:" section for {node_name} '
                          f'(looked for {", ".join(looked_for)}; the file has: {keys})')
    unknown = sorted(set(found) - set(values))
    if unknown:
        raise ReplayError(f'{path}: unknown parameters {", ".join(unknown)}')
    values.update(found)
    return values


def parse_remaps(items):
    """['/scan:=/robot/scan', ...] -> {'/scan': '/robot/scan'} (node topic -> bag topic)."""
    remaps = {}
    for item in items or ():
        node_topic, _, bag_topic = (part.strip() for part in item.partition(':='))
        if not node_topic or not bag_topic or ':=' in bag_topic:
            raise ReplayError(f'--topics takes NODE_TOPIC:=BAG_TOPIC, got {item!r}')
        remaps[node_topic] = bag_topic
    return remaps


def check_span(start_s, end_s):
    """Raise ReplayError unless --start and --end are seconds into a bag (finite, >= 0)."""
    if not 0.0 <= start_s < math.inf or not (end_s is None or 0.0 <= end_s < math.inf):
        raise ReplayError(f'--start and --end are seconds into the bag (finite, not negative), '
                          f'not {start_s!r} and {end_s!r}')


def check_tolerance(tolerance):
    """Return ``tolerance`` where it is a finite number >= 0; ReplayError otherwise."""
    if not 0.0 <= tolerance < math.inf:   # NaN fails this too
        raise ReplayError(f'the tolerance must be a finite number >= 0, not {tolerance!r}')
    return tolerance


def action_namespace(action, action_type, period_s, stamp_ns=0, frame_id=''):
    """Return the action message as plain fields (the node builds the same with rclpy classes)."""
    return action_message(action, action_type, period_s,
                          lambda name, **fields: SimpleNamespace(**fields),
                          stamp=_stamp(stamp_ns), frame_id=frame_id)


def action_topic(values):
    """Return the action topic's absolute name (a node at the root namespace)."""
    return root_topic(values['action_topic'])


def output_topics(values):
    """Return the topics the node publishes (absolute names): a bag recorded with -a holds them."""
    return {action_topic(values), REFUSAL_TOPIC, RECORD_TOPIC, DIAGNOSTICS_TOPIC}


# -- the replay ----------------------------------------------------------------------------
def decision_line(result, stamp_ns):
    """One canonical JSON line per tick (sorted keys, rounded floats): the compared stream."""
    record = result.record
    line = {'tick': record.tick, 'stamp_ns': stamp_ns, 'decision': record.decision}
    if result.action is not None:
        if result.action.decoded is not None:   # limited: what the model chose, for the record
            line['decoded'] = {k: round(float(v), 6) for k, v in result.action.decoded.items()}
        if result.action.values:
            line['values'] = {k: round(float(v), 6) for k, v in result.action.values.items()}
        else:
            line['text'] = result.action.text
    else:
        line['reason'] = result.refusal.reason
    return json.dumps(line, sort_keys=True)


def replay(bag, values, out, clock_mode='model', cost_model=None, start_s=0.0, end_s=None,
           remaps=None, log=print, warn=None, force=False, timeline=True):
    """Replay ``bag`` through a freshly configured engine; write ``out``; return the summary.

    ``out`` is replaced only when it holds nothing but an earlier replay's output
    (``files.OutputFolder``); ``force`` writes beside anything else there. ``timeline``:
    draw timeline.png (a matplotlib process beside the replay; a fleet that fills every
    core leaves it out).
    """
    check_span(start_s, end_s)
    from rosbags.typesys import get_typestore
    from rosbags.typesys import Stores
    from rt_llm_node.configure import configure_engine
    warn = warn or (lambda text: print(f'rt-llm-replay: warning: {text}', file=sys.stderr))
    store = get_typestore(Stores.LATEST)
    folder = OutputFolder(out, 'rt-llm-replay', force)   # refused before any work
    reader = None
    try:
        reader = open_bag(bag)
        connections = input_connections(reader, values, remaps or {}, store, warn)
        clock = ModelClock() if clock_mode == 'model' else WallClock()
        engine = configure_engine(values, clock=clock, log=lambda text: log(f'  {text}'),
                                  cost_model=cost_model)
        # written into a fresh folder beside ``out`` and put in its place only when complete:
        # a replay that fails leaves an earlier output as it was, never a mix of the two
        folder.staging.mkdir()
        summary = _run(reader, connections, engine, clock, clock_mode, values, store,
                       folder.staging, start_s, end_s, log, warn, shown=out,
                       timeline=timeline)
        folder.commit()
        return summary
    finally:
        folder.discard()
        if reader is not None:
            reader.close()


def _run(reader, connections, engine, clock, clock_mode, values, store, out, start_s, end_s,
         log, warn, shown=None, timeline=True):
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
    bag_out = out / 'replay'
    writer = Writer(bag_out, version=9, storage_plugin=StoragePlugin.MCAP)
    writer.open()
    copies = {}
    ours = output_topics(values)
    recorded = sorted({c.topic for c in reader.connections if c.topic in ours})
    if recorded:   # e.g. ros2 bag record -a beside the node: its outputs are not inputs
        warn(f'the bag holds what the node published ({", ".join(recorded)}): not replayed '
             'as input; this replay writes its own')
    for connection in reader.connections:
        if connection.msgtype in store.types and connection.topic not in ours:
            copies[connection.id] = writer.add_connection(
                connection.topic, connection.msgtype, typestore=store,
                offered_qos_profiles=getattr(connection.ext, 'offered_qos_profiles', ()) or ())
    action_type = values['action_type']
    action_conn = writer.add_connection(action_topic(values), action_type, typestore=store)
    refusal_conn = writer.add_connection(REFUSAL_TOPIC, 'diagnostic_msgs/msg/DiagnosticArray',
                                         typestore=store)
    record_conn = writer.add_connection(RECORD_TOPIC, 'std_msgs/msg/String', typestore=store)
    lines, records = [], []
    guard = engine.guard
    bad_messages = Counter()

    def copy(connection, stamp_ns, raw):
        if connection.id in copies and stamp_ns >= t_begin:
            writer.write(copies[connection.id], stamp_ns, raw)
    ticks = bag_ticks(reader, topic_of, store, t_begin, t_stop, period, warn, bad_messages,
                      copy)
    wall_started = time.perf_counter()
    # model clock: the plotter imports matplotlib on another core while the engine ticks; a
    # wall-clock replay's latencies are the point, so there it starts after the last tick
    plotter = TimelinePlotter() if timeline and clock_mode == 'model' else None
    try:
        try:
            for tick_ns, snapshot in ticks:
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
                    published = result.action
                    guard.on_action(published, done_ns / 1e9)
                else:
                    writer.write(refusal_conn, done_ns, store.serialize_cdr(
                        refusal_message(result.refusal, tick_ns, done_ns, period, store),
                        'diagnostic_msgs/msg/DiagnosticArray'))
                    published = guard.on_refusal(values['on_refusal'], done_ns / 1e9, snapshot)
                if published is not None:
                    message = action_namespace(published, action_type, period, done_ns,
                                               values['action_frame_id'])
                    writer.write(action_conn, done_ns, store.serialize_cdr(
                        to_store_message(message, action_type, store), action_type))
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
        if timeline:
            plotter = plotter or TimelinePlotter()
            plotter.draw(records, period * 1e3, margin * 1e3, out / 'timeline.png', warn)
    finally:
        if plotter is not None:
            plotter.close()
    wall_s = time.perf_counter() - wall_started   # every output but summary.json written
    summary = summarize(records, (t_stop - t_begin) / 1e9, wall_s, clock_mode)
    summary['backend'] = engine.backend.name
    summary['skipped_messages'] = dict(bad_messages)
    summary['recorded_outputs_ignored'] = recorded
    (out / 'summary.json').write_text(json.dumps(summary, indent=2) + '\n', encoding='utf-8')
    log(f'{summary["ticks"]} ticks: {summary["actions"]} actions, {summary["refusals"]} '
        f'refusals {summary["refusals_by_reason"]}, late {summary["late"]}; '
        f'{summary["bag_seconds"]:.1f} s of bag in {wall_s:.1f} s '
        f'({summary["speed_x_realtime"]:.1f}x real time) -> {shown or out}')
    return summary


def bag_ticks(reader, topic_of, store, t_begin, t_stop, period, warn, bad_messages,
              on_message=None):
    """Yield (tick stamp ns, snapshot) for the ticks of a replay from ``t_begin`` to ``t_stop``.

    What the node would hold at each tick: the snapshot maps a node topic (``topic_of``: bag
    topic -> node topic) to (message, receive stamp s, header stamp lag) of the newest
    message stamped at or before the tick, read from the bag's start (an instruction sent
    long before ``t_begin`` is still in force). The same dict is yielded each time, updated.
    A message that cannot be decoded is skipped and counted in ``bad_messages`` (one warning
    a topic); ``on_message(connection, stamp ns, raw)`` sees every readable message as it
    passes. ReplayError where the bag's storage is corrupt.
    """
    messages = reader.messages(stop=t_stop + 1)
    read_from = reader.start_time

    def next_message():
        """Return the bag's next (connection, stamp, raw); ReplayError where it is corrupt."""
        try:
            return next(messages, None)
        except Exception as exc:   # rosbags' and the storage's own errors, OverflowError...
            at = (read_from - reader.start_time) / 1e9
            raise ReplayError(f'the bag is corrupt after {at:.3f} s: '
                              f'{type(exc).__name__}: {exc}') from None
    pending = next_message()
    snapshot = {}
    n_ticks = int((t_stop - t_begin) // int(period * 1e9)) + 1
    for k in range(n_ticks):
        tick_ns = t_begin + int(round(k * period * 1e9))
        while pending is not None and pending[1] <= tick_ns:
            connection, stamp_ns, raw = pending
            read_from = stamp_ns
            if not isinstance(raw, (bytes, bytearray, memoryview)):
                bad_messages[connection.topic] += 1   # e.g. a sqlite3 TEXT row
                if bad_messages[connection.topic] == 1:
                    warn(f'{connection.topic}: a message stored as '
                         f'{type(raw).__name__}, not bytes: skipped')
                pending = next_message()
                continue
            if on_message is not None:
                on_message(connection, stamp_ns, raw)
            node_topic = topic_of.get(connection.topic)
            if node_topic is not None:
                try:
                    msg = store.deserialize_cdr(raw, connection.msgtype)
                    snapshot[node_topic] = (msg, stamp_ns / 1e9,
                                            header_stamp_lag(msg, stamp_ns / 1e9))
                except Exception as exc:  # a corrupt message: skip it, keep going
                    bad_messages[connection.topic] += 1
                    if bad_messages[connection.topic] == 1:
                        warn(f'{connection.topic}: undecodable message skipped ({exc})')
            pending = next_message()
        yield tick_ns, snapshot


def refusal_message(refusal, tick_ns, done_ns, period, store):
    """Return the ~/refusal DiagnosticArray the node publishes, as a rosbags message."""
    deadline_ns = tick_ns + int(round(period * 1e9))   # the end of the tick's period
    keys = refusal_values(refusal, deadline_ns, done_ns)
    status = SimpleNamespace(level=1, name='/rt_llm_node', message=refusal.reason,
                             hardware_id='rt_llm_node',
                             values=[SimpleNamespace(key=k, value=v) for k, v in keys])
    array = SimpleNamespace(header=SimpleNamespace(stamp=_stamp(tick_ns), frame_id=''),
                            status=[status])
    return to_store_message(array, 'diagnostic_msgs/msg/DiagnosticArray', store)


def summarize(records, bag_seconds, wall_s, clock_mode):
    """Count and latency percentiles of a replay."""
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
        # speculative decoding: forward passes an action (prefill, decode steps and verify
        # passes), drafted tokens and those kept, verify passes (those beside a prefill too)
        'forward_passes_per_action': round(
            sum(1 + r.n_decode for r in records if r.decision == 'action')
            / max(1, sum(r.decision == 'action' for r in records)), 3),
        'drafted': sum(r.drafted for r in records),
        'drafted_kept': sum(r.accepted for r in records),
        'verify_passes': sum(r.verify_passes for r in records),
        'fused_passes': sum(r.fused for r in records),
        # new instructions placed after the system prompt: by a prefill, or restored by copy
        'instructions_prefilled': sum(r.instruction == 'prefilled' for r in records),
        'instructions_restored': sum(r.instruction == 'restored' for r in records),
        'latency_ms': {'p50': round(float(np.percentile(latencies, 50)), 3),
                       'p99': round(float(np.percentile(latencies, 99)), 3),
                       'max': round(float(latencies.max()), 3)},
        'bag_seconds': round(bag_seconds, 3),
        'wall_seconds': round(wall_s, 3),
        'speed_x_realtime': round(bag_seconds / max(wall_s, 1e-9), 2),
    }


# -- comparing with a golden output ------------------------------------------------------------
def load_decisions(directory):
    """Return an output directory's decisions (``actions.jsonl``) as dicts; ReplayError."""
    path = Path(directory) / 'actions.jsonl'
    try:
        lines = [json.loads(line) for line in read_text(
            path, 'decisions', MAX_DECISIONS).splitlines() if line]
    except FileError as exc:
        raise ReplayError(str(exc)) from None
    except ValueError as exc:
        raise ReplayError(f'cannot read {path}: {exc}') from None
    if not all(isinstance(line, dict) and line.get('decision') in ('action', 'refusal')
               for line in lines):
        raise ReplayError(f'{path}: not the decisions of an rt-llm-replay output')
    return lines


def differences(out, golden, tolerance=1e-6):
    """Return [(kind, golden line, new line)] where two outputs' decisions differ.

    Kinds: 'action -> refusal' (and back), 'refusal reason', 'action values' (a field
    beyond ``tolerance``), 'action text', 'tick count' (with None for the lines).
    """
    check_tolerance(tolerance)
    new, old = load_decisions(out), load_decisions(golden)
    found = []
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
            found.append((kind, b, a))
    if len(new) != len(old):
        found.append(('tick count', {'ticks': len(old)}, {'ticks': len(new)}))
    return found


def compare(out, golden, tolerance=1e-6, max_lines=10):
    """Differences between two output directories' decision streams, as text lines."""
    found = differences(out, golden, tolerance)
    if not found:
        return []
    kinds = Counter(kind for kind, _, _ in found)
    first = [f"  tick {a['tick']}: golden {_brief(b)} | now {_brief(a)}"
             for kind, b, a in found if kind != 'tick count'][:max_lines]
    first += [f"  golden has {b['ticks']} ticks, this replay {a['ticks']}"
              for kind, b, a in found if kind == 'tick count']
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
        if os.path.lexists(path):
            print(f'rt-llm-replay: cost model from {path}', file=sys.stderr)
            return read_cost_model(path)
    print('rt-llm-replay: warning: no cost model given: calibrating on this machine, so '
          'decisions near the deadline may differ between runs; pass --cost-model '
          '(e.g. the cost_model.json this run writes) for reproducible replays',
          file=sys.stderr)
    return None


def read_cost_model(path):
    """Return a CostModel from a cost_model.json (as replay and the node write it)."""
    path = Path(path)
    try:
        return CostModel.from_json(read_text(path, 'cost model', MAX_COST_MODEL))
    except FileError as exc:
        raise ReplayError(str(exc)) from None
    except ValueError as exc:
        raise ReplayError(f'{path}: {exc}') from None


# -- the command line ----------------------------------------------------------------------------
def build_parser():
    parser = argparse.ArgumentParser(prog='rt-llm-replay', description=__doc__.split('\n')[0])
    parser.add_argument('bag', help='rosbag2 directory (MCAP or sqlite3 storage) or .mcap file')
    parser.add_argument('--params', help="the node's parameter YAML (e.g. config/demo.yaml)")
    parser.add_argument('--out', default='out/replay',
                        help='output folder: new, empty, or an earlier replay output (replaced '
                        'whole once this one is complete)')
    parser.add_argument('--force', action='store_true',
                        help='write into an --out that holds other files too, beside them '
                        '(nothing this tool did not write is deleted)')
    parser.add_argument('--clock', choices=('model', 'wall'), default='model')
    parser.add_argument('--cost-model', help='cost_model.json to use instead of calibrating')
    parser.add_argument('--adapter', help='LoRA adapter folder (PEFT) merged into the model '
                        '(overrides the adapter_path parameter)')
    parser.add_argument('--state-dir', help="a node's state_dir (overrides the parameter): "
                        'start from its stored system prompt KV state and cost model, as the '
                        'robot restarted warm')
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
        check_tolerance(args.tolerance)
        check_span(args.start, args.end)
        if args.live:
            if not (0.0 < args.rate < math.inf and 0.0 <= args.delay < math.inf):
                raise ReplayError('--rate must be positive and --delay not negative (finite)')
            live(args.bag, remaps, args.publish_clock, args.rate, args.delay)
            return 0
        OutputFolder(args.out, 'rt-llm-replay', args.force).discard()   # refused at once
        values = load_params(args.params)
        if args.state_dir is not None:
            values['state_dir'] = args.state_dir
        if args.adapter is not None:
            values['adapter_path'] = args.adapter
        cost_model = choose_cost_model(args, values)
        replay(args.bag, values, args.out, args.clock, cost_model, args.start, args.end,
               remaps, force=args.force)
        if args.expect:
            diff = compare(args.out, args.expect, args.tolerance)
            if diff:
                print('\n'.join(diff))
                return EXIT_DIFFERENT
            print(f'same decisions as {args.expect}')
        return 0
    except (BagError, FileError) as exc:   # ReplayError included
        print(f'rt-llm-replay: error: {_one_line(exc)}', file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # anything else is an error too (exit 2), never "differences"
        print(f'rt-llm-replay: error: {type(exc).__name__}: {_one_line(exc)}', file=sys.stderr)
        if os.environ.get('RT_LLM_DEBUG'):
            raise
        return EXIT_ERROR


def _one_line(exc):
    return ' '.join(str(exc).split())


if __name__ == '__main__':
    sys.exit(main())
