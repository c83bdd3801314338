"""rosbag2 files through ``rosbags`` (no ROS install).

Open a bag, pick the node's input connections, register message definitions a bag carries, and
build rosbags messages from any object with the right field names (what replay and the demo
recorder write).
"""

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from rt_llm_node.codec import normalize_type
from rt_llm_node.files import check_regular
from rt_llm_node.files import FileError
from rt_llm_node.files import GB
from rt_llm_node.files import MB

MAX_METADATA = 16 * MB
MAX_BAG_FILE = 1024 * GB


class BagError(RuntimeError):
    """A bag that cannot be read or does not provide what was asked (one clear line)."""


def _base_value(value, kind):
    if kind == 'string':
        return '' if value is None else str(value)
    if kind == 'bool':
        return bool(value)
    if kind in ('float32', 'float64'):
        return 0.0 if value is None else float(value)
    return 0 if value is None else int(value)


def to_store_message(obj, msgtype, store):
    """Return a rosbags message of ``msgtype`` with the fields of ``obj`` (any object, by name)."""
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


def open_bag(path):
    """Return an opened rosbags Reader (MCAP or sqlite3 storage); BagError when unreadable."""
    from rosbags.rosbag2 import Reader
    path = Path(path)
    if not path.exists():
        raise BagError(f'{path}: no such bag')
    _check_files(path)
    try:
        reader = Reader(path)
        reader.open()
    except Exception as exc:  # rosbags raises ReaderError and storage-specific errors
        raise BagError(f'{path}: not a readable rosbag2 ({type(exc).__name__}: {exc})'
                       ) from None
    return reader


def _check_files(path):
    """Refuse a bag whose files a reader could hang on or read without end.

    rosbags opens them itself: each must be a regular file (no FIFO, no device), and
    ``metadata.yaml`` small, checked through the guarded reader first.
    """
    files = [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if not p.name.startswith('.'))
    for file in files:
        if file.is_dir():
            continue
        limit = MAX_METADATA if file.name == 'metadata.yaml' else MAX_BAG_FILE
        try:
            check_regular(file, 'bag file', limit)
        except FileError as exc:
            raise BagError(str(exc)) from None


def root_topic(topic, node_name='rt_llm_node'):
    """Return ``topic`` as the node at the root namespace resolves it.

    ``joint_states`` -> ``/joint_states``, ``~/x`` -> ``/rt_llm_node/x``: the names a bag
    recorded there holds.
    """
    if topic.startswith('/'):
        return topic
    if topic.startswith('~'):
        return f'/{node_name}/{topic[1:].lstrip("/")}'
    return '/' + topic


def input_connections(reader, values, remaps, store, warn):
    """{node topic: connection} for the configured inputs; errors for missing required ones.

    A relative input topic is looked for as the node at the root namespace would subscribe to
    it; a remap may name the input either way.
    """
    by_topic = {}
    for connection in reader.connections:
        by_topic.setdefault(connection.topic, connection)
    chosen, problems = {}, []
    for i, topic in enumerate(values['input_topics']):
        bag_topic = remaps.get(topic, remaps.get(root_topic(topic), root_topic(topic)))
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
        raise BagError('the bag does not provide the configured inputs: '
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
