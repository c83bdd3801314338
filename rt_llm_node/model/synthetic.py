"""Random HF-layout checkpoints made with numpy, for tests, benchmarks and the GPU.

They are written in the safetensors format and read back by the same loader
(the ``safetensors`` library) as any downloaded model; no torch is needed, so the GPU machine and
CI can both make them.
"""

import json
from pathlib import Path

import struct

import numpy as np
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import Tokenizer

from rt_llm_node.model.config import ModelConfig

# Model shapes of the benchmarks and tests (random weights, real architectures).
SHAPES = {
    'tiny': {
        'family': 'llama', 'vocab_size': 512, 'hidden_size': 64, 'intermediate_size': 160,
        'num_layers': 2, 'num_heads': 4, 'num_kv_heads': 2, 'max_position_embeddings': 2048,
        'tie_word_embeddings': True},
    'smollm2-135m': {
        'family': 'llama', 'vocab_size': 49152, 'hidden_size': 576, 'intermediate_size': 1536,
        'num_layers': 30, 'num_heads': 9, 'num_kv_heads': 3, 'max_position_embeddings': 8192,
        'tie_word_embeddings': True, 'rms_norm_eps': 1e-5},
    'qwen2.5-0.5b': {
        'family': 'qwen2', 'vocab_size': 151936, 'hidden_size': 896, 'intermediate_size': 4864,
        'attention_bias': True,
        'num_layers': 24, 'num_heads': 14, 'num_kv_heads': 2, 'max_position_embeddings': 32768,
        'tie_word_embeddings': True},
    'llama-3.2-1b': {
        'family': 'llama', 'vocab_size': 128256, 'hidden_size': 2048, 'intermediate_size': 8192,
        'num_layers': 16, 'num_heads': 32, 'num_kv_heads': 8, 'head_dim': 64,
        'max_position_embeddings': 131072, 'tie_word_embeddings': True},
}


def shape_config(name):
    """Return the ModelConfig of a named shape (see ``SHAPES``)."""
    config = ModelConfig(**SHAPES[name])
    if name == 'llama-3.2-1b':
        config.rope.theta = 500000.0
        config.rope.rope_type = 'llama3'
        config.rope.factor = 32.0
    elif name == 'qwen2.5-0.5b':
        config.rope.theta = 1000000.0
    return config


def encode_bits(array, dtype):
    """Return the raw bytes of a float32 array stored as 'BF16', 'F16' or 'F32'."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == 'BF16':  # round to nearest even
        bits = array.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.astype(np.uint16).tobytes()
    if dtype == 'F16':
        return array.astype(np.float16).tobytes()
    return array.tobytes()


def write_safetensors(path, tensors):
    """Write ``{name: (dtype, shape, raw bytes)}`` in the safetensors format.

    The format is an 8-byte little-endian header length, a JSON header of
    dtypes, shapes and byte offsets padded to 8 bytes, then the raw data.
    """
    header = {'__metadata__': {'format': 'pt'}}
    offset = 0
    for name, (dtype, shape, data) in sorted(tensors.items()):
        header[name] = {'dtype': dtype, 'shape': list(shape),
                        'data_offsets': [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(',', ':')).encode('utf-8')
    text += b' ' * (-len(text) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(text)))
        f.write(text)
        for name in sorted(tensors):
            f.write(tensors[name][2])


def word_tokenizer(vocab_size):
    """Return a real ``tokenizers`` word-level tokenizer whose tokens are ``t0 .. t{N-1}``."""
    vocab = {f't{i}': i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='t0'))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def random_weights(config, seed=0):
    """Return ``{name: float32 array}`` with HF-like init (normal 0.02, norms near 1)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in config.tensor_shapes().items():
        if name.endswith('norm.weight'):
            weights[name] = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith('.bias'):
            weights[name] = 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            weights[name] = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    return weights


def write_checkpoint(directory, config, weights, tokenizer, dtype='BF16'):
    """Write ``config.json``, ``model.safetensors`` and ``tokenizer.json`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf_dict()
    hf['torch_dtype'] = {'BF16': 'bfloat16', 'F16': 'float16', 'F32': 'float32'}[dtype]
    (directory / 'config.json').write_text(json.dumps(hf, indent=2) + '\n', encoding='utf-8')
    tensors = {name: (dtype, w.shape, encode_bits(w, dtype)) for name, w in weights.items()}
    write_safetensors(directory / 'model.safetensors', tensors)
    tokenizer.save(str(directory / 'tokenizer.json'))
    return directory


def write_random_checkpoint(directory, config, dtype='BF16', seed=0):
    """Write a random checkpoint of ``config`` (a ModelConfig or a name in ``SHAPES``)."""
    if isinstance(config, str):
        config = shape_config(config)
    return write_checkpoint(directory, config, random_weights(config, seed),
                            word_tokenizer(config.vocab_size), dtype)
