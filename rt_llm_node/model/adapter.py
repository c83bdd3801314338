"""LoRA adapters as PEFT saves them, merged into a checkpoint's weights on load.

An adapter is a folder with ``adapter_config.json`` (``peft_type`` LORA, rank ``r``,
``lora_alpha``, ``target_modules``) and ``adapter_model.safetensors`` holding, for each adapted
projection of each layer, ``lora_A`` [r, in] and ``lora_B`` [out, r]. Merging adds
``scaling * B @ A`` to the projection's weight (``scaling`` = alpha / r, or alpha / sqrt(r)
with ``use_rslora``), the sum PEFT's ``merge_and_unload`` forms: the product in fp32,
rounded to the adapter's float format, then added and rounded once to the weight's format.
A quantized weight (a GGUF's) is dequantized and merged in fp32; ``weight_format`` may
quantize the merged model again. The backends then run an ordinary checkpoint: no adapter
math at run time.

Every problem is one CheckpointError naming the adapter's file and the tensor or key: an
unknown module, a missing half of a pair, rank 0, a non-finite value, or shapes that are not
the base's (an adapter made for another model).
"""

from dataclasses import dataclass
import math
from pathlib import Path
import re

import numpy as np

from rt_llm_node.files import FileError
from rt_llm_node.files import read_json
from rt_llm_node.model.errors import CheckpointError

ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'
MODULES = {'q_proj': 'self_attn', 'k_proj': 'self_attn', 'v_proj': 'self_attn',
           'o_proj': 'self_attn', 'gate_proj': 'mlp', 'up_proj': 'mlp', 'down_proj': 'mlp'}
_KEY = re.compile(r'(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+?)'
                  r'\.lora_([AB])(?:\.[\w-]+)?\.weight')
# options of a LoRA config this merge does not reproduce: refused, not silently ignored
_UNSUPPORTED = {'use_dora': (False, None), 'fan_in_fan_out': (False, None),
                'bias': ('none', None), 'modules_to_save': (None, []),
                'rank_pattern': ({}, None), 'alpha_pattern': ({}, None)}


@dataclass
class LoraAdapter:
    """A validated LoRA adapter: per base weight name, its (A, B) pair in fp32."""

    path: Path
    rank: int
    alpha: float
    scaling: float
    pairs: dict          # 'model.layers.3.self_attn.q_proj.weight' -> (A [r, in], B [out, r])
    dtype: str = 'F32'   # the float format the adapter's weights are stored in

    def describe(self):
        modules = sorted({name.split('.')[-2] for name in self.pairs})
        layers = len({name.split('.')[2] for name in self.pairs})
        return (f'LoRA rank {self.rank}, alpha {self.alpha:g} on {", ".join(modules)} of '
                f'{layers} layers')


def adapter_files(path):
    """Return the files that make an adapter (for fingerprints of a merged model's state)."""
    return [Path(path) / ADAPTER_CONFIG, Path(path) / ADAPTER_WEIGHTS]


def load_adapter(path):
    """Read and validate a PEFT LoRA adapter folder; CheckpointError if unusable."""
    from rt_llm_node.model.checkpoint import _read_safetensors
    path = Path(path)
    config_path = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise CheckpointError(path, f'not an adapter folder (it needs {ADAPTER_CONFIG} and '
                                    f'{ADAPTER_WEIGHTS})')
    try:
        config = read_json(config_path, 'adapter config', 1 << 20)
    except FileError as exc:
        raise CheckpointError(config_path, exc.reason) from None
    if not isinstance(config, dict):
        raise CheckpointError(config_path, 'not a JSON object')
    rank, alpha, scaling = _check_config(config, config_path)
    weights = path / ADAPTER_WEIGHTS
    tensors = _read_safetensors(weights)
    halves, dtypes = {}, set()
    for name, tensor in tensors.items():
        match = _KEY.fullmatch(name)
        if match is None:
            raise CheckpointError(weights, f"tensor '{name}' is not a LoRA weight of a "
                                           'decoder layer projection')
        layer, group, module, half = match.groups()
        if MODULES.get(module) != group:
            raise CheckpointError(weights, f"tensor '{name}' adapts module '{module}': only "
                                           f'{", ".join(MODULES)} are merged')
        base = f'model.layers.{int(layer)}.{group}.{module}.weight'
        values = tensor.to_float32()
        if values.ndim != 2:
            raise CheckpointError(weights, f"tensor '{name}' has shape {list(values.shape)}: "
                                           'not a matrix')
        if not np.all(np.isfinite(values)):
            raise CheckpointError(weights, f"tensor '{name}' holds NaN or infinite values")
        want = values.shape[0] if half == 'A' else values.shape[1]
        if want != rank:
            raise CheckpointError(weights, f"tensor '{name}' has shape {list(values.shape)}: "
                                           f'not rank r = {rank} of {ADAPTER_CONFIG}')
        halves.setdefault(base, {})[half] = (name, values)
        dtypes.add(tensor.dtype)
    pairs = {}
    for base, parts in sorted(halves.items()):
        if set(parts) != {'A', 'B'}:
            (name, _), = parts.values()
            missing = 'lora_B' if 'A' in parts else 'lora_A'
            raise CheckpointError(weights, f"tensor '{name}' has no {missing} beside it")
        pairs[base] = (parts['A'][1], parts['B'][1])
    if not pairs:
        raise CheckpointError(weights, 'holds no LoRA weights')
    dtype = 'F32' if len(dtypes) != 1 else dtypes.pop()
    return LoraAdapter(path, rank, alpha, scaling, pairs, dtype)


