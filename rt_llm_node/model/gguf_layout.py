"""A GGUF file's layout checked against the file before any reader walks it.

The ``gguf`` package trusts the counts and extents a file states: an array that claims 10^9
elements is walked until memory runs out, two tensors may share bytes, a tensor's extent
may fall outside the data section. ``check_layout`` walks the header itself over a
read-only map of the file, with every count bounded by the bytes left and every extent
checked, and raises a CheckpointError naming the file, the key or tensor as the file spells
it, and the value.

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; metadata entries (key string, value type u32, value); tensor infos
(name string, n_dims u32, dims u64 x n_dims, type u32, offset u64); padding to the
alignment (``general.alignment``, default 32); the data section. A string is a u64 length
and that many bytes; an array is an element type u32, a count u64 and the elements.
"""

import mmap
import struct

from rt_llm_node.files import FileError
from rt_llm_node.files import GB
from rt_llm_node.files import open_regular
from rt_llm_node.model.errors import CheckpointError

MAX_GGUF = 64 * GB           # the largest model file this package takes
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_DIMS = 4                 # ggml's GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40       # per tensor
MAX_STRING = 1 << 20         # a key, a tensor name or one metadata string
SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
TYPE_NAMES = {0: 'uint8', 1: 'int8', 2: 'uint16', 3: 'int16', 4: 'uint32', 5: 'int32',
              6: 'float32', 7: 'bool', 8: 'string', 9: 'array', 10: 'uint64', 11: 'int64',
              12: 'float64'}


def _block_sizes():
    """{ggml type id: (elements a block, bytes a block)} from the gguf package's table."""
    from gguf import GGML_QUANT_SIZES
    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}


class _Walk:
    """A cursor over the mapped file that never reads past its end."""

    def __init__(self, data, path):
        self.data, self.path, self.at = data, path, 0
        self.size = len(data)

    def fail(self, detail):
        raise CheckpointError(self.path, detail)

    def take(self, n, what):
        if n < 0 or self.at + n > self.size:
            self.fail(f'{what} at byte {self.at} needs {n} bytes, {self.size - self.at} are '
                      'left: truncated or corrupt')
        start = self.at
        self.at += n
        return start

    def u32(self, what):
        return struct.unpack_from('<I', self.data, self.take(4, what))[0]

    def u64(self, what):
        return struct.unpack_from('<Q', self.data, self.take(8, what))[0]

    def string(self, what, limit=MAX_STRING):
        n = self.u64(what)
        if n > min(limit, self.size - self.at):
            self.fail(f'{what} claims a string of {n} bytes, {self.size - self.at} are left')
        start = self.take(n, what)
        try:
            return bytes(self.data[start:start + n]).decode('utf-8')
        except UnicodeDecodeError:
            self.fail(f'{what} is not UTF-8 text')

    def value(self, kind, key, depth=0):
        """Step over one value of type ``kind``; return it where small (scalars, strings)."""
        if kind in SCALARS:
            start = self.take(SCALARS[kind], f"metadata '{key}'")
            fmt = {0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q',
                   11: 'q', 12: 'd'}[kind]
            return struct.unpack_from('<' + fmt, self.data, start)[0]
        if kind == STRING:
            return self.string(f"metadata '{key}'")
        if kind != ARRAY or depth:
            self.fail(f"metadata '{key}' has value type {kind}, not one GGUF defines"
                      + (' (arrays of arrays are not read)' if kind == ARRAY else ''))
        element = self.u32(f"metadata '{key}' element type")
        count = self.u64(f"metadata '{key}' count")
        left = self.size - self.at
        if element in SCALARS:
            if count * SCALARS[element] > left:
                self.fail(f"metadata '{key}' claims {count} {TYPE_NAMES[element]} elements "
                          f'({count * SCALARS[element]} bytes), {left} bytes are left')
            self.take(count * SCALARS[element], f"metadata '{key}'")
            return None
        if element != STRING:
            self.fail(f"metadata '{key}' is an array of type {element}, not one GGUF defines")
        if count * 8 > left:   # each string takes at least its 8-byte length
            self.fail(f"metadata '{key}' claims {count} strings, more than the {left} bytes "
                      'left can hold')
        for index in range(count):
            n = self.u64(f"metadata '{key}'[{index}]")
            if n > min(MAX_STRING, self.size - self.at):
                self.fail(f"metadata '{key}'[{index}] claims a string of {n} bytes, "
                          f'{self.size - self.at} are left')
            self.at += n
        return None


