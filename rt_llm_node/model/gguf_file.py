"""Load a GGUF checkpoint (llama.cpp's single-file format) into the same Checkpoint.

The file is read with the ``gguf`` package, ggml's own reader. Llama and Qwen2 files; tensor
types F32, F16, BF16 (kept as stored), Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K (converted,
exactly, into the runtime formats of :mod:`rt_llm_node.model.quant`). The configuration
comes from the metadata and goes through the same checks as a config.json; the tokenizer is
built from the metadata with ``tokenizers`` (byte-level BPE, the ``gpt2`` tokenizer model of
Llama 3, SmolLM2 and Qwen2 files). Anything else is a CheckpointError naming the file and the
tensor or key.

llama.cpp's converter stores a Llama's q and k projection rows permuted for its rotary
layout (pairs adjacent instead of half a head apart); they are put back here, as rows, so
quantized blocks are moved whole.
"""

from pathlib import Path
import re

import numpy as np
from tokenizers import AddedToken
from tokenizers import decoders
from tokenizers import pre_tokenizers
from tokenizers import Regex
from tokenizers import Tokenizer
from tokenizers.models import BPE

from rt_llm_node.model.config import parse_config
from rt_llm_node.model.errors import CheckpointError
from rt_llm_node.model.gguf_layout import check_layout
from rt_llm_node.model.quant import from_gguf_blocks
from rt_llm_node.model.quant import GGUF_QUANT

ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM'}
FLOAT_TYPES = ('F32', 'F16', 'BF16')
SUPPORTED_TYPES = FLOAT_TYPES + tuple(GGUF_QUANT)
MAX_WEIGHT = 1e6   # as for safetensors: beyond it the fp32 forward overflows

_LAYER = {
    'attn_norm.weight': 'input_layernorm.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight',
    'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight',
    'attn_q.bias': 'self_attn.q_proj.bias',
    'attn_k.bias': 'self_attn.k_proj.bias',
    'attn_v.bias': 'self_attn.v_proj.bias',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight',
    'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
}
_GLOBAL = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}

