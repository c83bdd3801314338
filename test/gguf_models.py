"""GGUF test checkpoints written with the ``gguf`` package: random weights, a trained BPE.

Files follow llama.cpp's converter: its tensor names and metadata keys, a Llama's q and k
rows permuted for ggml's rotary layout, a byte-level BPE tokenizer in the metadata. Q8_0,
Q4_0 and Q4_1 tensors are quantized from random fp32 weights by the ``gguf`` package; the
K-quants (which it only dequantizes) are random blocks with sane scales.
"""

import functools
import json

import numpy as np
import pytest

gguf = pytest.importorskip('gguf', reason='the gguf package reads and writes GGUF files')

from tokenizers import decoders  # noqa: E402
from tokenizers import models  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers import trainers  # noqa: E402

WORDS = ('robot turn left right stop go forward back slow fast red blue green ball box door '
         'goal near far scan clear blocked wall person chair table move avoid follow wait '
         'the a to at of and is in on with degrees meters 0 1 2 3 4 5 6 7 8 9 . , ; :').split()
SHAPE = {'hidden': 256, 'intermediate': 512, 'layers': 2, 'heads': 4, 'kv_heads': 2,
         'context': 512}
TYPES = ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q4_K', 'Q5_K', 'Q6_K')


def corpus(n=3000, seed=0):
    """Sentences of the word list: what the test tokenizer is trained on, and prompts."""
    rng = np.random.default_rng(seed)
    return [' '.join(rng.choice(WORDS, size=int(rng.integers(4, 14)))) for _ in range(n)]


def prompts(tokenizer, count=32):
    """``count`` prompts of 32 to 64 tokens: sentences of the corpus joined, then cut."""
    out, sentences = [], iter(corpus(4000, seed=11))
    rng = np.random.default_rng(5)
    while len(out) < count:
        want = int(rng.integers(32, 65))
        ids = []
        while len(ids) < want:
            ids += tokenizer.encode(next(sentences) + ' ').ids
        out.append(ids[:want])
    return out