def _check_config(config, path):
    """(rank, alpha, scaling) of a LoRA config; CheckpointError naming the key otherwise."""
    kind = config.get('peft_type')
    if kind != 'LORA':
        raise CheckpointError(path, f"key 'peft_type' = {kind!r}: only LORA adapters merge")
    rank = config.get('r')
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(path, f"key 'r' = {rank!r}: the rank must be a positive integer")
    alpha = config.get('lora_alpha', 8)
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha)):
        raise CheckpointError(path, f"key 'lora_alpha' = {alpha!r}: not a finite number")
    for key, fine in _UNSUPPORTED.items():
        value = config.get(key)
        if value not in fine:
            raise CheckpointError(path, f"key '{key}' = {value!r} is not supported by the "
                                        'merge (supported: plain LoRA on linear projections)')
    targets = config.get('target_modules')
    names = [targets] if isinstance(targets, str) else targets
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in MODULES]
        if unknown:
            raise CheckpointError(path, f"key 'target_modules' names {unknown[0]!r}: only "
                                        f'{", ".join(MODULES)} are merged')
    elif not isinstance(targets, str) or not names:
        raise CheckpointError(path, f"key 'target_modules' = {targets!r}: a list of modules "
                                    'or a pattern')
    scaling = alpha / math.sqrt(rank) if config.get('use_rslora') else alpha / rank
    return rank, float(alpha), float(scaling)


def merge_adapter(checkpoint, adapter):
    """Add ``adapter``'s products into ``checkpoint``'s weights (in place); return it.

    The product is formed in fp32 and rounded to the adapter's own float format (PEFT's
    delta weight), then added to the weight and the sum rounded once to the weight's format
    (an in-place add in torch); a quantized weight is dequantized and merged in fp32. A
    pair whose shapes do not fit the base's weight is an adapter for another model.
    """
    from rt_llm_node.model.checkpoint import StoredTensor
    weights = adapter.path / ADAPTER_WEIGHTS
    for name, (a, b) in adapter.pairs.items():
        tensor = checkpoint.tensors.get(name)
        if tensor is None:
            raise CheckpointError(weights, f'adapts {name}, which the base '
                                           f'{checkpoint.path} does not have (another base?)')
        rows, cols = tensor.shape
        if a.shape[1] != cols or b.shape[0] != rows:
            raise CheckpointError(weights, f'adapts {name} as [{b.shape[0]}, {a.shape[1]}]; '
                                           f'the base {checkpoint.path} has it [{rows}, {cols}]: '
                                           'an adapter for another base')
        delta = (b @ a) * np.float32(adapter.scaling)   # fp32, [rows, cols]
        step = StoredTensor.from_float32(adapter.dtype, delta).to_float32()
        kind = 'F32' if tensor.dtype == 'QUANT' else tensor.dtype
        merged = StoredTensor.from_float32(kind, tensor.to_float32() + step)
        if not np.all(np.isfinite(merged.to_float32())):
            raise CheckpointError(weights, f'merging into {name} gives non-finite weights')
        checkpoint.tensors[name] = merged
    return checkpoint
