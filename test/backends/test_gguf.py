"""GGUF checkpoints: exact block conversion, the tokenizer, and parity with transformers.

transformers reads GGUF files itself (its own reader, dequantization and tokenizer
builder): an outside reference for every supported tensor type. The files are written here
with the ``gguf`` package (random weights), nothing is downloaded.
"""

import numpy as np
import pytest

from gguf_models import corpus  # noqa: I100
from gguf_models import prompts
from gguf_models import TYPES
from gguf_models import write_gguf

gguf = pytest.importorskip('gguf', reason='the gguf package reads and writes GGUF files')
torch = pytest.importorskip('torch', reason='torch (CPU) runs the transformers reference')
transformers = pytest.importorskip('transformers', reason='transformers is the reference')
pytest.importorskip('accelerate', reason='transformers loads GGUF files only with accelerate')

from rt_llm_node.backends.cuda_backend import fits_half  # noqa: E402,I100
from rt_llm_node.backends.numpy_backend import NumpyBackend  # noqa: E402
from rt_llm_node.model import load_checkpoint  # noqa: E402
from rt_llm_node.model.quant import from_gguf_blocks  # noqa: E402
from rt_llm_node.model.quant import GGUF_QUANT  # noqa: E402
from rt_llm_node.model.quant import quantize  # noqa: E402

PROMPTS = 32
NEW_TOKENS = 16
# logits agree to this, relative to the largest logit of the step: both sides compute in
# fp32 from the same dequantized weights, in different orders (measured: about 2e-6)
LOGIT_TOLERANCE = 1e-4
# family per type: both families, every type
CASES = [(family, kind) for kind in TYPES for family in ('llama', 'qwen2')]


@pytest.mark.parametrize('kind', sorted(GGUF_QUANT))
def test_blocks_convert_to_the_runtime_format_bit_for_bit(kind, rng):
    """The runtime format's q * scale + offset equals ggml's own dequantization exactly."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size, _ = GGUF_QUANT[kind]
    rows, cols = 6, 4 * max(block, 32)
    if kind in ('Q8_0', 'Q4_0', 'Q4_1'):
        blocks = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                      qtype)
    else:   # random blocks; finite fp16 scales
        blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        d = rng.uniform(-1e-2, 1e-2, (len(blocks), 2)).astype(np.float16).view(np.uint8)
        at = {'Q6_K': [208], 'Q4_K': [0, 2], 'Q5_K': [0, 2]}[kind]
        for offset in at:
            blocks[:, offset:offset + 2] = d[:, 0:2] if offset == at[0] else d[:, 2:4]
        blocks = blocks.reshape(rows, -1)
    expected = gguf.quants.dequantize(blocks, qtype).reshape(rows, cols)
    converted = from_gguf_blocks(kind, blocks, (rows, cols))
    got = converted.to_float32()
    # equal as numbers (Q4_0's (q - 8) d is -0.0 where q d - 8 d is +0.0: the same weight)
    assert np.array_equal(got, expected.astype(np.float32))
    assert converted.fmt == ('u4' if kind.startswith('Q4') else 'i8')
    # the types with fp16 scales (and Q4_1's fp16 minimums) convert to fp16 values, which
    # the CUDA backend stores in 2 bytes; the K-quants' products of an fp16 and an integer
    # generally do not
    fp16 = fits_half(converted.scales) and (converted.offsets is None
                                            or fits_half(converted.offsets))
    assert fp16 == (kind in ('Q8_0', 'Q4_0', 'Q4_1')), kind


@pytest.mark.parametrize('fmt', ['i8', 'u4'])
def test_round_to_nearest_is_within_half_a_step(fmt, rng):
    w = rng.standard_normal((16, 128)).astype(np.float32) * 0.1
    w[3, :32] = 0.0    # a constant group: zero scale, exact
    q = quantize(w, fmt)
    err = np.abs(q.to_float32() - w).reshape(16, 4, 32).max(axis=-1)
    assert np.all(err <= 0.5 * q.scales * (1 + 1e-5) + 1e-7)
    assert err[3, 0] == 0.0
    bytes_per_weight = q.nbytes / w.size
    assert bytes_per_weight == (1.125 if fmt == 'i8' else 0.75)


@pytest.mark.parametrize('fmt', ['i8', 'u4'])
def test_round_to_nearest_keeps_fp16_scales_where_they_fit(fmt, rng):
    """Scales and offsets are fp16 values (stored in 2 bytes on the GPU) unless out of range."""
    w = rng.standard_normal((8, 128)).astype(np.float32) * 0.1
    q = quantize(w, fmt)
    assert fits_half(q.scales) and (q.offsets is None or fits_half(q.offsets))
    huge = quantize(w * 1e9, fmt)   # scales past fp16's 65504: kept in fp32
    assert not fits_half(huge.scales)
    for t, src in ((q, w), (huge, w * 1e9)):
        err = np.abs(t.to_float32() - src).reshape(8, 4, 32).max(axis=-1)
        assert np.all(err <= 0.5 * t.scales * (1 + 1e-3))


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp('gguf')
    return folder, {case: write_gguf(folder / f'{case[0]}_{case[1]}.gguf', *case,
                                     tied=case[0] == 'llama') for case in CASES}


@pytest.mark.parametrize('family', ['llama', 'qwen2'])
def test_the_tokenizer_matches_the_one_transformers_builds(files, family):
    folder, paths = files
    path = paths[(family, 'Q8_0')]
    ours = load_checkpoint(path).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    texts = corpus(300, seed=3) + ['robot  turn\nleft<|endoftext|>go 12345 degrees',
                                   "it's the robot's ball; don't stop!", '  leading spaces']
    for text in texts:
        assert ours.encode(text).ids == ref(text, add_special_tokens=False)['input_ids'], text


@pytest.mark.parametrize('family, kind', CASES)
def test_greedy_tokens_and_logits_match_transformers(files, family, kind):
    """The same greedy tokens as transformers running the same file.

    32 prompts of 32-64 tokens, 16 new tokens each; logits within LOGIT_TOLERANCE of the step's
    largest.
    """
    folder, paths = files
    path = paths[(family, kind)]
    checkpoint = load_checkpoint(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    backend = NumpyBackend(checkpoint, 128)
    worst = 0.0
    for ids in prompts(checkpoint.tokenizer, PROMPTS):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0,
                                 eos_token_id=None)
        ref_tokens = out.sequences[0, len(ids):].tolist()
        backend.rollback(0)
        backend.prefill(ids)
        tokens = []
        for step in range(NEW_TOKENS):
            logits = np.asarray(backend.logits()).reshape(-1)
            ref = out.logits[step][0].numpy()
            worst = max(worst, float(np.abs(logits - ref).max() / np.abs(ref).max()))
            tokens.append(int(logits.argmax()))
            backend.decode(tokens[-1])
        assert tokens == ref_tokens, (ids, tokens, ref_tokens)
    assert worst <= LOGIT_TOLERANCE, worst
