"""Every broken or unsupported GGUF file is one clear error (rc 2 from the CLI), no traceback."""

import subprocess
import sys
import warnings

import numpy as np
import pytest

from gguf_models import write_gguf  # noqa: I100

gguf = pytest.importorskip('gguf', reason='the gguf package reads and writes GGUF files')

from rt_llm_node.model import CheckpointError  # noqa: E402,I100
from rt_llm_node.model import load_checkpoint  # noqa: E402


@pytest.fixture(scope='module')
def good(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp('gguf') / 'good.gguf', 'llama', 'Q4_K')


def expect_error(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and '\n' not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def generate(path):
    return subprocess.run([sys.executable, '-m', 'rt_llm_node.generate', '--model', str(path),
                           '--token-ids', '1,2'], capture_output=True, text=True, timeout=120)


def test_the_good_file_loads_and_generates(good):
    assert load_checkpoint(good).config.num_layers == 2
    result = generate(good)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize('keep', [0.999, 0.5, 0.01])
def test_a_truncated_file_is_refused_without_reading_past_its_end(good, tmp_path, keep):
    data = good.read_bytes()
    cut = tmp_path / 'cut.gguf'
    cut.write_bytes(data[:int(len(data) * keep)])
    expect_error(cut, 'truncated')
    result = generate(cut)
    assert result.returncode == 2 and 'truncated' in result.stderr
    assert 'Traceback' not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_corrupt_metadata_is_refused(good, tmp_path, rng):
    data = bytearray(good.read_bytes())
    bad = tmp_path / 'bad.gguf'
    for _ in range(20):   # garbage over the header's counts and first keys
        data[8:200] = rng.integers(0, 256, 192, dtype=np.uint8).tobytes()
        bad.write_bytes(bytes(data))
        expect_error(bad)
    result = generate(bad)
    assert result.returncode == 2 and 'Traceback' not in result.stderr


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / 'model.gguf'
    path.write_bytes(b'PK\x03\x04' + bytes(100))
    expect_error(path, 'no GGUF magic')


def test_an_unsupported_tensor_type_names_the_tensor_and_type(tmp_path):
    path = write_gguf(tmp_path / 'q5_0.gguf', 'llama', 'Q5_0')
    expect_error(path, "'token_embd.weight'", 'Q5_0', 'supported')


def test_another_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / 'gemma.gguf', 'gemma', 'Q8_0')
    expect_error(path, 'general.architecture', 'gemma')


def test_a_sentencepiece_tokenizer_is_refused(tmp_path):
    path = write_gguf(tmp_path / 'spm.gguf', 'llama', 'Q8_0',
                      **{'tokenizer.ggml.model': ('llama', gguf.GGUFValueType.STRING)})
    expect_error(path, 'tokenizer.ggml.model', "'llama'")


def test_a_missing_layer_is_refused(tmp_path):
    path = write_gguf(tmp_path / 'layers.gguf', 'llama', 'Q8_0',
                      **{'llama.block_count': (3, gguf.GGUFValueType.UINT32)})
    expect_error(path, 'layers')


def test_another_architecture_is_named_before_its_tensors(tmp_path):
    path = write_gguf(tmp_path / 'phi3.gguf', 'phi3', 'Q8_0',
                      extra={'blk.0.attn_qkv.weight': np.zeros((8, 256))})
    expect_error(path, 'general.architecture', 'phi3')


