"""Reference implementation of every op, in float32 numpy: the oracle and the CPU fallback.

The model is a Llama/Qwen2 decoder: per layer
``x += o_proj(attn(rope(q), rope(k), v))`` on ``rmsnorm(x)``, then
``x += down(silu(gate(h)) * up(h))`` on ``rmsnorm(x)``; logits from the final norm.
"""

import numpy as np

from rt_llm_node.backends import BackendError
from rt_llm_node.backends import check_capacity
from rt_llm_node.backends import check_kv_dtype
from rt_llm_node.backends import compact_slots
from rt_llm_node.backends import kv_slot_count
from rt_llm_node.backends import kv_slot_range
from rt_llm_node.backends import rollback_length
from rt_llm_node.backends import token_ids


def rmsnorm(x, weight, eps):
    """x: [n, hidden] -> [n, hidden]."""
    variance = np.einsum('ij,ij->i', x, x)[:, None] / x.shape[-1]
    return x / np.sqrt(variance + eps) * weight


def silu(x):
    """Compute x * sigmoid(x), elementwise."""
    return x / (1.0 + np.exp(-x))


def rope_tables(positions, inv_freq):
    """positions: [n] (may be negative) -> cos, sin: [n, head_dim // 2] float32."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x, cos, sin):
    """Rotate pairs (i, i + d/2) of x: [n, heads, head_dim] by the angles in cos/sin [n, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty(x.shape, np.float32)
    np.multiply(x1, c, out=out[..., :half])
    out[..., :half] -= x2 * s
    np.multiply(x2, c, out=out[..., half:])
    out[..., half:] += x1 * s
    return out


_CAUSAL_MASKS = {}


def causal_mask(n):
    """[n, n] float32: 0 on and below the diagonal, -inf above (cached per n)."""
    mask = _CAUSAL_MASKS.get(n)
    if mask is None:
        mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
        if len(_CAUSAL_MASKS) < 256:
            _CAUSAL_MASKS[n] = mask
    return mask


def attention(q, k, v, start):
    """Causal GQA attention of n new queries over the cache.

    q: [n, n_heads, d] at positions start .. start+n-1;
    k, v: [T, n_kv_heads, d] with T = start + n (slot == position).
    Returns out: [n, n_heads, d] and mass: [T], the softmax weight each key
    received, summed over queries and heads.
    """
    n, n_heads, d = q.shape
    t, n_kv, _ = k.shape
    group = n_heads // n_kv
    # rows of kv head h: (token, head h*group + j) -- HF repeat_kv order; one batched
    # product per step over all kv heads (strided cache views go straight to BLAS)
    qs = np.multiply(q.reshape(n, n_kv, group, d).transpose(1, 0, 2, 3),
                     np.float32(1.0 / np.sqrt(d))).reshape(n_kv, n * group, d)
    scores = np.matmul(qs, k.transpose(1, 2, 0))                        # [kv, n*g, T]
    if n > 1:  # causal: only the new block needs a mask, older keys are all visible
        scores.reshape(n_kv, n, group, t)[..., start:] += causal_mask(n)[:, None, :]
    scores -= scores.max(axis=2, keepdims=True)
    np.exp(scores, out=scores)                                          # unnormalized
    inv = np.float32(1.0) / scores.sum(axis=2, keepdims=True)           # [kv, n*g, 1]
    # normalized after the products, not before: the [kv, n*g, d] output and one vector
    # instead of another pass over the [kv, n*g, T] scores
    out = np.matmul(scores, v.transpose(1, 0, 2))                       # [kv, n*g, d]
    out *= inv
    mass = inv.reshape(-1) @ scores.reshape(-1, t)                      # probabilities summed
    return out.reshape(n_kv, n, group, d).transpose(1, 0, 2, 3).reshape(n, n_heads, d), mass


class LayerWeights:
    """One decoder layer's weights in float32, projections fused for fewer matmuls."""

    def __init__(self, checkpoint, index):
        f = checkpoint.float32
        p = f'model.layers.{index}.'
        cfg = checkpoint.config
        self.attn_norm = f(p + 'input_layernorm.weight')                    # [hidden]
        self.mlp_norm = f(p + 'post_attention_layernorm.weight')            # [hidden]
        self.wqkv = np.concatenate([f(p + 'self_attn.q_proj.weight'),
                                    f(p + 'self_attn.k_proj.weight'),
                                    f(p + 'self_attn.v_proj.weight')])      # [q+2kv, hidden]
        self.bqkv = None
        if cfg.attention_bias:
            self.bqkv = np.concatenate([f(p + 'self_attn.q_proj.bias'),
                                        f(p + 'self_attn.k_proj.bias'),
                                        f(p + 'self_attn.v_proj.bias')])    # [q+2kv]
        self.wo = f(p + 'self_attn.o_proj.weight')                          # [hidden, q]
        self.wgate_up = np.concatenate([f(p + 'mlp.gate_proj.weight'),
                                        f(p + 'mlp.up_proj.weight')])       # [2*inter, hidden]
        self.wdown = f(p + 'mlp.down_proj.weight')                          # [hidden, inter]


def quantize_kv(x):
    """Int8 codes and an fp32 scale per (token, head) of keys or values [n, n_kv, d].

    scale = max|x| / 127 over the head's d values, code = round(x / scale) (half to even), in
    fp32: the CUDA kernels compute the same.
    """
    scale = np.abs(x).max(axis=-1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return codes, scale.astype(np.float32)


class KVStore:
    """The cache's keys and values; every write and read goes through here.

    fp32 (``native``), or int8 codes with a scale per token and kv head (``int8``).
    """

    def __init__(self, cfg, capacity, kv_dtype):
        check_kv_dtype(kv_dtype)
        self.kv_dtype = kv_dtype
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        if kv_dtype == 'native':
            self.k = np.zeros(shape, np.float32)    # [layers, capacity, n_kv_heads, head_dim]
            self.v = np.zeros(shape, np.float32)
        else:
            self.k = np.zeros(shape, np.int8)
            self.v = np.zeros(shape, np.int8)
            self.k_scale = np.zeros(shape[:3], np.float32)   # [layers, capacity, n_kv_heads]
            self.v_scale = np.zeros(shape[:3], np.float32)

    def write(self, layer, start, k, v):
        """Store keys and values [n, n_kv, d] at slots start .. start + n - 1."""
        end = start + len(k)
        if self.kv_dtype == 'native':
            self.k[layer, start:end] = k
            self.v[layer, start:end] = v
        else:
            self.k[layer, start:end], self.k_scale[layer, start:end] = quantize_kv(k)
            self.v[layer, start:end], self.v_scale[layer, start:end] = quantize_kv(v)

    def read(self, layer, end):
        """Keys and values of slots 0 .. end - 1 as fp32 [end, n_kv, d]."""
        if self.kv_dtype == 'native':
            return self.k[layer, :end], self.v[layer, :end]
        return (self.k[layer, :end] * self.k_scale[layer, :end, :, None],
                self.v[layer, :end] * self.v_scale[layer, :end, :, None])

    def move(self, layer, first, m, moved, cos, sin):
        """Slots ``moved`` to first .. m - 1, keys re-rotated by (cos, sin).

        Values move as stored; int8 keys are dequantized, rotated and quantized again.
        """
        if self.kv_dtype == 'native':
            self.k[layer, first:m] = apply_rope(self.k[layer, moved], cos, sin)
            self.v[layer, first:m] = self.v[layer, moved]
            return
        keys = self.k[layer, moved] * self.k_scale[layer, moved][:, :, None]
        self.k[layer, first:m], self.k_scale[layer, first:m] = quantize_kv(
            apply_rope(keys, cos, sin))
        self.v[layer, first:m] = self.v[layer, moved]
        self.v_scale[layer, first:m] = self.v_scale[layer, moved]

    def arrays(self):
        """Name -> array [layers, capacity, ...] of what the cache holds (codes and scales)."""
        names = ('k', 'v') if self.kv_dtype == 'native' else ('k', 'v', 'k_scale', 'v_scale')
        return {name: getattr(self, name) for name in names}

    def export(self, start, stop):
        """Return copies of slots start .. stop - 1: keys and values (and their scales)."""
        return {name: a[:, start:stop].copy() for name, a in self.arrays().items()}

    def load(self, tensors, start=0):
        """Write what ``export`` gave into slots from ``start``; returns their count.

        ValueError if the tensors do not fit.
        """
        n = kv_slot_count(tensors, self.arrays(), start)
        for name, a in self.arrays().items():
            a[:, start:start + n] = tensors[name]
        return n

    def bytes_per_token(self):
        """Cache bytes one token takes over every layer (keys, values and their scales)."""
        per = self.k[:, 0].nbytes + self.v[:, 0].nbytes
        if self.kv_dtype == 'int8':
            per += self.k_scale[:, 0].nbytes + self.v_scale[:, 0].nbytes
        return int(per)


class NumpyBackend:
    """Float32 numpy decoder with a preallocated KV cache (see ``rt_llm_node.backends``)."""

    name = 'numpy'

    def __init__(self, checkpoint, capacity, kv_dtype='native'):
        cfg = checkpoint.config
        check_capacity(capacity, cfg)
        self.config = cfg
        self.capacity = int(capacity)
        self.verify_tokens = self.capacity   # a verify pass of any length that fits
        self.embed = checkpoint.float32('model.embed_tokens.weight')        # [vocab, hidden]
        self.lm_head = (self.embed if cfg.tie_word_embeddings
                        else checkpoint.float32('lm_head.weight'))          # [vocab, hidden]
        self.final_norm = checkpoint.float32('model.norm.weight')           # [hidden]
        self.layers = [LayerWeights(checkpoint, i) for i in range(cfg.num_layers)]
        self.inv_freq = cfg.rope.inv_freq(cfg.head_dim)                     # [head_dim // 2]
        # cos, sin: [2 * capacity, head_dim // 2] for positions -capacity .. capacity-1
        self.cos, self.sin = rope_tables(np.arange(-self.capacity, self.capacity),
                                         self.inv_freq)
        self.kv = KVStore(cfg, self.capacity, kv_dtype)
        self.kv_dtype = kv_dtype
        self.length = 0
        self._logits = np.zeros(cfg.vocab_size, np.float32)                # [vocab]
        self._mass = np.zeros(0, np.float32)                                # [length]
        self._rows = None   # the last verify's (start, row logits, row masses)

    # -- the forward pass ------------------------------------------------------------
    def _forward(self, token_ids_in, rows=False):
        """Run the tokens; ``rows``: row by row as decode steps would (see ``verify``).

        Returns the logits of every row (``rows``) or of the last token.
        """
        cfg = self.config
        ids = token_ids(token_ids_in, self.length, self.capacity, cfg.vocab_size)
        n, start = len(ids), self.length
        end = start + n
        cos = self.cos[self.capacity + start:self.capacity + end]           # [n, d/2]
        sin = self.sin[self.capacity + start:self.capacity + end]
        x = self.embed[ids]                                                 # [n, hidden]
        masses = [np.zeros(start + r + 1, np.float32) for r in range(n)] if rows \
            else [np.zeros(end, np.float32)]                                # [T] each
        k_end = cfg.q_size + cfg.kv_size
        n_qk = cfg.num_heads + cfg.num_kv_heads

        def mm(a, w):   # a @ w.T, one-row products where rows must match decode steps
            if not rows or len(a) == 1:
                return a @ w.T
            return np.concatenate([a[r:r + 1] @ w.T for r in range(len(a))])
        for i, layer in enumerate(self.layers):
            h = rmsnorm(x, layer.attn_norm, cfg.rms_norm_eps)
            qkv = mm(h, layer.wqkv)                                         # [n, q+2kv]
            if layer.bqkv is not None:
                qkv += layer.bqkv
            # q and k rotated in one call: [n, n_heads + n_kv_heads, head_dim]
            qk = apply_rope(qkv[:, :k_end].reshape(n, n_qk, cfg.head_dim), cos, sin)
            self.kv.write(i, start, qk[:, cfg.num_heads:],
                          qkv[:, k_end:].reshape(n, cfg.num_kv_heads, cfg.head_dim))
            if rows:   # each row over its own prefix, as its decode step would see it
                outs = []
                for r in range(n):
                    o, m = attention(qk[r:r + 1, :cfg.num_heads],
                                     *self.kv.read(i, start + r + 1), start + r)
                    masses[r] += m
                    outs.append(o)
                out = np.concatenate(outs)
            else:
                out, layer_mass = attention(qk[:, :cfg.num_heads], *self.kv.read(i, end),
                                            start)
                masses[0] += layer_mass
            if i == len(self.layers) - 1 and n > 1 and not rows:
                # past the last layer's attention only the last token matters (its logits);
                # the others' keys, values and attention mass are already in hand
                x, out = x[-1:], out[-1:]
            x += mm(out.reshape(len(x), cfg.q_size), layer.wo)
            h = rmsnorm(x, layer.mlp_norm, cfg.rms_norm_eps)
            gate_up = mm(h, layer.wgate_up)                                 # [., 2*inter]
            act = silu(gate_up[:, :cfg.intermediate_size])
            act *= gate_up[:, cfg.intermediate_size:]
            x += mm(act, layer.wdown)
        logits = [self.lm_head @ rmsnorm(x[r:r + 1], self.final_norm, cfg.rms_norm_eps)[0]
                  for r in (range(n) if rows else [len(x) - 1])]            # [vocab] each
        if not all(np.all(np.isfinite(row)) for row in logits):
            raise BackendError('the model produced non-finite logits')
        self.length = end
        self._logits = logits[-1]
        self._mass = masses[-1]
        self._rows = (start, logits, masses) if rows else None
        return logits

    def prefill(self, token_ids):
        """Run token_ids: [n] at the next n positions, writing their keys and values."""
        self._forward(token_ids)

    def decode(self, token_id):
        """Run one token at the next position."""
        self._forward([token_id])

    def verify(self, token_ids, allowed):
        """Run ``token_ids`` [k] in one call, row by row exactly as k decode() calls would.

        Every row's products are one-row matmuls and its attention runs over its own prefix,
        the calls a decode step makes, so the cache and each row's logits equal those of k
        decode() calls bit for bit (what speculative decoding needs to stay exactly greedy);
        the rest of the per-step work is shared. ``allowed[i]``: sorted permitted ids after
        row i, or None. Returns int64 [k]: the greedy token after each row. The cache keeps
        all k tokens; ``rollback`` to fewer restores that row's logits and ``row_mass(i)``
        gives row i's attention mass (what its decode step's ``attention_mass`` would be).
        """
        logits = self._forward(token_ids, rows=True)
        if len(allowed) != len(logits):
            raise BackendError(f'verify got {len(allowed)} allowed sets for {len(logits)} rows')
        return np.array([int(np.argmax(row)) if ok is None else int(ok[np.argmax(row[ok])])
                         for row, ok in zip(logits, allowed)], np.int64)

    def prefill_verify(self, prefill_ids, drafts, allowed):
        """Run ``prefill(prefill_ids)`` and a verify of ``drafts`` after it in one call.

        Returns int64 [k + 1]: the greedy token after the prefill (among ``allowed[0]``) and
        after each draft (among ``allowed[i + 1]``). The verify's rows are the prefill's last
        token (row 0: its logits, the prefill's attention mass) and the k drafts (rows 1 ..
        k), so ``rollback`` to the prefill's end restores the prefill's logits and mass.
        Here the two run one after the other; the CUDA backend runs them side by side.
        """
        prefill_ids = np.asarray(prefill_ids, dtype=np.int64).reshape(-1)
        drafts = np.asarray(drafts, dtype=np.int64).reshape(-1)
        if not len(drafts):
            raise BackendError('prefill_verify needs at least one draft')
        if len(allowed) != len(drafts) + 1:
            raise BackendError(f'prefill_verify got {len(allowed)} allowed sets for '
                               f'{len(drafts)} drafts and the prefill')
        token_ids(np.concatenate([prefill_ids, drafts]), self.length, self.capacity,
                  self.config.vocab_size)   # both fit, both in the vocabulary
        self._forward(prefill_ids)
        first, mass = self._logits, self._mass
        predicted = self.verify(drafts, list(allowed[1:]))
        start, logits, masses = self._rows
        self._rows = (start - 1, [first] + list(logits), [mass] + list(masses))
        ok = allowed[0]
        head = int(np.argmax(first)) if ok is None else int(ok[np.argmax(first[ok])])
        return np.concatenate([[head], predicted]).astype(np.int64)

    def row_mass(self, i):
        """Float32 [start + i + 1]: the attention mass of row ``i`` of the last verify."""
        if self._rows is None or not 0 <= i < len(self._rows[2]):
            raise BackendError(f'no row {i} of a verify to read')
        return self._rows[2][i].copy()

    def export_kv(self, start, stop):
        """Return the cache's slots start .. stop - 1 as named numpy arrays (for ``import_kv``)."""
        start, stop = kv_slot_range(start, stop, self.length)
        return self.kv.export(start, stop)

    def import_kv(self, tensors, start=0):
        """Put exported slots at ``start`` .. and make the cache end after them.

        Slots before ``start`` stay. The cache then holds what running those tokens after
        its first ``start`` left, when the export came from the same prefix (for ``start``
        0: from empty); the logits are those of no token until the next call. A foreign
        layout is a BackendError. Returns the new length.
        """
        if not 0 <= start <= self.length:
            raise BackendError(f'cannot import at slot {start} of a cache of {self.length}')
        try:
            n = self.kv.load(tensors, start)
        except (ValueError, KeyError, AttributeError) as exc:
            raise BackendError(f'the stored KV state does not fit this cache: {exc}') from None
        self.length = start + n
        self._logits = np.zeros(self.config.vocab_size, np.float32)
        self._mass = np.concatenate([self._mass[:start], np.zeros(n, np.float32)])
        self._rows = None
        return self.length

    def kv_bytes_per_token(self):
        """Cache bytes one token takes over every layer (keys, values, their scales)."""
        return self.kv.bytes_per_token()

    def logits(self):
        """Float32 logits [vocab] of the last token run."""
        return self._logits.copy()

    def argmax(self, allowed=None):
        """Greedy next token; ``allowed``: sorted int array of permitted ids, or None."""
        if allowed is None:
            return int(np.argmax(self._logits))
        return int(allowed[np.argmax(self._logits[allowed])])

    def attention_mass(self):
        """Float32 [length]: attention each cached token received in the last call."""
        return self._mass.copy()

    # -- cache maintenance ----------------------------------------------------------
    def rollback(self, length):
        """Forget every token at or after ``length``.

        Back into the rows of the last verify, the logits and mass become that row's.
        """
        self.length = rollback_length(length, self.length)
        self._mass = self._mass[:length]
        if self._rows is not None:
            start, logits, masses = self._rows
            if start < length <= start + len(logits):
                self._logits, self._mass = logits[length - start - 1], masses[length - start - 1]
                self._rows = (start, logits[:length - start], masses[:length - start])
            else:
                self._rows = None

    def compact(self, keep):
        """Move slots ``keep`` (ascending) to 0..m-1, re-rotating keys by (new - old) position."""
        keep = compact_slots(keep, self.length)
        m = len(keep)
        # slots before the first gap stay where they are: nothing to move or rotate
        gap = keep != np.arange(m)
        first = int(np.argmax(gap)) if gap.any() else m
        moved = keep[first:]
        delta = self.capacity + np.arange(first, m) - moved                 # new - old
        cos, sin = self.cos[delta], self.sin[delta]                         # [m - first, d/2]
        if len(moved):
            for i in range(self.config.num_layers):
                self.kv.move(i, first, m, moved, cos, sin)
        self.length = m
        self._mass = self._mass[keep]  # invariant: len(self._mass) == self.length
        self._rows = None