# How each pre-tokenizer named in tokenizer.ggml.pre splits text before byte-level BPE
# (llama.cpp's llama-vocab.cpp has the same table); other names use GPT-2's split.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"  # noqa: Q000 (the pattern holds quotes)
_LLAMA3_SPLIT = (_CONTRACTIONS + r'|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}'
                 r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+')
_QWEN2_SPLIT = (_CONTRACTIONS + r'|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}'
                r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+')
SPLITS = {'llama3': _LLAMA3_SPLIT, 'llama-v3': _LLAMA3_SPLIT, 'llama-bpe': _LLAMA3_SPLIT,
          'smaug-bpe': _LLAMA3_SPLIT, 'qwen2': _QWEN2_SPLIT, 'deepseek-r1-qwen': _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4   # tokenizer.ggml.token_type values


def _open(path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError(path, 'reading GGUF files needs the gguf package (pip install '
                                    'gguf, or the [gguf] extra)') from None
    # counts, lengths and extents checked against the file before the reader trusts them
    size = check_layout(path)
    try:
        reader = GGUFReader(path)
    except Exception as exc:   # the reader raises ValueError, IndexError, KeyError ...
        raise CheckpointError(path, f'corrupt or truncated GGUF file: {type(exc).__name__}: '
                                    f'{exc}') from None
    for t in reader.tensors:   # the reader maps the file: check before touching any data
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(path, f"tensor '{t.name}' ends at byte "
                                        f'{t.data_offset + t.n_bytes} of a {size}-byte file: '
                                        'truncated')
    return reader


def _metadata(reader, path):
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith('GGUF.'):
            continue
        try:
            meta[key] = field.contents()
        except Exception as exc:
            raise CheckpointError(path, f"metadata key '{key}' is unreadable: {exc}") from None
    return meta


def _config(meta, tensors, path):
    arch = meta.get('general.architecture')
    if arch not in ARCHITECTURES:
        raise CheckpointError(path, f"metadata 'general.architecture' = {arch!r} is not "
                                    f'supported (supported: {", ".join(ARCHITECTURES)})')
    scaling = meta.get(f'{arch}.rope.scaling.type', 'none')
    if scaling not in ('none', None):
        raise CheckpointError(path, f"metadata '{arch}.rope.scaling.type' = {scaling!r} is not "
                                    'supported')
    embed = tensors.get('model.embed_tokens.weight')
    if embed is None:
        raise CheckpointError(path, "missing tensor 'token_embd.weight'")

    def key(name, default=None):
        return meta.get(f'{arch}.{name}', default)
    heads = key('attention.head_count')
    hidden = key('embedding_length')
    raw = {
        'architectures': [ARCHITECTURES[arch]],
        'vocab_size': embed.shape[0],
        'hidden_size': hidden,
        'intermediate_size': key('feed_forward_length'),
        'num_hidden_layers': key('block_count'),
        'num_attention_heads': heads,
        'num_key_value_heads': key('attention.head_count_kv', heads),
        'max_position_embeddings': key('context_length'),
        'rms_norm_eps': key('attention.layer_norm_rms_epsilon', 1e-6),
        'rope_theta': key('rope.freq_base', 10000.0),
        'tie_word_embeddings': 'lm_head.weight' not in tensors,
        'attention_bias': 'model.layers.0.self_attn.q_proj.bias' in tensors,
        'bos_token_id': meta.get('tokenizer.ggml.bos_token_id'),
        'eos_token_id': meta.get('tokenizer.ggml.eos_token_id'),
    }
    head_dim = key('attention.key_length')
    if head_dim is not None:
        raw['head_dim'] = head_dim
    raw = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in raw.items()}
    try:
        return parse_config(raw, path)
    except CheckpointError as exc:   # named as the file names them, not as config.json would
        detail = exc.detail
        for hf, key in _config_keys(arch).items():
            detail = detail.replace(f"key '{hf}'", f"metadata '{key}'")
            detail = re.sub(rf'(?<![\w.\']){hf}(?![\w\'])', key, detail)
        raise CheckpointError(path, detail) from None


def _config_keys(arch):
    """{config.json key: the GGUF metadata key it comes from} for error messages."""
    return {'hidden_size': f'{arch}.embedding_length',
            'intermediate_size': f'{arch}.feed_forward_length',
            'num_hidden_layers': f'{arch}.block_count',
            'num_attention_heads': f'{arch}.attention.head_count',
            'num_key_value_heads': f'{arch}.attention.head_count_kv',
            'max_position_embeddings': f'{arch}.context_length',
            'rms_norm_eps': f'{arch}.attention.layer_norm_rms_epsilon',
            'rope_theta': f'{arch}.rope.freq_base',
            'head_dim': f'{arch}.attention.key_length',
            'bos_token_id': 'tokenizer.ggml.bos_token_id',
            'eos_token_id': 'tokenizer.ggml.eos_token_id'}


def _tensor(t, path):
    """One GGUF tensor -> (HF-order shape, StoredTensor or QuantTensor)."""
    from rt_llm_node.model.checkpoint import StoredTensor
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(path, f"tensor '{t.name}' has type {kind}; supported: "
                                    f'{", ".join(SUPPORTED_TYPES)}')
    if kind in FLOAT_TYPES:
        storage = {'F32': np.uint32, 'F16': np.uint16, 'BF16': np.uint16}[kind]
        bits = np.frombuffer(np.ascontiguousarray(t.data).tobytes(), dtype=storage)
        stored = StoredTensor(kind, shape, bits)
        values = stored.to_float32()
    else:
        if len(shape) != 2:
            raise CheckpointError(path, f"tensor '{t.name}' of type {kind} is not a matrix")
        try:
            stored = from_gguf_blocks(kind, np.asarray(t.data), shape)
        except ValueError as exc:
            raise CheckpointError(path, f"tensor '{t.name}': {exc}") from None
        values = None
    if values is not None:
        bad = not np.all(np.isfinite(values))
        largest = 0.0 if bad or not values.size else float(np.max(np.abs(values)))
    else:
        parts = [stored.scales] + ([] if stored.offsets is None else [stored.offsets])
        bad = not all(np.all(np.isfinite(p)) for p in parts)
        top = 127.0 if stored.fmt == 'i8' else 15.0
        largest = 0.0 if bad else float(np.max(np.abs(stored.scales)) * top + (
            0.0 if stored.offsets is None else np.max(np.abs(stored.offsets))))
    if bad:
        raise CheckpointError(path, f"tensor '{t.name}' holds NaN or infinite values")
    if largest > MAX_WEIGHT:
        raise CheckpointError(path, f"tensor '{t.name}' holds {largest:.3g}: weights beyond "
                                    f'{MAX_WEIGHT:g} overflow the fp32 forward')
    return stored


def _hf_name(name, path):
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = re.fullmatch(r'blk\.(\d+)\.(.+)', name)
    if match and match.group(2) in _LAYER:
        return f'model.layers.{int(match.group(1))}.{_LAYER[match.group(2)]}'
    raise CheckpointError(path, f"unexpected tensor '{name}'")


def _unpermute_rows(rows, n_head):
    """Row order that undoes llama.cpp's q/k permutation: stored[index] is the HF matrix."""
    head_dim = rows // n_head
    half = head_dim // 2
    h, j, i = np.meshgrid(np.arange(n_head), np.arange(2), np.arange(half), indexing='ij')
    return (h * head_dim + 2 * i + j).reshape(-1)


def _take_rows(tensor, index):
    from rt_llm_node.model.checkpoint import StoredTensor
    if isinstance(tensor, StoredTensor):
        cols = int(np.prod(tensor.shape[1:])) if len(tensor.shape) > 1 else 1
        bits = tensor.bits.reshape(tensor.shape[0], cols)[index].reshape(-1)
        return StoredTensor(tensor.dtype, tensor.shape, np.ascontiguousarray(bits))
    return tensor.rows(index)


def build_tokenizer(meta, path):
    """Build the byte-level BPE tokenizer a GGUF's metadata describes (``tokenizers``)."""
    model = meta.get('tokenizer.ggml.model')
    if model != 'gpt2':
        raise CheckpointError(path, f"metadata 'tokenizer.ggml.model' = {model!r}: only "
                                    "byte-level BPE ('gpt2': Llama 3, SmolLM2, Qwen2) is "
                                    'supported')
    tokens = meta.get('tokenizer.ggml.tokens')
    merges = meta.get('tokenizer.ggml.merges')
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise CheckpointError(path, "metadata 'tokenizer.ggml.tokens' and "
                                    "'tokenizer.ggml.merges' must be arrays of strings")
    for index, item in enumerate(tokens):
        if not isinstance(item, str):
            raise CheckpointError(path, f"metadata 'tokenizer.ggml.tokens'[{index}] is not a "
                                        'string')
    pairs = []
    for index, merge in enumerate(merges):
        pair = tuple(merge.split(' ', 1)) if isinstance(merge, str) else ()
        if len(pair) != 2 or not all(pair):
            raise CheckpointError(path, f"metadata 'tokenizer.ggml.merges'[{index}] = "
                                        f'{merge!r:.60} is not two tokens separated by a space')
        pairs.append(pair)
    vocab = {token: index for index, token in enumerate(tokens)}
    try:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                  ignore_merges=False))
    except Exception as exc:
        raise CheckpointError(path, f'tokenizer metadata is unusable: {exc}') from None
    split = SPLITS.get(meta.get('tokenizer.ggml.pre'))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior='isolated'),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get('tokenizer.ggml.token_type') or []
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # a control token spelled outside the byte alphabet (a raw space, say) is a mislabel in
    # some files: adding it would grow the vocabulary past the embedding
    special = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def load_gguf(path):
    """Load and validate a GGUF checkpoint; CheckpointError if unusable."""
    from rt_llm_node.model.checkpoint import _check_tensors
    from rt_llm_node.model.checkpoint import Checkpoint
    path = Path(path)
    reader = _open(path)
    meta = _metadata(reader, path)
    arch = meta.get('general.architecture')
    if arch not in ARCHITECTURES:   # before its tensor names, which other models name apart
        raise CheckpointError(path, f"metadata 'general.architecture' = {arch!r} is not "
                                    f'supported (supported: {", ".join(ARCHITECTURES)})')
    tensors = {}
    freq_factors = None
    for t in reader.tensors:
        if t.name == 'rope_freqs.weight':
            freq_factors = _tensor(t, path).to_float32().reshape(-1)
            continue
        tensors[_hf_name(t.name, path)] = t
    by_name = {}
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist()))
              for name, t in tensors.items()}
    config = _config(meta, {n: _Shape(s) for n, s in shapes.items()}, path)
    if freq_factors is not None:
        if len(freq_factors) != config.head_dim // 2 or np.any(freq_factors <= 0):
            raise CheckpointError(path, "tensor 'rope_freqs.weight' must hold head_dim / 2 "
                                        'positive factors')
        config.rope.freq_factors = tuple(float(f) for f in freq_factors)
    for name, t in tensors.items():
        by_name[name] = _tensor(t, path)
    if config.family == 'llama':
        for layer in range(config.num_layers):
            for proj, heads in (('q_proj', config.num_heads), ('k_proj', config.num_kv_heads)):
                for kind in ('weight', 'bias'):
                    name = f'model.layers.{layer}.self_attn.{proj}.{kind}'
                    if name in by_name and by_name[name].shape[0] % (2 * heads) == 0:
                        index = _unpermute_rows(by_name[name].shape[0], heads)
                        by_name[name] = _take_rows(by_name[name], index)
    _check_tensors(config, by_name, path, source='the metadata')
    tokenizer = build_tokenizer(meta, path)
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n > config.vocab_size:
        raise CheckpointError(path, f'tokenizer has {n} tokens but token_embd.weight has only '
                                    f'{config.vocab_size} rows')
    return Checkpoint(path, config, by_name, tokenizer)


class _Shape:
    """A tensor's shape before its data is read (what the config checks need)."""

    def __init__(self, shape):
        self.shape = shape