def test_rope_frequency_factors_divide_the_frequencies(tmp_path):
    """A Llama 3 file carries its rope scaling as rope_freqs.weight, one factor a pair."""
    plain = load_checkpoint(write_gguf(tmp_path / 'plain.gguf', 'llama', 'Q8_0'))
    head_dim = plain.config.head_dim
    factors = np.linspace(1.0, 8.0, head_dim // 2)
    scaled = load_checkpoint(write_gguf(tmp_path / 'scaled.gguf', 'llama', 'Q8_0',
                                        extra={'rope_freqs.weight': factors}))
    want = plain.config.rope.inv_freq(head_dim) / factors
    np.testing.assert_allclose(scaled.config.rope.inv_freq(head_dim), want, rtol=1e-6)
    bad = write_gguf(tmp_path / 'bad.gguf', 'llama', 'Q8_0',
                     extra={'rope_freqs.weight': np.ones(3)})
    expect_error(bad, 'rope_freqs.weight')


def test_a_merge_that_is_not_a_pair_names_the_key_on_one_line(tmp_path):
    from gguf_models import train_tokenizer
    merges = list(train_tokenizer()[1])
    merges[3] = merges[3].replace(' ', '')
    path = write_gguf(tmp_path / 'merges.gguf', 'llama', 'Q8_0',
                      **{'tokenizer.ggml.merges': (merges, gguf.GGUFValueType.ARRAY)})
    expect_error(path, "'tokenizer.ggml.merges'[3]", 'two tokens')


# A block's first bytes: Q4_1's fp16 minimum set to a signalling NaN; Q4_K's fp16 super-scale
# set to infinity with its 6-bit sub-scales zero (inf * 0).
DAMAGE = {'Q4_1': {2: b'\x01\x7d'}, 'Q4_K': {0: b'\x00\x7c', 4: bytes(12)}}


@pytest.mark.parametrize('kind', sorted(DAMAGE))
def test_a_nan_scale_names_the_tensor_without_numpy_warnings(tmp_path, kind):
    path = write_gguf(tmp_path / 'nan.gguf', 'llama', kind)
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == 'blk.1.ffn_up.weight')
    data = bytearray(path.read_bytes())
    for at, raw in DAMAGE[kind].items():
        data[tensor.data_offset + at:tensor.data_offset + at + len(raw)] = raw
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        expect_error(path, "'blk.1.ffn_up.weight'", 'NaN')


def test_random_damage_to_a_file_is_an_error_or_a_model_never_a_crash(good, tmp_path, rng):
    """Bytes of the header, u64 counts and lengths, the data, and cuts at random places."""
    from gguf import GGUFReader
    data = good.read_bytes()
    header_end = min(t.data_offset for t in GGUFReader(good).tensors)
    bad = tmp_path / 'damaged.gguf'
    outcomes = set()
    for trial in range(48):
        blob = bytearray(data)
        where = int(rng.integers(4, header_end - 8))
        if trial % 4 == 0:
            blob[where] = int(rng.integers(0, 256))
        elif trial % 4 == 1:
            large = int(rng.choice([2 ** 63 - 1, 2 ** 32, 2 ** 31, 10 ** 9]))
            blob[where:where + 8] = large.to_bytes(8, 'little')
        elif trial % 4 == 2:
            for at in rng.integers(header_end, len(blob), 50):
                blob[int(at)] = int(rng.integers(0, 256))
        else:
            blob = blob[:int(rng.integers(4, len(blob)))]
        bad.write_bytes(bytes(blob))
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            try:
                load_checkpoint(bad)
                outcomes.add('loaded')
            except CheckpointError as exc:
                assert '\n' not in str(exc) and len(str(exc)) < 600, str(exc)
                outcomes.add('refused')
    assert 'refused' in outcomes


def _field_end(data, key):
    """Byte index just after a metadata key's name in a GGUF file (its value type follows)."""
    name = key.encode()
    at = data.index(len(name).to_bytes(8, 'little') + name)
    return at + 8 + len(name)


def _tensor_info(data, name):
    """(where the tensor's dimensions start, its dimension count) in the tensor table."""
    raw = name.encode()
    at = data.index(len(raw).to_bytes(8, 'little') + raw) + 8 + len(raw)
    return at + 4, int.from_bytes(data[at:at + 4], 'little')


def _limited(path, seconds=60):
    """Load ``path`` in a child under a 3 GiB address-space limit: (rc, stderr)."""
    code = ('import resource, sys\n'
            'resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n'
            'from rt_llm_node.model import load_checkpoint, CheckpointError\n'
            'try:\n    load_checkpoint(sys.argv[1])\n'
            'except CheckpointError as exc:\n    print(exc, file=sys.stderr); sys.exit(2)\n')
    result = subprocess.run([sys.executable, '-c', code, str(path)], capture_output=True,
                            text=True, timeout=seconds)
    return result.returncode, result.stderr


