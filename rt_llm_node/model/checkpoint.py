"""Load an HF-layout checkpoint directory: config.json, safetensors, tokenizer.json.

Weights stay in their stored dtype (bf16 as raw ``uint16`` bits, fp16, fp32):
the numpy backend upcasts them to fp32, the CUDA backend uploads them as they
are. Every failure is a :class:`CheckpointError` naming the file and the tensor
or key. Nothing here unpickles.
"""

from collections import Counter
from dataclasses import dataclass
import json
import mmap
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from rt_llm_node.model.config import ModelConfig
from rt_llm_node.model.config import open_checkpoint_file
from rt_llm_node.model.config import read_config
from rt_llm_node.model.config import read_small_file
from rt_llm_node.model.errors import CheckpointError

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
TOKENIZER_FILE = 'tokenizer.json'
# safetensors dtype -> (numpy storage dtype, mask of the exponent bits)
STORAGE = {
    'BF16': (np.uint16, 0x7F80),
    'F16': (np.uint16, 0x7C00),
    'F32': (np.uint32, 0x7F800000),
}
MAX_HEADER = 100 << 20     # safetensors' own limit on its JSON header
MAX_SAFETENSORS = 64 << 30  # one weights file (mapped, not read whole)
MAX_INDEX = 64 << 20       # model.safetensors.index.json
MAX_TOKENIZER = 256 << 20  # tokenizer.json
# Larger weights make the fp32 forward overflow (a product of a few such sums is past
# 3.4e38); trained models stay orders of magnitude below.
MAX_WEIGHT = 1e6
# Buffers some exporters save beside the weights; they carry no parameters.
IGNORED_SUFFIXES = ('.rotary_emb.inv_freq',)


