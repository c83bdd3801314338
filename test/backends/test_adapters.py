"""LoRA adapters merged on load: the same greedy tokens as transformers + PEFT merge_and_unload.

Random tiny models of both families (Llama with grouped-query attention, Qwen2 with q/k/v
biases) saved in bf16, and GGUF files (F32 and Q8_0 matrices) read by transformers as the
reference does; a random adapter on all seven projections made by PEFT itself
(``init_lora_weights=False``: B is not zero), saved as PEFT saves it. A wrong adapter is one
error naming its file and the tensor or key.
"""

import json

import numpy as np
import pytest

from hf_models import build_hf_model
from hf_models import CASES
from hf_models import save_hf_checkpoint
from hf_models import torch
from hf_models import transformers
from hf_models import VOCAB
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import CheckpointError
from rt_llm_node.model import load_model

peft = pytest.importorskip('peft', reason='peft makes the reference adapters')

MODULES = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
STEPS = 12


def make_adapter(model, directory, rank=4, alpha=8, seed=1, **options):
    """Wrap ``model`` in a random PEFT LoRA, save it to ``directory``; return the merged model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=MODULES,
                             init_lora_weights=False, **options)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():   # larger than PEFT's init, so the adapter changes the tokens
        for name, p in wrapped.named_parameters():
            if 'lora_' in name:
                p.mul_(4.0)
    wrapped.save_pretrained(directory)
    return wrapped.merge_and_unload()


def reference_tokens(model, prompt, steps=STEPS):
    """Greedy tokens of a torch model, in fp32 (a GGUF-loaded model is fp32 already)."""
    model = (model if getattr(model, 'is_quantized', False) else model.float()).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def ours_tokens(path, adapter, prompt, steps=STEPS, weight_format='native'):
    backend = NumpyBackend(load_model(path, adapter, weight_format), 128)
    backend.prefill(prompt)
    tokens = []
    for _ in range(steps):
        tokens.append(backend.argmax())
        backend.decode(tokens[-1])
    return tokens


@pytest.mark.parametrize('case', ['llama_gqa_tied', 'qwen2_bias_untied'])
def test_a_merged_adapter_gives_the_tokens_of_peft_merge_and_unload(case, tmp_path):
    family, kwargs = CASES[case]
    base = save_hf_checkpoint(build_hf_model(family, kwargs, seed=5), tmp_path / 'base')
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = make_adapter(model, tmp_path / 'adapter')
    prompt = np.random.default_rng(11).integers(0, VOCAB, 24).tolist()
    want = reference_tokens(merged, prompt)
    plain = reference_tokens(transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16), prompt)
    assert want != plain, 'the adapter changes nothing: the test would prove nothing'
    assert ours_tokens(base, tmp_path / 'adapter', prompt) == want
    assert ours_tokens(base, '', prompt) == plain


@pytest.mark.parametrize('kind', ['F32', 'Q8_0'])
def test_an_adapter_on_a_gguf_base_merges_in_fp32(kind, tmp_path):
    from gguf_models import prompts
    from gguf_models import write_gguf
    path = write_gguf(tmp_path / f'base_{kind}.gguf', 'llama', kind)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    merged = make_adapter(model, tmp_path / 'adapter', seed=2)
    checkpoint_prompts = prompts(load_model(path).tokenizer, 3)
    for ids in checkpoint_prompts:
        assert ours_tokens(path, tmp_path / 'adapter', ids) == reference_tokens(merged, ids)
    # quantized again after the merge, as weight_format int8 asks: it runs, and stays close
    tokens = ours_tokens(path, tmp_path / 'adapter', checkpoint_prompts[0], 4, 'int8')
    assert len(tokens) == 4


def test_rslora_scaling_is_alpha_over_the_root_of_the_rank(tmp_path):
    family, kwargs = CASES['llama_gqa_tied']
    base = save_hf_checkpoint(build_hf_model(family, kwargs, seed=6), tmp_path / 'base')
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = make_adapter(model, tmp_path / 'adapter', rank=16, alpha=4, use_rslora=True)
    prompt = list(range(3, 27))
    assert ours_tokens(base, tmp_path / 'adapter', prompt) == reference_tokens(merged, prompt)


@pytest.fixture(scope='module')
def made(tmp_path_factory):
    """Return a base and a good adapter for it, and a base of another shape."""
    root = tmp_path_factory.mktemp('adapters')
    family, kwargs = CASES['llama_gqa_tied']
    base = save_hf_checkpoint(build_hf_model(family, kwargs), root / 'base')
    make_adapter(transformers.AutoModelForCausalLM.from_pretrained(base), root / 'good')
    other = save_hf_checkpoint(build_hf_model(family, dict(kwargs, hidden_size=96)),
                               root / 'other')
    return root, base, other


def copy_adapter(made, tmp_path, config=None, tensors=None):
    """Return a copy of the good adapter with its config keys and tensors changed."""
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file
    root = made[0]
    data = json.loads((root / 'good' / 'adapter_config.json').read_text())
    data.update(config or {})
    (tmp_path / 'adapter_config.json').write_text(json.dumps(data))
    weights = load_file(str(root / 'good' / 'adapter_model.safetensors'))
    for name, value in (tensors or {}).items():
        if value is None:
            weights.pop(name)
        else:
            weights[name] = value
    save_file(weights, str(tmp_path / 'adapter_model.safetensors'))
    return tmp_path


A = 'base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight'
B = 'base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight'


@pytest.mark.parametrize('change, fragments', [
    ({'config': {'r': 0}}, ["'r' = 0", 'adapter_config.json']),
    ({'config': {'peft_type': 'IA3'}}, ["'peft_type' = 'IA3'"]),
    ({'config': {'target_modules': ['q_proj', 'lm_head']}}, ["'lm_head'"]),
    ({'config': {'use_dora': True}}, ["'use_dora' = True"]),
    ({'tensors': {A: np.full((4, 64), np.nan, np.float32)}}, [A, 'NaN']),
    ({'tensors': {B: None}}, [A, 'no lora_B']),
    ({'tensors': {A: np.zeros((3, 64), np.float32)}}, [A, 'rank r = 4']),
    ({'tensors': {'base_model.model.lm_head.lora_A.weight': np.zeros((4, 64), np.float32)}},
     ['lm_head.lora_A.weight', 'not a LoRA weight']),
])
def test_a_wrong_adapter_is_one_error_naming_file_and_tensor(made, tmp_path, change, fragments):
    adapter = copy_adapter(made, tmp_path, change.get('config'), change.get('tensors'))
    with pytest.raises(CheckpointError) as info:
        load_model(made[1], adapter)
    message = str(info.value)
    assert '\n' not in message and str(tmp_path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_an_adapter_for_another_base_names_the_weight_and_both_shapes(made):
    root, base, other = made
    with pytest.raises(CheckpointError) as info:
        load_model(other, root / 'good')
    message = str(info.value)
    assert 'another base' in message and 'model.layers.0.' in message, message
    with pytest.raises(CheckpointError, match='not an adapter folder'):
        load_model(base, root / 'missing')


@pytest.fixture(scope='module')
def smollm2(smollm2_gguf, tmp_path_factory):
    """Return the real SmolLM2-135M-Instruct as transformers reads its GGUF, and as a folder."""
    pytest.importorskip('gguf', reason='the gguf package reads GGUF files')
    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.float32)
    settings = {k: v for k, v in model.config.to_dict().items()
                if k not in ('quantization_config', 'architectures')}
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    plain.load_state_dict(model.state_dict())
    base = tmp_path_factory.mktemp('smollm2') / 'base'
    plain.to(torch.bfloat16).save_pretrained(base)   # the same weights, as people hold them
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(base)
    return smollm2_gguf, model, base


@pytest.mark.parametrize('base_format', ['gguf', 'safetensors'])
def test_a_random_adapter_on_the_real_smollm2_gives_the_tokens_of_peft(
        smollm2, base_format, tmp_path):
    """SmolLM2-135M-Instruct, a rank-8 adapter on all seven projections of its 30 layers."""
    import copy
    gguf_path, gguf_model, folder = smollm2
    if base_format == 'gguf':
        base, model = gguf_path, copy.deepcopy(gguf_model)
    else:
        base = folder
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = make_adapter(model, tmp_path / 'adapter', rank=8, alpha=16, seed=3)
    tokenizer = load_model(base).tokenizer
    prompt = tokenizer.encode('go to the red box and stop in front of it').ids
    want = reference_tokens(merged, prompt, 8)
    assert ours_tokens(base, tmp_path / 'adapter', prompt, 8) == want


def test_the_shipped_smollm2_adapter_merges_as_peft_does_on_its_base(smollm2):
    """The demo's SmolLM2 adapter, as PEFT loads and merges it into the GGUF it was trained on.

    Its record names that base by checksum, so the adapter cannot silently drift from the
    file ``rt-llm-demo --model smollm2`` checks.
    """
    import copy
    from rt_llm_node.model.embedded import SMOLLM2_ADAPTER_DIR
    from rt_llm_node.model.embedded import SMOLLM2_SHA256
    record = json.loads((SMOLLM2_ADAPTER_DIR / 'training.json').read_text())
    assert record['base_sha256'] == SMOLLM2_SHA256
    gguf_path, gguf_model, _ = smollm2
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(gguf_model),
                                            str(SMOLLM2_ADAPTER_DIR)).merge_and_unload()
    tokenizer = load_model(gguf_path).tokenizer
    prompt = tokenizer.encode('go to the red box and stop in front of it').ids
    want = reference_tokens(merged, prompt, 8)
    assert ours_tokens(gguf_path, SMOLLM2_ADAPTER_DIR, prompt, 8) == want
    assert want != reference_tokens(copy.deepcopy(gguf_model), prompt, 8), \
        'the adapter changes what the base says'