@functools.lru_cache(maxsize=None)
def train_tokenizer(vocab_size=400):
    """Train a byte-level BPE (GPT-2 style) on the corpus, with an end-of-text token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=['<|endoftext|>'],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())['model']
    vocab = sorted(model['vocab'].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else ' '.join(m) for m in model['merges']]
    return tuple(t for t, _ in vocab), tuple(merges)


def _k_blocks(kind, rows, k, rng):
    """Random K-quant blocks: random codes, fp16 super-block scales of about 1e-4."""
    size = {'Q4_K': 144, 'Q5_K': 176, 'Q6_K': 210}[kind]
    n = rows * k // 256
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, n) * 1e-4).astype(np.float16).view(np.uint8).reshape(n, 2)
    if kind == 'Q6_K':
        b[:, 208:210] = d
        b[:, 192:208] = rng.integers(-60, 60, size=(n, 16)).astype(np.int8).view(np.uint8)
    else:
        dmin = (rng.uniform(0.5, 1.5, n) * 1e-4).astype(np.float16).view(np.uint8)
        b[:, 0:2] = d
        b[:, 2:4] = dmin.reshape(n, 2)
    return b.reshape(rows, -1)


def _permute(w, n_head):
    """llama.cpp's q/k row permutation (its converter's LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, family='llama', kind='Q8_0', seed=0, tied=True, shape=None, extra=None,
               **overrides):
    """Write a random ``family`` model, its matrices in ``kind``; return the path.

    ``kind``: one type for every matrix, or {tensor name suffix: type} with a '*' default
    (a Q4_K_M-like mix: {'*': 'Q4_K', 'attn_v.weight': 'Q6_K', 'ffn_down.weight': 'Q6_K'}).
    ``extra``: {name: float32 array} written beside the model's tensors.

    Norms (and Qwen2's biases) are F32, as llama.cpp writes them. ``overrides``: metadata
    values to replace (for error tests).
    """
    s = dict(SHAPE, **(shape or {}))
    rng = np.random.default_rng(seed)
    tokens, merges = (list(x) for x in train_tokenizer())
    vocab = len(tokens)
    h, inter, head_dim = s['hidden'], s['intermediate'], s['hidden'] // s['heads']
    kv = s['kv_heads'] * head_dim
    kinds = kind if isinstance(kind, dict) else {'*': kind}
    writer = gguf.GGUFWriter(str(path), family)
    bos = tokens.index('<|endoftext|>')
    meta = [
        (f'{family}.context_length', lambda: writer.add_context_length(s['context'])),
        (f'{family}.embedding_length', lambda: writer.add_embedding_length(h)),
        (f'{family}.block_count', lambda: writer.add_block_count(s['layers'])),
        (f'{family}.feed_forward_length', lambda: writer.add_feed_forward_length(inter)),
        (f'{family}.attention.head_count', lambda: writer.add_head_count(s['heads'])),
        (f'{family}.attention.head_count_kv', lambda: writer.add_head_count_kv(s['kv_heads'])),
        (f'{family}.attention.layer_norm_rms_epsilon',
         lambda: writer.add_layer_norm_rms_eps(1e-5)),
        (f'{family}.rope.freq_base',
         lambda: writer.add_rope_freq_base(10000.0 if family == 'llama' else 1e6)),
        ('tokenizer.ggml.model', lambda: writer.add_tokenizer_model('gpt2')),
        ('tokenizer.ggml.pre',
         lambda: writer.add_tokenizer_pre('llama-bpe' if family == 'llama' else 'qwen2')),
        ('tokenizer.ggml.tokens', lambda: writer.add_token_list(tokens)),
        ('tokenizer.ggml.token_type',
         lambda: writer.add_token_types([3 if t == '<|endoftext|>' else 1 for t in tokens])),
        ('tokenizer.ggml.merges', lambda: writer.add_token_merges(merges)),
        ('tokenizer.ggml.bos_token_id', lambda: writer.add_bos_token_id(bos)),
        ('tokenizer.ggml.eos_token_id', lambda: writer.add_eos_token_id(bos)),
    ]
    for key, add in meta:
        if key in overrides:   # (value, GGUFValueType)
            writer.add_key_value(key, *overrides.pop(key))
        else:
            add()
    for key, (value, kind_) in overrides.items():
        writer.add_key_value(key, value, kind_)

    def matrix(name, rows, cols, permute_heads=None):
        kind = next((k for suffix, k in kinds.items() if name.endswith(suffix)), kinds['*'])
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        w = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
        if permute_heads:
            w = _permute(w, permute_heads)
        if kind == 'F32':
            writer.add_tensor(name, w)
        elif kind == 'F16':
            writer.add_tensor(name, w.astype(np.float16))
        elif kind in ('Q4_K', 'Q5_K', 'Q6_K'):
            writer.add_tensor(name, _k_blocks(kind, rows, cols, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def vector(name, n, base=1.0, spread=0.1):
        writer.add_tensor(name, (base + spread * rng.standard_normal(n)).astype(np.float32))

    matrix('token_embd.weight', vocab, h)
    vector('output_norm.weight', h)
    if not tied:
        matrix('output.weight', vocab, h)
    for n in range(s['layers']):
        p = f'blk.{n}.'
        vector(p + 'attn_norm.weight', h)
        vector(p + 'ffn_norm.weight', h)
        llama = family == 'llama'
        matrix(p + 'attn_q.weight', h, h, s['heads'] if llama else None)
        matrix(p + 'attn_k.weight', kv, h, s['kv_heads'] if llama else None)
        matrix(p + 'attn_v.weight', kv, h)
        if family == 'qwen2':
            vector(p + 'attn_q.bias', h, 0.0, 0.05)
            vector(p + 'attn_k.bias', kv, 0.0, 0.05)
            vector(p + 'attn_v.bias', kv, 0.0, 0.05)
        matrix(p + 'attn_output.weight', h, h)
        matrix(p + 'ffn_gate.weight', inter, h)
        matrix(p + 'ffn_up.weight', inter, h)
        matrix(p + 'ffn_down.weight', h, inter)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, np.asarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
