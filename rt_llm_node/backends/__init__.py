"""Inference backends: one interface, a numpy reference and a CUDA implementation.

Every backend owns a fixed-capacity KV cache (``k, v: [layers, capacity,
n_kv_heads, head_dim]``) whose slot ``i`` holds the token at position ``i``, and
offers the same calls:

- ``prefill(token_ids)``: run ``n`` tokens at positions ``length .. length+n-1``;
- ``decode(token_id)``: the same for one token (the hot path);
- ``logits()``: float32 ``[vocab]`` logits of the last token run;
- ``argmax(allowed=None)``: the greedy next token, optionally among sorted
  ``allowed`` ids only (constrained decoding);
- ``attention_mass()``: float32 ``[length]``, softmax weight each cached token
  received during the last call, summed over query tokens, heads and layers;
- ``compact(keep)``: move the kept slots to ``0 .. len(keep)-1`` and re-rotate
  their keys, so positions stay below ``capacity``;
- ``rollback(length)``: forget every token at or after ``length``.
"""


class BackendError(RuntimeError):
    """A backend failed to run (device fault, non-finite output, misuse)."""


class CacheOverflowError(BackendError):
    """More tokens were run than the KV cache has free slots for."""


BACKENDS = ('auto', 'numpy', 'cuda')
# the CUDA backend's decode step: the faster of the two timed at configure, a kernel a phase,
# or one persistent (cooperative) launch; the numpy backend has one step and ignores it
DECODE_STEPS = ('auto', 'kernels', 'persistent')


def cuda_available():
    """Return True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CUDARuntimeError without a driver
        return False


def cuda_backend_class():
    """The CUDA backend class, or None where this build has none."""
    try:
        from rt_llm_node.backends.cuda_backend import CudaBackend
    except ImportError:
        return None
    return CudaBackend


def make_backend(name, checkpoint, capacity, decode_step='auto'):
    """Build backend ``name`` ('auto', 'numpy' or 'cuda') for ``checkpoint``; the CUDA one
    with ``decode_step`` (DECODE_STEPS)."""
    if name not in BACKENDS:
        raise ValueError(f'unknown backend {name!r} (choose from {", ".join(BACKENDS)})')
    if decode_step not in DECODE_STEPS:
        raise ValueError(f'unknown decode step {decode_step!r} '
                         f'(choose from {", ".join(DECODE_STEPS)})')
    if name == 'auto':
        name = 'cuda' if cuda_available() and cuda_backend_class() else 'numpy'
    if name == 'cuda':
        backend_class = cuda_backend_class()
        if backend_class is None:
            raise BackendError('the CUDA backend is not part of this build yet; '
                               "use backend 'numpy' (or 'auto')")
        if not cuda_available():
            raise BackendError('backend cuda needs CuPy and a CUDA device; none was found')
        # auto: the faster decode step on this device and model, timed at configure
        persistent = {'auto': 'auto', 'kernels': False, 'persistent': 'barrier'}[decode_step]
        return backend_class(checkpoint, capacity, persistent_decode=persistent)
    from rt_llm_node.backends.numpy_backend import NumpyBackend
    return NumpyBackend(checkpoint, capacity)
