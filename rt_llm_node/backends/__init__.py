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

Optionally (speculative decoding: the numpy backend, and the CUDA one built with
``verify_tokens``):

- ``verify_tokens``: the most tokens one verify pass takes (``verify_limit``);
- ``verify(token_ids, allowed)``: run ``k`` tokens in one call and return the greedy token
  after each (among ``allowed[i]``), row-exact: every row's logits, attention mass and cache
  entries equal those of ``k`` decode calls bit for bit;
- ``row_mass(i)``: row ``i``'s attention mass from the last verify;
- ``prefill_verify(prefill_ids, drafts, allowed)``: ``prefill(prefill_ids)`` and a verify of
  ``drafts`` after it in one call (the CUDA backend runs the two side by side); returns the
  greedy token after the prefill and after each draft verified. Its verify rows are the
  prefill's last token (row 0, with the prefill's attention mass) and the drafts, so rolling
  back to the prefill's end leaves exactly what ``prefill`` would have.

The argument checks of that contract live here, once, for both backends.
"""

import numpy as np


class BackendError(RuntimeError):
    """A backend failed to run (device fault, non-finite output, misuse)."""


class CacheOverflowError(BackendError):
    """More tokens were run than the KV cache has free slots for."""


# -- the contract's argument checks, shared by every backend ------------------------------
def check_capacity(capacity, config):
    """Return a KV capacity must be in 1 .. the model's trained length."""
    if not 1 <= capacity <= config.max_position_embeddings:
        raise ValueError(f'kv capacity {capacity} must be in 1..{config.max_position_embeddings} '
                         "(the model's trained length)")


def token_ids(ids, length, capacity, vocab_size):
    """``ids`` as int64 [n] after checking they can run at positions ``length ..``."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = len(ids)
    if n == 0:
        raise BackendError('no tokens to run')
    if length + n > capacity:
        raise CacheOverflowError(f'{n} tokens do not fit: {length} of {capacity} '
                                 'cache slots in use')
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise BackendError(f'token id out of range 0..{vocab_size - 1}')
    return ids


def verify_limit(backend):
    """Return the most tokens ``backend`` verifies in one pass (0: it has no verify)."""
    return int(getattr(backend, 'verify_tokens', 0) or 0) if hasattr(backend, 'verify') else 0


def rollback_length(target, length):
    """``target`` as an int after checking that a cache of ``length`` can roll back to it."""
    if not 0 <= target <= length:
        raise BackendError(f'cannot roll back to {target} (length {length})')
    return int(target)


def compact_slots(keep, length):
    """``keep`` as int64 [m] after checking the slots ascend and lie below ``length``."""
    keep = np.asarray(keep, dtype=np.int64).reshape(-1)
    if len(keep) and (keep[-1] >= length or np.any(np.diff(keep) <= 0) or keep[0] < 0):
        raise BackendError('compact needs ascending slots below the cache length')
    return keep


def kv_slot_count(tensors, cache, start):
    """Slots that ``tensors`` (an export of slots) fill from ``start`` in ``cache``.

    ``cache``: name -> the backend's array [layers, capacity, ...] for each exported name;
    ``tensors`` must hold the same names, dtypes and shapes but for the slot count, which
    must fit from ``start``. Raises ValueError naming what does not fit.
    """
    if set(tensors) != set(cache):
        raise ValueError(f'expected tensors {sorted(cache)}, got {sorted(tensors)}')
    n = tensors['k'].shape[1] if getattr(tensors['k'], 'ndim', 0) > 1 else -1
    for name, mine in cache.items():
        theirs = tensors[name]
        if (getattr(theirs, 'dtype', None) != mine.dtype
                or theirs.shape[:1] + theirs.shape[2:] != mine.shape[:1] + mine.shape[2:]
                or theirs.shape[1] != n or not 0 < n <= mine.shape[1] - start):
            raise ValueError(f'{name}: {getattr(theirs, "dtype", None)} {theirs.shape} does '
                             f'not fit this cache ({mine.dtype}, {mine.shape}) from slot {start}')
    return n


def kv_slot_range(start, stop, length):
    """(start, stop) as ints after checking they name cached slots, at least one."""
    if not 0 <= start < stop <= length:
        raise BackendError(f'cannot export slots {start}..{stop - 1} of a cache of {length}')
    return int(start), int(stop)


BACKENDS = ('auto', 'numpy', 'cuda')
# the KV cache: fp32 as computed, or int8 codes with an fp32 scale per token and kv head
KV_DTYPES = ('native', 'int8')


def check_kv_dtype(kv_dtype):
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f'unknown kv_dtype {kv_dtype!r} (choose from {", ".join(KV_DTYPES)})')


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
    """Return the CUDA backend class, or None where this build has none."""
    try:
        from rt_llm_node.backends.cuda_backend import CudaBackend
    except ImportError:
        return None
    return CudaBackend


def make_backend(name, checkpoint, capacity, decode_step='auto', kv_dtype='native',
                 verify_tokens=0):
    """Build backend ``name`` ('auto', 'numpy' or 'cuda') for ``checkpoint``.

    The CUDA one with ``decode_step`` (DECODE_STEPS) and verify passes of up to
    ``verify_tokens`` tokens (0: none; the numpy backend verifies any number); either with a
    ``kv_dtype`` cache.
    """
    check_kv_dtype(kv_dtype)
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
        from rt_llm_node.backends.cuda_backend import CudaOptions
        # auto: the faster decode step on this device and model, timed at configure
        return backend_class(checkpoint, capacity,
                             CudaOptions(decode_step=decode_step, kv_dtype=kv_dtype,
                                         verify_tokens=verify_tokens))
    from rt_llm_node.backends.numpy_backend import NumpyBackend
    return NumpyBackend(checkpoint, capacity, kv_dtype)
