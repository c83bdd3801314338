"""Every broken or unsupported checkpoint gives CheckpointError naming the file and key."""

import json
import shutil

import pytest

from rt_llm_node.model import CheckpointError
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import word_tokenizer
from rt_llm_node.model.synthetic import write_safetensors


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """Return a fresh writable copy of the tiny checkpoint."""
    return shutil.copytree(tiny_checkpoint, tmp_path / 'ckpt')


def edit_config(directory, **changes):
    path = directory / 'config.json'
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def rewrite_tensors(directory, change):
    """Rewrite model.safetensors after ``change(dict of (dtype, shape, bytes))``."""
    import safetensors
    entries = safetensors.deserialize((directory / 'model.safetensors').read_bytes())
    tensors = {name: (i['dtype'], i['shape'], bytes(i['data'])) for name, i in entries}
    change(tensors)
    write_safetensors(directory / 'model.safetensors', tensors)


def expect_error(directory, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(directory)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


def test_the_untouched_copy_loads(ckpt):
    assert load_checkpoint(ckpt).config.num_layers == 2


def test_unknown_architecture(ckpt):
    edit_config(ckpt, architectures=['MistralForCausalLM'])
    expect_error(ckpt, 'config.json', "'architectures'", 'MistralForCausalLM')


def test_unknown_rope_type(ckpt):
    edit_config(ckpt, rope_scaling={'rope_type': 'yarn', 'factor': 4.0})
    expect_error(ckpt, 'config.json', "'rope_type'", 'yarn')


def test_llama3_rope_without_its_keys(ckpt):
    edit_config(ckpt, rope_scaling={'rope_type': 'llama3', 'factor': 8.0})
    expect_error(ckpt, 'config.json', "'low_freq_factor'")


def test_missing_config_key(ckpt):
    edit_config(ckpt, hidden_size=None)
    expect_error(ckpt, 'config.json', "'hidden_size'")


def test_wrong_config_value_type(ckpt):
    edit_config(ckpt, num_hidden_layers='two')
    expect_error(ckpt, 'config.json', "'num_hidden_layers'")


def test_config_not_json(ckpt):
    (ckpt / 'config.json').write_text('{"architectures": [')
    expect_error(ckpt, 'config.json', 'not valid JSON')


def test_missing_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: t.pop('model.layers.1.mlp.up_proj.weight'))
    expect_error(ckpt, 'model.safetensors', "missing tensor 'model.layers.1.mlp.up_proj.weight'")


def test_extra_tensor(ckpt):
    extra = {'model.layers.9.extra.weight': ('F32', [2], b'\0' * 8)}
    rewrite_tensors(ckpt, lambda t: t.update(extra))
    expect_error(ckpt, 'model.safetensors', "unexpected tensor 'model.layers.9.extra.weight'")


