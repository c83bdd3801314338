"""The argument structs of the one-launch decode steps, packed from one field list a struct.

``decode_persistent`` and ``decode_dataflow`` read their pointers and sizes from structs in
device memory (``DecodeLayer`` and ``DecodeArgs`` in cuda/persistent_ops.cuh,
``DataflowArgs`` in cuda/decode_dataflow.cu). Each struct is written here once as its C
field names and kinds in order; ``pack`` builds the bytes from named values, and
test/unit/test_launch_args.py reads the C structs and checks that both sides list the same
fields in the same order, so the two cannot drift apart silently. Pure: no CuPy.
"""

import re
import struct

CODES = {'ptr': 'Q', 'int': 'i', 'float': 'f'}

DECODE_LAYER = tuple((name, 'ptr') for name in (
    'attn_norm', 'wqkv', 'bqkv', 'wo', 'mlp_norm', 'wgate_up', 'wdown', 'k', 'v', 'scores',
    'ml'))
DECODE_ARGS = (
    *((name, 'ptr') for name in (
        'layers', 'embed', 'final_norm', 'lm_head', 'cos_t', 'sin_t', 'x', 'q', 'attn_out',
        'act', 'part_ml', 'part_o', 'logits', 'mass', 'counters', 'bar')),
    *((name, 'int') for name in (
        'hidden', 'inter', 'n_heads', 'n_kv', 'head_dim', 'cap', 'vocab', 'n_layers',
        'n_splits')),
    ('eps', 'float'), ('scale', 'float'))
DATAFLOW_ARGS = (('tasks', 'ptr'), ('ready', 'ptr'), ('max_len', 'int'), ('n_ready', 'int'),
                 ('n_lm', 'int'))


def layout(fields):
    """Return the struct module format of ``fields``: C's layout, pointers first."""
    kinds = [kind for _, kind in fields]
    pointers = kinds.count('ptr')
    if kinds[:pointers] != ['ptr'] * pointers:
        raise ValueError('pointers go first: with 4-byte fields before them C would pad')
    return '<' + ''.join(CODES[kind] for kind in kinds)


def pack(fields, values):
    """Return the bytes of the struct ``fields`` holding ``values`` (name -> value)."""
    names = [name for name, _ in fields]
    if set(values) != set(names):
        raise ValueError(f'fields missing {sorted(set(names) - set(values))}, unknown '
                         f'{sorted(set(values) - set(names))}')
    return struct.pack(layout(fields), *[values[name] for name in names])


_TYPES = (('float', 'float'), ('int', 'int'), ('unsigned', 'int'))


def c_struct(source, name):
    """Return [(field, kind)] of C struct ``name`` in ``source`` (pointer, int or float)."""
    match = re.search(r'struct\s+' + name + r'\s*\{(.*?)\};', source, re.S)
    if not match:
        raise ValueError(f'no struct {name}')
    fields = []
    for declaration in re.sub(r'//[^\n]*', '', match.group(1)).split(';'):
        declaration = ' '.join(declaration.split())
        if not declaration:
            continue
        words = re.match(r'(?:const\s+)?(\w+)\s*(.*)', declaration)
        base, names = words.group(1), words.group(2)
        for item in names.split(','):
            item = item.strip()
            field = item.lstrip('*').strip()
            if item.startswith('*'):
                kind = 'ptr'
            else:
                kind = dict(_TYPES).get(base)
                if kind is None:
                    raise ValueError(f'struct {name}: field {field} of type {base}')
            fields.append((field, kind))
    return fields