def check_layout(path):
    """Check a GGUF file's header, metadata and tensor table against the file itself.

    Returns the file's size. Raises CheckpointError (file, key or tensor, value) for a
    count or length the bytes left cannot hold, a dimension that is not positive or whose
    product is out of bounds, an unknown tensor type, an extent outside the data section or
    two tensors over the same bytes.
    """
    try:
        f = open_regular(path, 'GGUF model', MAX_GGUF)
    except FileError as exc:
        raise CheckpointError(path, exc.reason) from None
    with f:
        head = f.read(24)
        size = f.seek(0, 2)
        if size < 24:
            raise CheckpointError(path, f'not a GGUF file: {size} bytes')
        if head[:4] != b'GGUF':   # before mapping: a huge file of anything else stays unread
            raise CheckpointError(path, 'not a GGUF file (no GGUF magic)')
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(_Walk(data, path))


def _walk(w):
    if bytes(w.data[:4]) != b'GGUF':
        w.fail('not a GGUF file (no GGUF magic)')
    w.at = 4
    version = w.u32('version')
    if version not in (2, 3):
        w.fail(f'GGUF version {version} is not supported (2 or 3)')
    n_tensors = w.u64('tensor count')
    n_keys = w.u64('metadata count')
    if n_tensors > MAX_TENSORS:
        w.fail(f'the header claims {n_tensors} tensors (at most {MAX_TENSORS})')
    if n_keys > MAX_KEYS:
        w.fail(f'the header claims {n_keys} metadata keys (at most {MAX_KEYS})')
    alignment = 32
    for index in range(n_keys):
        key = w.string(f'metadata key {index}')
        kind = w.u32(f"metadata '{key}' value type")
        value = w.value(kind, key)
        if key == 'general.alignment':
            if kind != 4 or not value or value & (value - 1) or value > 1 << 16:
                w.fail(f"metadata 'general.alignment' = {value!r}: not a power of two "
                       'up to 65536 (uint32)')
            alignment = value
    sizes = _block_sizes()
    tensors = []
    for index in range(n_tensors):
        name = w.string(f'tensor {index} name')
        n_dims = w.u32(f"tensor '{name}' dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            w.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [w.u64(f"tensor '{name}' dimension {d}") for d in range(n_dims)]
        kind = w.u32(f"tensor '{name}' type")
        offset = w.u64(f"tensor '{name}' offset")
        if any(d == 0 for d in dims):
            w.fail(f"tensor '{name}' has dimensions {dims}: each must be positive")
        elements = 1
        for d in dims:
            elements *= d
        if elements > MAX_ELEMENTS:
            w.fail(f"tensor '{name}' has dimensions {dims}: {elements} elements, more than "
                   f'{MAX_ELEMENTS}')
        if kind not in sizes:
            w.fail(f"tensor '{name}' has type {kind}, not one ggml defines")
        block, block_bytes = sizes[kind]
        if dims[0] % block:
            w.fail(f"tensor '{name}' has rows of {dims[0]} elements, not whole blocks of "
                   f'{block} for its type')
        tensors.append((name, offset, elements // block * block_bytes))
    start = -(-w.at // alignment) * alignment
    data_bytes = w.size - start
    spans = []
    for name, offset, n_bytes in tensors:
        if offset % alignment:
            w.fail(f"tensor '{name}' starts at data offset {offset}, not a multiple of the "
                   f'alignment {alignment}')
        if offset + n_bytes > data_bytes:
            w.fail(f"tensor '{name}' ends at byte {start + offset + n_bytes} of a "
                   f'{w.size}-byte file: truncated, or its offset {offset} is wrong')
        spans.append((offset, offset + n_bytes, name))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            w.fail(f"tensors '{a}' and '{b}' overlap (data bytes {a0}..{a1} and {b0}..{b1})")
    return w.size