def test_wrong_shape(ckpt):
    def change(tensors):
        dtype, shape, data = tensors['model.norm.weight']
        tensors['model.norm.weight'] = (dtype, [shape[0] // 2, 2], data)
    rewrite_tensors(ckpt, change)
    expect_error(ckpt, 'model.safetensors', "'model.norm.weight'", 'shape [32, 2]', '[64]')


def test_wrong_dtype(ckpt):
    def change(tensors):
        dtype, shape, data = tensors['model.norm.weight']
        tensors['model.norm.weight'] = ('I16', shape, data)
    rewrite_tensors(ckpt, change)
    expect_error(ckpt, 'model.safetensors', "'model.norm.weight'", 'dtype I16')


def test_nan_weights(ckpt):
    def change(tensors):
        dtype, shape, data = tensors['model.norm.weight']
        tensors['model.norm.weight'] = (dtype, shape, b'\xc0\x7f' + data[2:])  # bf16 NaN
    rewrite_tensors(ckpt, change)
    expect_error(ckpt, 'model.safetensors', "'model.norm.weight'", 'NaN')


def test_truncated_safetensors(ckpt):
    path = ckpt / 'model.safetensors'
    path.write_bytes(path.read_bytes()[:-100])
    expect_error(ckpt, 'model.safetensors', 'corrupt or truncated')


def test_garbage_safetensors(ckpt):
    (ckpt / 'model.safetensors').write_bytes(b'\xff' * 64)
    expect_error(ckpt, 'model.safetensors', 'corrupt or truncated')


def test_missing_weights_file(ckpt):
    (ckpt / 'model.safetensors').unlink()
    expect_error(ckpt, 'model.safetensors.index.json')


def test_shard_listed_but_missing(ckpt):
    index = {'metadata': {}, 'weight_map': {'model.norm.weight': 'model-00002.safetensors'}}
    (ckpt / 'model.safetensors.index.json').write_text(json.dumps(index))
    expect_error(ckpt, 'model-00002.safetensors', 'file not found')


def test_tokenizer_larger_than_embedding(ckpt):
    word_tokenizer(600).save(str(ckpt / 'tokenizer.json'))
    expect_error(ckpt, 'tokenizer.json', '600 tokens', "'model.embed_tokens.weight'", '512')


def test_tokenizer_corrupt(ckpt):
    (ckpt / 'tokenizer.json').write_text('{"model": 3}')
    expect_error(ckpt, 'tokenizer.json', 'unreadable tokenizer')


def test_tokenizer_missing(ckpt):
    (ckpt / 'tokenizer.json').unlink()
    expect_error(ckpt, 'tokenizer.json', 'file not found')


def test_not_a_directory(tmp_path):
    expect_error(tmp_path / 'nowhere', 'nowhere', 'not a checkpoint directory')


def test_pickle_checkpoint_is_not_read(ckpt):
    """A torch pickle beside no safetensors is refused, never unpickled."""
    (ckpt / 'model.safetensors').unlink()
    (ckpt / 'pytorch_model.bin').write_bytes(b'\x80\x04K\x01.')
    expect_error(ckpt, 'neither model.safetensors')


def test_a_fifo_or_a_device_is_refused_without_reading_it(ckpt):
    import os
    (ckpt / 'config.json').rename(ckpt / 'config.saved')
    os.mkfifo(ckpt / 'config.json')     # a reader of a FIFO without a writer blocks for ever
    with pytest.raises(CheckpointError, match='config.json: a FIFO, not a regular file'):
        load_checkpoint(ckpt)
    (ckpt / 'config.json').unlink()
    (ckpt / 'config.saved').rename(ckpt / 'config.json')
    (ckpt / 'model.safetensors').unlink()
    (ckpt / 'model.safetensors').symlink_to('/dev/zero')   # endless
    with pytest.raises(CheckpointError,
                       match='model.safetensors: a character device, not a regular file'):
        load_checkpoint(ckpt)
    (ckpt / 'model.safetensors').unlink()
    (ckpt / 'model.safetensors').write_bytes(b'')
    with pytest.raises(CheckpointError, match='corrupt or truncated'):
        load_checkpoint(ckpt)


def test_a_huge_layer_count_fails_at_once_and_names_the_key(ckpt):
    import time
    edit_config(ckpt, num_hidden_layers=1_000_000_000)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="'num_hidden_layers' = 1000000000 exceeds"):
        load_checkpoint(ckpt)
    assert time.monotonic() - started < 5.0
    edit_config(ckpt, num_hidden_layers=900)   # plausible, but not what the tensors hold
    with pytest.raises(CheckpointError, match='the tensors hold layers 0..1, config.json says '
                                              'num_hidden_layers = 900'):
        load_checkpoint(ckpt)


@pytest.mark.parametrize('key,value', [('tie_word_embeddings', 'false'),
                                       ('attention_bias', 'no'), ('tie_word_embeddings', 0),
                                       ('eos_token_id', 'eos'), ('bos_token_id', [1, 'x'])])
def test_config_values_of_the_wrong_type_are_errors_not_guesses(ckpt, key, value):
    """A string "false" read as true would drop a stored lm_head: a wrong model that runs."""
    edit_config(ckpt, **{key: value})
    with pytest.raises(CheckpointError, match=f"key '{key}' must be"):
        load_checkpoint(ckpt)


def test_weights_that_would_overflow_the_forward_name_the_file_and_tensor(ckpt):
    path = ckpt / 'model.safetensors'
    blob = bytearray(path.read_bytes())
    size = int.from_bytes(blob[:8], 'little')
    header = json.loads(blob[8:8 + size])
    name = 'model.layers.1.mlp.down_proj.weight'
    assert header[name]['dtype'] == 'BF16'
    first = 8 + size + header[name]['data_offsets'][0]
    blob[first:first + 2] = (0x7F00).to_bytes(2, 'little')   # bf16 1.7e38: finite, far too big
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor '{name}' holds "):
        load_checkpoint(ckpt)


def test_errors_cross_process_boundaries_intact(ckpt):
    """rt-llm-eval's worker processes and Ray's tasks pickle what an episode or a bag raised."""
    import pickle
    from rt_llm_node.files import FileError
    (ckpt / 'config.json').write_text('{')
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(ckpt)
    for exc in (raised.value, FileError('parameter file', ckpt / 'p.yaml', 'too large')):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.path == exc.path