def test_an_array_that_claims_a_billion_elements_is_refused_before_it_is_walked(good, tmp_path):
    data = bytearray(good.read_bytes())
    at = _field_end(data, 'tokenizer.ggml.tokens') + 8   # value type, element type, count
    data[at:at + 8] = (10 ** 9).to_bytes(8, 'little')
    bad = tmp_path / 'claims.gguf'
    bad.write_bytes(bytes(data))
    code, err = _limited(bad)
    assert code == 2 and 'Traceback' not in err, err
    assert "'tokenizer.ggml.tokens' claims 1000000000 strings" in err and str(bad) in err


def test_two_tensors_over_the_same_bytes_are_refused(good, tmp_path):
    from gguf import GGUFReader
    reader = GGUFReader(good)
    first, second = reader.tensors[0], reader.tensors[1]
    data = bytearray(good.read_bytes())
    dims_at, n_dims = _tensor_info(data, second.name)
    offset_at = dims_at + 8 * n_dims + 4
    start = min(t.data_offset for t in reader.tensors)
    data[offset_at:offset_at + 8] = (first.data_offset - start).to_bytes(8, 'little')
    bad = tmp_path / 'overlap.gguf'
    bad.write_bytes(bytes(data))
    message = expect_error(bad, 'overlap', first.name, second.name)
    assert 'data bytes' in message


@pytest.mark.parametrize('change, fragment', [
    ('zero', 'each must be positive'), ('huge', 'elements, more than'),
    ('offset', 'ends at byte'), ('ragged', 'not whole blocks')])
def test_a_bad_extent_names_the_tensor_and_the_value(good, tmp_path, change, fragment):
    from gguf import GGUFReader
    tensor = next(t for t in GGUFReader(good).tensors if t.name == 'blk.0.ffn_down.weight')
    data = bytearray(good.read_bytes())
    dims_at, n_dims = _tensor_info(data, tensor.name)
    if change == 'zero':
        data[dims_at:dims_at + 8] = (0).to_bytes(8, 'little')
    elif change == 'huge':
        data[dims_at + 8:dims_at + 16] = (1 << 40).to_bytes(8, 'little')
    elif change == 'offset':
        at = dims_at + 8 * n_dims + 4
        data[at:at + 8] = (len(data)).to_bytes(8, 'little')
    else:
        first = int.from_bytes(data[dims_at:dims_at + 8], 'little')
        data[dims_at:dims_at + 8] = (first + 1).to_bytes(8, 'little')
    bad = tmp_path / f'{change}.gguf'
    bad.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        expect_error(bad, "'blk.0.ffn_down.weight'", fragment)


def test_a_bad_metadata_value_is_named_as_the_file_names_it(tmp_path):
    path = write_gguf(tmp_path / 'rope.gguf', 'llama', 'Q8_0',
                      **{'llama.rope.freq_base': (-1.0, gguf.GGUFValueType.FLOAT32)})
    message = expect_error(path, "metadata 'llama.rope.freq_base'", '-1.0')
    assert 'rope_theta' not in message
    path = write_gguf(tmp_path / 'heads.gguf', 'llama', 'Q8_0',
                      **{'llama.attention.head_count_kv': (3, gguf.GGUFValueType.UINT32)})
    message = expect_error(path, "metadata 'llama.attention.head_count_kv' = 3",
                           'llama.attention.head_count')
    assert 'num_key_value_heads' not in message and 'num_attention_heads' not in message


def test_a_fifo_or_a_device_as_the_model_is_refused_without_blocking(tmp_path):
    import os
    fifo = tmp_path / 'fifo.gguf'
    os.mkfifo(fifo)
    expect_error(fifo, 'FIFO')
    link = tmp_path / 'zero.gguf'
    link.symlink_to('/dev/zero')
    expect_error(link, 'character device')