@dataclass
class StoredTensor:
    """One tensor as stored: ``bits`` holds the raw elements (uint16 or uint32)."""

    dtype: str          # 'BF16', 'F16' or 'F32'
    shape: tuple
    bits: np.ndarray

    @classmethod
    def from_float32(cls, dtype, values):
        """Store float32 ``values`` as ``dtype`` (BF16 and F16 rounded to nearest, even)."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        if dtype == 'BF16':
            bits = values.view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        elif dtype == 'F16':
            bits = values.astype(np.float16).view(np.uint16)
        else:
            bits = values.view(np.uint32).copy()
        return cls(dtype, tuple(values.shape), bits.reshape(-1))

    def to_float32(self):
        """Upcast to a new float32 array of ``shape``."""
        if self.dtype == 'BF16':
            return (self.bits.astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        if self.dtype == 'F16':
            return self.bits.view(np.float16).astype(np.float32).reshape(self.shape)
        return self.bits.view(np.float32).reshape(self.shape).copy()


@dataclass
class Checkpoint:
    """A validated checkpoint: config, stored tensors by HF name, tokenizer."""

    path: Path
    config: ModelConfig
    tensors: dict
    tokenizer: Tokenizer

    def float32(self, name):
        """Return tensor ``name`` upcast to float32."""
        return self.tensors[name].to_float32()

    def describe_weights(self):
        """Say how the weights are held, e.g. 'BF16' or 'Q4_K x 96, Q6_K x 17, F32 x 45'."""
        kinds = Counter(t.source if t.dtype == 'QUANT' else t.dtype
                        for t in self.tensors.values())
        if len(kinds) == 1:
            return next(iter(kinds))
        return ', '.join(f'{k} x {n}' for k, n in kinds.most_common())


def _read_safetensors(path):
    """Read a safetensors file lazily: tensors are views of a read-only map of the file.

    The header is checked against the file before anything is mapped (its length, each
    tensor's dtype, shape and extent, the extents covering the data without overlap), so
    a damaged or foreign file of any size is one error naming it and the tensor.
    """
    with open_checkpoint_file(path, MAX_SAFETENSORS) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, f'corrupt or truncated safetensors file: {size} bytes')
        n = int.from_bytes(head, 'little')
        if not 2 <= n <= min(MAX_HEADER, size - 8):
            raise CheckpointError(path, 'corrupt or truncated safetensors file: its header '
                                        f'claims {n} bytes of a {size}-byte file')
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CheckpointError(path, f'corrupt safetensors header: {exc}') from None
        entries = _safetensors_entries(header, path)
        data_start, end = 8 + n, max((e[4] for e in entries), default=0)
        if data_start + end != size:
            raise CheckpointError(path, 'corrupt or truncated safetensors file: its tensors '
                                        f'end at byte {data_start + end} of a {size}-byte file')
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if end else b''
    out = {}
    for name, dtype, shape, start, stop in entries:
        storage, exponent = STORAGE[dtype]
        bits = np.frombuffer(data, dtype=storage, count=(stop - start) // storage().itemsize,
                             offset=data_start + start)
        if np.any((bits & exponent) == exponent):
            raise CheckpointError(path, f"tensor '{name}' holds NaN or infinite values")
        if dtype != 'F16' and len(bits):   # fp16 cannot exceed the bound: 65504
            values = StoredTensor(dtype, (len(bits),), bits).to_float32()
            largest = float(np.max(np.abs(values)))
            if largest > MAX_WEIGHT:
                raise CheckpointError(path, f"tensor '{name}' holds {largest:.3g}: weights "
                                            f'beyond {MAX_WEIGHT:g} overflow the fp32 forward')
        out[name] = StoredTensor(dtype, shape, bits)
    return out


def _safetensors_entries(header, path):
    """[(name, dtype, shape, start, stop)] of a safetensors header, each extent checked."""
    if not isinstance(header, dict):
        raise CheckpointError(path, 'corrupt safetensors header: not a JSON object')
    entries = []
    for name, info in header.items():
        if name == '__metadata__':
            continue
        if not isinstance(info, dict):
            raise CheckpointError(path, f"tensor '{name}': its header entry is not an object")
        dtype, shape, offsets = info.get('dtype'), info.get('shape'), info.get('data_offsets')
        if dtype not in STORAGE:
            raise CheckpointError(path, f"tensor '{name}' has dtype {dtype}, "
                                        'expected one of BF16, F16, F32')
        if (not isinstance(shape, list) or len(shape) > 8 or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
            raise CheckpointError(path, f"tensor '{name}' has shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or any(
                isinstance(o, bool) or not isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(path, f"tensor '{name}' has data_offsets {offsets!r}")
        need = int(np.prod(shape, dtype=object)) * np.dtype(STORAGE[dtype][0]).itemsize
        if offsets[1] - offsets[0] != need:
            raise CheckpointError(path, f"tensor '{name}' spans {offsets[1] - offsets[0]} "
                                        f'bytes, its shape {shape} in {dtype} needs {need}')
        entries.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    spans = sorted((e[3], e[4], e[0]) for e in entries)
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise CheckpointError(path, f"tensors '{a}' and '{b}' overlap (bytes {a0}..{a1} "
                                        f'and {b0}..{b1})')
    return entries


def _read_all_tensors(directory):
    single = directory / SINGLE_FILE
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(read_small_file(index, MAX_INDEX).decode(
                'utf-8'))['weight_map']
            if not isinstance(weight_map, dict):
                raise TypeError('weight_map is not an object')
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(index, f"unreadable key 'weight_map': {exc}") from None
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if Path(shard).name != shard:
                raise CheckpointError(index, f'shard name {shard!r} is not a plain file name')
            for name, tensor in _read_safetensors(shard_path).items():
                if weight_map.get(name) != shard:
                    raise CheckpointError(shard_path, f"tensor '{name}' is not listed for this "
                                                      f'shard in {INDEX_FILE}')
                tensors[name] = tensor
        for name, shard in weight_map.items():
            if name not in tensors:
                raise CheckpointError(directory / shard, f"tensor '{name}' listed in "
                                                         f'{INDEX_FILE} is missing')
        return tensors, index
    if single.exists():
        return _read_safetensors(single), single
    raise CheckpointError(directory, f'neither {SINGLE_FILE} nor {INDEX_FILE} found')


def _check_tensors(config, tensors, where, source='config.json'):
    layers = {int(name.split('.')[2]) for name in tensors
              if name.startswith('model.layers.') and name.split('.')[2].isdigit()}
    if not layers >= set(range(config.num_layers)):   # before listing every expected shape
        raise CheckpointError(where, f'the tensors hold layers {_ranges(layers)}, '
                                     f'{source} says num_hidden_layers = {config.num_layers}')
    expected = config.tensor_shapes()
    for name in list(tensors):
        if name.endswith(IGNORED_SUFFIXES):
            del tensors[name]
        elif name == 'lm_head.weight' and config.tie_word_embeddings:
            del tensors[name]  # tied: the embedding is the head; a stored copy is unused
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(where, f"missing tensor '{name}'")
        if tensors[name].shape != shape:
            raise CheckpointError(where, f"tensor '{name}' has shape {list(tensors[name].shape)}, "
                                         f'expected {list(shape)}')
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(where, f"unexpected tensor '{extra[0]}' "
                                     f'({len(extra)} unexpected in all)')


def _ranges(numbers):
    numbers = sorted(numbers)
    if not numbers:
        return 'none'
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f'{numbers[0]}..{numbers[-1]}'
    return ', '.join(map(str, numbers[:8])) + (' ...' if len(numbers) > 8 else '')


def load_tokenizer(directory, config=None):
    """Read ``DIR/tokenizer.json``; check it fits the embedding when ``config`` is given."""
    path = Path(directory) / TOKENIZER_FILE
    text = read_small_file(path, MAX_TOKENIZER)
    try:
        tokenizer = Tokenizer.from_str(text.decode('utf-8'))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(path, f'unreadable tokenizer: {exc}') from None
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if config is not None and n > config.vocab_size:
        raise CheckpointError(path, f'tokenizer has {n} tokens but the embedding '
                                    f"'model.embed_tokens.weight' has only "
                                    f'{config.vocab_size} rows')
    return tokenizer


def load_checkpoint(directory):
    """Load and validate a checkpoint; raise CheckpointError if unusable.

    ``directory``: an HF-layout folder, or a ``.gguf`` file.
    """
    directory = Path(directory)
    if directory.suffix.lower() == '.gguf' and not directory.is_dir():
        from rt_llm_node.model.gguf_file import load_gguf
        return load_gguf(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, 'not a checkpoint directory')
    config = read_config(directory)
    tensors, where = _read_all_tensors(directory)
    _check_tensors(config, tensors, where)
    tokenizer = load_tokenizer(directory, config)
    return Checkpoint(directory, config, tensors, tokenizer)


def load_model(path, adapter='', weight_format='native'):
    """Load a checkpoint, merge a LoRA ``adapter`` folder into it, quantize as asked.

    What the node, replay, evaluation and generation run: ``weight_format`` quantizes the
    merged float matrices (a GGUF's quantized ones merged with an adapter become fp32 first).
    """
    from rt_llm_node.model.adapter import load_adapter
    from rt_llm_node.model.adapter import merge_adapter
    from rt_llm_node.model.quant import quantize_checkpoint
    checkpoint = load_checkpoint(path)
    if adapter:
        merge_adapter(checkpoint, load_adapter(adapter))
    return quantize_checkpoint(checkpoint, weight_format)
