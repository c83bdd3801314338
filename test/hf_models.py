"""Random checkpoints created by HF transformers (CPU torch), for parity tests only."""

import pytest

torch = pytest.importorskip('torch', reason='torch (CPU) is needed to build reference models')
transformers = pytest.importorskip('transformers', reason='transformers builds reference models')

from rt_llm_node.model.synthetic import word_tokenizer  # noqa: E402

VOCAB = 320
BASE = {'vocab_size': VOCAB, 'hidden_size': 64, 'intermediate_size': 128,
        'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'max_position_embeddings': 512, 'rms_norm_eps': 1e-5}

CASES = {
    # (a) Llama, grouped-query attention, tied embeddings
    'llama_gqa_tied': ('llama', dict(BASE, tie_word_embeddings=True)),
    # (b) Qwen2 with q/k/v biases, untied head
    'qwen2_bias_untied': ('qwen2', dict(BASE, tie_word_embeddings=False, rope_theta=1e6)),
    # (c) Llama 3 rope scaling, explicit head_dim different from hidden/heads
    'llama3_rope_scaling': ('llama', dict(
        BASE, tie_word_embeddings=True, head_dim=32, rope_theta=500000.0,
        rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                      'high_freq_factor': 4.0, 'original_max_position_embeddings': 32})),
}


def build_hf_model(family, kwargs, seed=0):
    """Return a randomly initialised (weights, biases and norms all random) HF model."""
    torch.manual_seed(seed)
    if family == 'llama':
        config = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith('bias'):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def save_hf_checkpoint(model, directory, dtype=torch.bfloat16, **save_kwargs):
    """Save ``model`` in ``dtype`` with a real tokenizer.json; returns the directory."""
    model.to(dtype).save_pretrained(directory, **save_kwargs)
    word_tokenizer(VOCAB).save(str(directory / 'tokenizer.json'))
    return directory


def hf_greedy_reference(directory, prompt, steps):
    """Reload ``directory`` in fp32 with transformers; return (logits [steps, V], tokens)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation='eager').eval()
    ids = list(prompt)
    all_logits, tokens = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
            token = int(logits.argmax())
            all_logits.append(logits)
            tokens.append(token)
            ids.append(token)
    return all_logits, tokens
