"""Numpy backend against HF transformers: 40-token prefill, 32 greedy steps, fp32 math."""

import numpy as np
import pytest

from hf_models import build_hf_model
from hf_models import CASES
from hf_models import hf_greedy_reference
from hf_models import save_hf_checkpoint
from hf_models import torch
from hf_models import VOCAB
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import load_checkpoint

PREFILL = 40
STEPS = 32
TOLERANCE = 1e-4


def ours_greedy(directory, prompt, steps, capacity=128):
    backend = NumpyBackend(load_checkpoint(directory), capacity)
    backend.prefill(prompt)
    logits, tokens = [], []
    for _ in range(steps):
        logits.append(backend.logits().astype(np.float64))
        tokens.append(backend.argmax())
        backend.decode(tokens[-1])
    return logits, tokens


def assert_parity(ours, ref):
    (ours_logits, ours_tokens), (ref_logits, ref_tokens) = ours, ref
    for step, (a, b) in enumerate(zip(ours_logits, ref_logits)):
        rel = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert rel < TOLERANCE, f'step {step}: max|ours-ref|/max|ref| = {rel:.2e}'
    assert ours_tokens == ref_tokens


@pytest.mark.parametrize('case', sorted(CASES))
def test_bf16_checkpoint_matches_transformers(case, tmp_path):
    family, kwargs = CASES[case]
    directory = save_hf_checkpoint(build_hf_model(family, kwargs), tmp_path)
    prompt = np.random.default_rng(7).integers(0, VOCAB, PREFILL).tolist()
    ref = hf_greedy_reference(directory, prompt, STEPS)
    ours = ours_greedy(directory, prompt, STEPS)
    assert_parity(ours, ref)
    assert len(set(ref[1])) > 1, 'a constant greedy sequence would prove little'


@pytest.mark.parametrize('dtype', ['float16', 'float32'])
def test_fp16_and_fp32_checkpoints_match_transformers(dtype, tmp_path):
    family, kwargs = CASES['qwen2_bias_untied']
    model = build_hf_model(family, kwargs, seed=3)
    directory = save_hf_checkpoint(model, tmp_path, dtype=getattr(torch, dtype))
    prompt = np.random.default_rng(8).integers(0, VOCAB, PREFILL).tolist()
    assert_parity(ours_greedy(directory, prompt, 8), hf_greedy_reference(directory, prompt, 8))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    family, kwargs = CASES['llama_gqa_tied']
    single = save_hf_checkpoint(build_hf_model(family, kwargs), tmp_path / 'single')
    sharded = save_hf_checkpoint(build_hf_model(family, kwargs), tmp_path / 'sharded',
                                 max_shard_size='60KB')
    assert (sharded / 'model.safetensors.index.json').exists()
    assert len(list(sharded.glob('model-*.safetensors'))) > 1
    prompt = list(range(1, 30))
    a, b = ours_greedy(single, prompt, 4), ours_greedy(sharded, prompt, 4)
    assert a[1] == b[1]
    np.testing.assert_array_equal(np.array(a[0]), np.array(b[0]))
