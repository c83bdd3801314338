"""Load an HF-layout checkpoint directory: config.json, safetensors, tokenizer.json.

Weights stay in their stored dtype (bf16 as raw ``uint16`` bits, fp16, fp32):
the numpy backend upcasts them to fp32, the CUDA backend uploads them as they
are. Every failure is a :class:`CheckpointError` naming the file and the tensor
or key. Nothing here unpickles.
"""

from collections import Counter
from dataclasses import dataclass
import json
from pathlib import Path

import numpy as np
import safetensors
from tokenizers import Tokenizer

from rt_llm_node.model.config import ModelConfig
from rt_llm_node.model.config import read_config
from rt_llm_node.model.config import read_small_file
from rt_llm_node.model.config import regular_file_size
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
    size = regular_file_size(path)
    try:
        with open(path, 'rb') as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f'corrupt or truncated safetensors file: {size} bytes')
            header = int.from_bytes(head, 'little')
            if header > min(MAX_HEADER, size - 8):
                raise CheckpointError(path, 'corrupt or truncated safetensors file: its header '
                                            f'claims {header} bytes of a {size}-byte file')
            f.seek(0)
            blob = f.read(size + 1)
    except OSError as exc:
        raise CheckpointError(path, f'cannot read: {exc.strerror}') from None
    if len(blob) != size:
        raise CheckpointError(path, 'the file changed while it was read')
    try:
        entries = safetensors.deserialize(blob)
    except Exception as exc:  # the Rust reader raises its own SafetensorError
        raise CheckpointError(path, f'corrupt or truncated safetensors file: {exc}') from None
    out = {}
    for name, info in entries:
        dtype = info['dtype']
        if dtype not in STORAGE:
            raise CheckpointError(path, f"tensor '{name}' has dtype {dtype}, "
                                        'expected one of BF16, F16, F32')
        storage, exponent = STORAGE[dtype]
        bits = np.frombuffer(info['data'], dtype=storage)
        if np.any((bits & exponent) == exponent):
            raise CheckpointError(path, f"tensor '{name}' holds NaN or infinite values")
        if dtype != 'F16' and len(bits):   # fp16 cannot exceed the bound: 65504
            values = StoredTensor(dtype, (len(bits),), bits).to_float32()
            largest = float(np.max(np.abs(values)))
            if largest > MAX_WEIGHT:
                raise CheckpointError(path, f"tensor '{name}' holds {largest:.3g}: weights "
                                            f'beyond {MAX_WEIGHT:g} overflow the fp32 forward')
        out[name] = StoredTensor(dtype, tuple(info['shape']), bits)
    return out


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
