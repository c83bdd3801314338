"""rt-llm-generate, run as a user would (a subprocess), on a real checkpoint."""

import json
import shutil
import subprocess
import sys

import numpy as np

from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import load_checkpoint


def generate(*args):
    return subprocess.run([sys.executable, '-m', 'rt_llm_node.generate', *args],
                          capture_output=True, text=True, timeout=120)


def test_json_ids_and_logits_dump_match_the_backend(tiny_checkpoint, tmp_path):
    dump = tmp_path / 'logits.npy'
    result = generate('--model', str(tiny_checkpoint), '--token-ids', '5,6,7,8',
                      '--max-new-tokens', '6', '--json', '--dump-logits', str(dump))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    logits = np.load(dump)
    assert logits.shape == (6, 512) and logits.dtype == np.float32
    assert out['generated_ids'] == logits.argmax(axis=1).tolist()
    backend = NumpyBackend(load_checkpoint(tiny_checkpoint), 64)
    backend.prefill([5, 6, 7, 8])
    np.testing.assert_allclose(logits[0], backend.logits(), rtol=1e-6, atol=1e-6)
    assert out['generated_ids'][0] == backend.argmax()
    assert out['prefill_ms'] > 0 and out['decode_ms_median'] > 0


def test_prompt_text_through_the_tokenizer(tiny_checkpoint):
    result = generate('--model', str(tiny_checkpoint), '--prompt', 't1 t2 t3',
                      '--max-new-tokens', '3')
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 3


def test_generation_longer_than_the_cache_stays_bounded(tiny_checkpoint):
    result = generate('--model', str(tiny_checkpoint), '--token-ids', '1,2,3',
                      '--max-new-tokens', '100', '--kv-capacity', '32', '--policy', 'meaning',
                      '--json')
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out['generated_ids']) == 100
    assert out['cache_length'] <= 32 and out['evicted_tokens'] > 0


def test_bad_inputs_are_clear_errors(tiny_checkpoint, tmp_path):
    cases = [
        (['--model', str(tmp_path), '--token-ids', '1'], 'config.json'),
        (['--model', str(tiny_checkpoint), '--token-ids', '1,99999'], 'out of range'),
        (['--model', str(tiny_checkpoint), '--token-ids', '1', '--kv-capacity', '99999'],
         'kv capacity'),
    ]
    for args, message in cases:
        result = generate(*args)
        assert result.returncode == 2, result
        assert message in result.stderr and 'Traceback' not in result.stderr
    result = generate('--model', str(tiny_checkpoint), '--token-ids', 'a,b')
    assert result.returncode == 2 and 'comma-separated' in result.stderr


def test_cuda_backend_request_is_a_clear_error_here(tiny_checkpoint):
    result = generate('--model', str(tiny_checkpoint), '--token-ids', '1', '--backend', 'cuda')
    assert result.returncode == 2 and 'Traceback' not in result.stderr
    assert 'cuda' in result.stderr.lower()


def test_generation_stops_at_the_models_end_of_sequence_token(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path / 'ckpt')
    first = json.loads(generate('--model', str(tmp_path / 'ckpt'), '--token-ids', '5,6,7,8',
                                '--max-new-tokens', '8', '--json').stdout)['generated_ids']
    config = json.loads((tmp_path / 'ckpt' / 'config.json').read_text())
    config['eos_token_id'] = [9999, first[2]]    # HF allows a list
    (tmp_path / 'ckpt' / 'config.json').write_text(json.dumps(config))
    result = generate('--model', str(tmp_path / 'ckpt'), '--token-ids', '5,6,7,8',
                      '--max-new-tokens', '8', '--json')
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout)['generated_ids']
    assert ids == first[:first.index(first[2]) + 1], (ids, first)
    ignore = json.loads(generate('--model', str(tmp_path / 'ckpt'), '--token-ids', '5,6,7,8',
                                 '--max-new-tokens', '8', '--json', '--ignore-eos').stdout)
    assert ignore['generated_ids'] == first


def test_the_default_cache_fits_a_model_trained_on_fewer_positions(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path / 'ckpt')
    config = json.loads((tmp_path / 'ckpt' / 'config.json').read_text())
    config['max_position_embeddings'] = 512
    (tmp_path / 'ckpt' / 'config.json').write_text(json.dumps(config))
    result = generate('--model', str(tmp_path / 'ckpt'), '--prompt', 't1 t2 t3', '--json')
    assert result.returncode == 0, result.stderr
