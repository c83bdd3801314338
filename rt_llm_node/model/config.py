"""ModelConfig: the architecture facts of an HF-layout decoder, parsed strictly.

Supported: ``LlamaForCausalLM`` (SmolLM2, Llama 3.x) and ``Qwen2ForCausalLM``.
Both the transformers 4 layout (``rope_theta`` + ``rope_scaling``) and the
transformers 5 layout (``rope_parameters``) of ``config.json`` are read.
"""

from dataclasses import dataclass
from dataclasses import field
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from rt_llm_node.files import FileError
from rt_llm_node.files import open_regular
from rt_llm_node.model.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    'LlamaForCausalLM': 'llama',
    'Qwen2ForCausalLM': 'qwen2',
}
SUPPORTED_ROPE_TYPES = ('default', 'llama3')


@dataclass
class RopeConfig:
    """Rotary embedding parameters; ``inv_freq()`` gives the per-pair frequencies."""

    theta: float = 10000.0
    rope_type: str = 'default'
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple = ()       # per-pair divisors (a GGUF's rope_freqs tensor)

    def inv_freq(self, head_dim):
        """Return inverse frequencies ``[head_dim // 2]`` (float64), as transformers does."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv_freq = 1.0 / (np.float32(self.theta) ** exponents).astype(np.float32)
        inv_freq = inv_freq.astype(np.float32)
        if self.rope_type == 'llama3':
            inv_freq = self._llama3(inv_freq)
        if self.freq_factors:
            inv_freq = (inv_freq / np.asarray(self.freq_factors, np.float32)).astype(np.float32)
        return inv_freq.astype(np.float64)

    def _llama3(self, inv_freq):
        old_len = float(self.original_max_position_embeddings)
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2.0 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1.0 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclass
class ModelConfig:
    """Shapes and constants of one decoder-only model."""

    family: str                    # 'llama' or 'qwen2'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    head_dim: int = 0              # 0: hidden_size // num_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v biases (always true for qwen2)
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()      # every end-of-sequence id (HF allows a list)
    # derived in __post_init__
    q_size: int = field(init=False)
    kv_size: int = field(init=False)
    group_size: int = field(init=False)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.group_size = self.num_heads // self.num_kv_heads

    def tensor_shapes(self):
        """Return ``{name: shape}`` of every tensor the checkpoint must hold."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        shapes = {
            'model.embed_tokens.weight': (self.vocab_size, h),
            'model.norm.weight': (h,),
        }
        if not self.tie_word_embeddings:
            shapes['lm_head.weight'] = (self.vocab_size, h)
        for n in range(self.num_layers):
            p = f'model.layers.{n}.'
            shapes[p + 'input_layernorm.weight'] = (h,)
            shapes[p + 'post_attention_layernorm.weight'] = (h,)
            shapes[p + 'self_attn.q_proj.weight'] = (q, h)
            shapes[p + 'self_attn.k_proj.weight'] = (kv, h)
            shapes[p + 'self_attn.v_proj.weight'] = (kv, h)
            shapes[p + 'self_attn.o_proj.weight'] = (h, q)
            if self.attention_bias:
                shapes[p + 'self_attn.q_proj.bias'] = (q,)
                shapes[p + 'self_attn.k_proj.bias'] = (kv,)
                shapes[p + 'self_attn.v_proj.bias'] = (kv,)
            shapes[p + 'mlp.gate_proj.weight'] = (i, h)
            shapes[p + 'mlp.up_proj.weight'] = (i, h)
            shapes[p + 'mlp.down_proj.weight'] = (h, i)
        return shapes

    def n_parameters(self):
        """Count parameters (tied embeddings counted once)."""
        return int(sum(np.prod(s) for s in self.tensor_shapes().values()))

    def to_hf_dict(self):
        """Return an HF ``config.json`` dict (transformers 4 layout, read by 4 and 5)."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        d = {
            'architectures': [arch],
            'model_type': self.family,
            'vocab_size': self.vocab_size,
            'hidden_size': self.hidden_size,
            'intermediate_size': self.intermediate_size,
            'num_hidden_layers': self.num_layers,
            'num_attention_heads': self.num_heads,
            'num_key_value_heads': self.num_kv_heads,
            'head_dim': self.head_dim,
            'max_position_embeddings': self.max_position_embeddings,
            'rms_norm_eps': self.rms_norm_eps,
            'tie_word_embeddings': self.tie_word_embeddings,
            'hidden_act': 'silu',
            'rope_theta': self.rope.theta,
            'bos_token_id': self.bos_token_id,
            'eos_token_id': self.eos_token_id,
            'torch_dtype': 'bfloat16',
        }
        if self.family == 'llama':
            d['attention_bias'] = self.attention_bias
            d['mlp_bias'] = False
        if self.rope.rope_type == 'llama3':
            d['rope_scaling'] = {
                'rope_type': 'llama3', 'factor': self.rope.factor,
                'low_freq_factor': self.rope.low_freq_factor,
                'high_freq_factor': self.rope.high_freq_factor,
                'original_max_position_embeddings': self.rope.original_max_position_embeddings,
            }
        return d


# Upper bounds of config.json's sizes: far above any model this runs, and low enough that a
# corrupt value fails at once instead of allocating until memory runs out.
MAX_VALUES = {'vocab_size': 1 << 22, 'hidden_size': 1 << 16, 'intermediate_size': 1 << 18,
              'num_hidden_layers': 1024, 'num_attention_heads': 1024,
              'num_key_value_heads': 1024, 'max_position_embeddings': 1 << 24,
              'head_dim': 4096}


def _require(raw, key, kind, path):
    if key not in raw or raw[key] is None:
        raise CheckpointError(path, f"missing required key '{key}'")
    value = raw[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise CheckpointError(path, f"key '{key}' must be a positive integer, got {value!r}")
    if kind is int and value > MAX_VALUES.get(key, value):
        raise CheckpointError(path, f"key '{key}' = {value} exceeds {MAX_VALUES[key]}: not a "
                                    'model this runtime can hold')
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                          or not math.isfinite(value) or value <= 0):
        raise CheckpointError(path, f"key '{key}' must be a positive number, got {value!r}")
    return kind(value)


def _parse_rope(raw, path):
    params = raw.get('rope_parameters')
    if params is None:
        params = dict(raw.get('rope_scaling') or {})
        if 'rope_theta' in raw:
            params['rope_theta'] = raw['rope_theta']
    if not isinstance(params, dict):
        raise CheckpointError(path, f"key 'rope_parameters' must be an object, got {params!r}")
    if 'rope_type' not in params and 'type' in params:
        params['rope_type'] = params['type']
    rope_type = params.get('rope_type', 'default')
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            path, f"key 'rope_type' = {rope_type!r} is not supported "
            f'(supported: {", ".join(SUPPORTED_ROPE_TYPES)})')
    rope = RopeConfig(theta=_require(params, 'rope_theta', float, path)
                      if 'rope_theta' in params else 10000.0, rope_type=rope_type)
    if rope_type == 'llama3':
        rope.factor = _require(params, 'factor', float, path)
        rope.low_freq_factor = _require(params, 'low_freq_factor', float, path)
        rope.high_freq_factor = _require(params, 'high_freq_factor', float, path)
        rope.original_max_position_embeddings = _require(
            params, 'original_max_position_embeddings', int, path)
        if rope.high_freq_factor <= rope.low_freq_factor:
            raise CheckpointError(path, "key 'high_freq_factor' must exceed 'low_freq_factor'")
    return rope


def _flag(raw, key, path, default=False):
    """Return a boolean key of config.json; a string such as "false" is an error, not True."""
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(path, f"key '{key}' must be true or false, got {value!r}")
    return value


def _token_ids(raw, key, path):
    """Return a token-id key (an int, a list of ints, or null) as a tuple of ids."""
    value = raw.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                         for v in values):
        raise CheckpointError(path, f"key '{key}' must be a token id or a list of them, got "
                                    f'{value!r}')
    return tuple(values)


def parse_config(raw, path='config.json'):
    """Build a ModelConfig from a parsed ``config.json`` dict; CheckpointError if unusable."""
    if not isinstance(raw, dict):
        raise CheckpointError(path, 'config is not a JSON object')
    archs = raw.get('architectures')
    if not isinstance(archs, list) or len(archs) != 1:
        raise CheckpointError(path, "key 'architectures' must list one architecture, "
                                    f'got {archs!r}')
    family = SUPPORTED_ARCHITECTURES.get(archs[0])
    if family is None:
        raise CheckpointError(
            path, f"key 'architectures': {archs[0]!r} is not supported "
            f'(supported: {", ".join(SUPPORTED_ARCHITECTURES)})')
    act = raw.get('hidden_act', 'silu')
    if act != 'silu':
        raise CheckpointError(path, f"key 'hidden_act' = {act!r} is not supported (only 'silu')")
    if _flag(raw, 'mlp_bias', path):
        raise CheckpointError(path, "key 'mlp_bias' = true is not supported")
    if _flag(raw, 'use_sliding_window', path):
        raise CheckpointError(path, "key 'use_sliding_window' = true is not supported")
    head_dim = raw.get('head_dim') or 0
    if head_dim and (isinstance(head_dim, bool) or not isinstance(head_dim, int)
                     or head_dim <= 0 or head_dim % 2 or head_dim > MAX_VALUES['head_dim']):
        raise CheckpointError(path, f"key 'head_dim' must be a positive even integer, got "
                                    f'{head_dim!r}')
    bos, eos = _token_ids(raw, 'bos_token_id', path), _token_ids(raw, 'eos_token_id', path)
    config = ModelConfig(
        family=family,
        vocab_size=_require(raw, 'vocab_size', int, path),
        hidden_size=_require(raw, 'hidden_size', int, path),
        intermediate_size=_require(raw, 'intermediate_size', int, path),
        num_layers=_require(raw, 'num_hidden_layers', int, path),
        num_heads=_require(raw, 'num_attention_heads', int, path),
        num_kv_heads=_require(raw, 'num_key_value_heads', int, path)
        if raw.get('num_key_value_heads') is not None
        else _require(raw, 'num_attention_heads', int, path),
        max_position_embeddings=_require(raw, 'max_position_embeddings', int, path),
        rms_norm_eps=_require(raw, 'rms_norm_eps', float, path)
        if 'rms_norm_eps' in raw else 1e-6,
        head_dim=head_dim,
        tie_word_embeddings=_flag(raw, 'tie_word_embeddings', path),
        attention_bias=(family == 'qwen2') or _flag(raw, 'attention_bias', path),
        rope=_parse_rope(raw, path),
        bos_token_id=bos[0] if bos else None,
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
    )
    if config.num_heads % config.num_kv_heads:
        raise CheckpointError(path, f"key 'num_key_value_heads' = {config.num_kv_heads} does not "
                                    f'divide num_attention_heads = {config.num_heads}')
    if config.head_dim % 2:
        raise CheckpointError(path, f'head dimension {config.head_dim} must be even for RoPE')
    if not raw.get('head_dim') and config.hidden_size % config.num_heads:
        raise CheckpointError(path, f"key 'hidden_size' = {config.hidden_size} is not a multiple "
                                    f'of num_attention_heads = {config.num_heads}')
    return config


def open_checkpoint_file(path, limit):
    """Open a checkpoint file through the guarded reader (``files.open_regular``).

    A FIFO would block a reader for ever and a device (a link to /dev/zero) never ends:
    neither is read; a file larger than ``limit`` is refused before any byte is read.
    """
    try:
        return open_regular(path, 'checkpoint file', limit)
    except FileError as exc:
        reason = 'file not found' if 'No such file' in exc.reason else exc.reason
        raise CheckpointError(path, reason) from None


def read_small_file(path, limit):
    """Return the bytes of a regular file of at most ``limit`` bytes."""
    with open_checkpoint_file(path, limit) as f:
        return f.read(limit + 1)


def read_config(directory):
    """Read and parse ``DIR/config.json``."""
    path = Path(directory) / 'config.json'
    try:
        raw = json.loads(read_small_file(path, 1 << 20).decode('utf-8'))
    except FileNotFoundError:
        raise CheckpointError(path, 'file not found') from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(path, f'not valid JSON: {exc}') from None
    return parse_config(raw, path)
