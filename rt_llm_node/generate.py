r"""``rt-llm-generate``: check on the robot that a checkpoint loads and decodes.

Examples::

    rt-llm-generate --prompt "go to the red box" --max-new-tokens 16
    rt-llm-generate --model ~/models/SmolLM2-135M --token-ids 1,2,3 --json \\
        --kv-capacity 256 --policy meaning --dump-logits /tmp/logits.npy
"""

import argparse
import io
import json
import sys
import time

import numpy as np

from rt_llm_node.backends import BackendError
from rt_llm_node.backends import BACKENDS
from rt_llm_node.backends import KV_DTYPES
from rt_llm_node.backends import make_backend
from rt_llm_node.files import write_atomic
from rt_llm_node.kvcache import CacheFullError
from rt_llm_node.kvcache import make_policy
from rt_llm_node.kvcache import POLICIES
from rt_llm_node.model import CheckpointError
from rt_llm_node.model import load_model
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.model.quant import WEIGHT_FORMATS
from rt_llm_node.session import greedy_generate
from rt_llm_node.session import KVSession


def parse_token_ids(text):
    """'1,2,3' -> [1, 2, 3]; ArgumentTypeError on anything else."""
    try:
        ids = [int(t) for t in text.replace(' ', '').split(',') if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f'not a comma-separated list of integers: {text!r}')
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError('token ids must be non-negative, at least one')
    return ids


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be at least 1, got {value}')
    return value


def build_parser():
    parser = argparse.ArgumentParser(prog='rt-llm-generate', description=__doc__.split('\n')[0])
    parser.add_argument('--model', default=None,
                        help='HF-layout checkpoint directory or .gguf file (default: the '
                             'embedded demo model)')
    parser.add_argument('--kv-dtype', choices=KV_DTYPES, default='native',
                        help='KV cache values: native (fp32) or int8 (a scale per token and '
                             'kv head)')
    parser.add_argument('--adapter', default='',
                        help='LoRA adapter folder (PEFT) merged into the model on load')
    parser.add_argument('--weight-format', choices=sorted(WEIGHT_FORMATS), default='native',
                        help='native (as stored), or int8/int4: float matrices quantized on '
                             'load')
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--prompt', help="prompt text, tokenized with the model's tokenizer")
    source.add_argument('--token-ids', type=parse_token_ids, help='prompt as ids, e.g. 1,2,3')
    parser.add_argument('--max-new-tokens', type=positive_int, default=32)
    parser.add_argument('--backend', choices=BACKENDS, default='numpy')
    parser.add_argument('--kv-capacity', type=positive_int, default=None,
                        help='KV cache size in tokens (eviction keeps it bounded; default: '
                             "1024, or the model's trained length if shorter)")
    parser.add_argument('--policy', choices=sorted(POLICIES), default='meaning',
                        help='eviction policy when the cache is full')
    parser.add_argument('--segment-tokens', type=positive_int, default=16,
                        help='prompt and output are cached in segments of this many tokens')
    parser.add_argument('--json', action='store_true', help='print ids and timings as JSON')
    parser.add_argument('--ignore-eos', action='store_true',
                        help="go on past the model's end-of-sequence token")
    parser.add_argument('--dump-logits', metavar='FILE.npy',
                        help='save the logits of every generated step, [steps, vocab] float32')
    return parser


def run(args):
    started = time.perf_counter()
    checkpoint = load_model(args.model or default_model_path(), args.adapter,
                            args.weight_format)
    if args.kv_capacity is None:
        args.kv_capacity = min(1024, checkpoint.config.max_position_embeddings)
    backend = make_backend(args.backend, checkpoint, args.kv_capacity, kv_dtype=args.kv_dtype)
    load_s = time.perf_counter() - started
    if args.prompt is not None:
        prompt_ids = checkpoint.tokenizer.encode(args.prompt).ids
        if not prompt_ids:
            raise ValueError('the prompt encodes to no tokens')
    else:
        prompt_ids = args.token_ids
    vocab = checkpoint.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise ValueError(f'token id {max(prompt_ids)} is out of range (vocab_size {vocab})')
    context = KVSession(backend, make_policy(args.policy))
    segment_tokens = min(args.segment_tokens, max(1, args.kv_capacity // 4))
    logits, stamps = [], []

    def on_step(step, backend):
        stamps.append(time.perf_counter())
        if args.dump_logits:
            logits.append(backend.logits())

    t0 = time.perf_counter()
    stop_ids = () if args.ignore_eos else checkpoint.config.eos_token_ids
    ids = greedy_generate(context, prompt_ids, args.max_new_tokens,
                          segment_tokens=segment_tokens, on_step=on_step, stop_ids=stop_ids)
    step_ms = np.diff(stamps) * 1e3
    result = {
        'model': str(checkpoint.path),
        'backend': backend.name,
        'prompt_tokens': len(prompt_ids),
        'generated_ids': ids,
        'text': checkpoint.tokenizer.decode(ids),
        'load_s': round(load_s, 3),
        'prefill_ms': round((stamps[0] - t0) * 1e3, 3),
        'decode_ms_median': round(float(np.median(step_ms)), 3) if len(step_ms) else None,
        'decode_ms_p99': round(float(np.percentile(step_ms, 99)), 3) if len(step_ms) else None,
        'cache_length': context.length,
        'evicted_tokens': context.cache.evicted_tokens,
    }
    if args.dump_logits:
        buffer = io.BytesIO()
        np.save(buffer, np.stack(logits).astype(np.float32))
        write_atomic(args.dump_logits, buffer.getvalue(), '--dump-logits')
    return result


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except (CheckpointError, BackendError, CacheFullError, ValueError, OSError) as exc:
        print(f'rt-llm-generate: error: {exc}', file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result['text'])
        print(f"[{result['backend']}] prompt {result['prompt_tokens']} tokens, prefill "
              f"{result['prefill_ms']} ms, decode {result['decode_ms_median']} ms/token "
              f"(p99 {result['decode_ms_p99']}), cache {result['cache_length']} tokens, "
              f"evicted {result['evicted_tokens']}", file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())
