"""A numpy interpreter of dataflow plans: each task on its own slice, in any order the lists allow.

The CPU twin of the dataflow decode step (Megakernels' python_vm idea): one function an op,
each computing only its task's slice from the state the tasks before it left. Run in the
order ``dataflow_plan.simulate`` draws, one step must give the logits of
``NumpyBackend.decode`` (the sums in another order: close, not equal) and the same results,
bit for bit, whatever the order.
"""

import numpy as np

from rt_llm_node.backends.dataflow_plan import ATTN_CHUNK_KEYS
from rt_llm_node.backends.numpy_backend import apply_rope
from rt_llm_node.backends.numpy_backend import rmsnorm
from rt_llm_node.backends.numpy_backend import silu


class DataflowVM:
    """The state of one decode step: x, q, the cache, attention partials, act, logits."""

    def __init__(self, backend, token):
        cfg = backend.config
        self.backend, self.cfg, self.token = backend, cfg, int(token)
        self.pos = backend.length                      # the new token's slot
        self.x = np.zeros(cfg.hidden_size, np.float32)
        self.q = np.zeros((cfg.num_heads, cfg.head_dim), np.float32)
        self.k = [backend.kv.k[i].copy() for i in range(cfg.num_layers)]   # [cap, kv, d]
        self.v = [backend.kv.v[i].copy() for i in range(cfg.num_layers)]
        self.partial = {}                              # (g, chunk) -> (max, sum, out)
        self.act = np.zeros(cfg.intermediate_size, np.float32)
        self.logits = np.zeros(cfg.vocab_size, np.float32)
        self.best = {}
        self.cos = backend.cos[backend.capacity + self.pos]
        self.sin = backend.sin[backend.capacity + self.pos]

    def run(self, task):
        getattr(self, '_' + task.op)(task)

    def _norm(self, weight):
        return rmsnorm(self.x[None], weight, self.cfg.rms_norm_eps)[0]

    def _embed(self, t):
        rows = slice(t.unit0, t.unit0 + t.units)
        self.x[rows] = self.backend.embed[self.token, rows]

    def _qkv(self, t):
        cfg, layer = self.cfg, self.backend.layers[t.layer]
        d, group_q = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        h = self._norm(layer.attn_norm)
        for u in range(t.unit0, t.unit0 + t.units):
            if u < group_q:
                head = t.arg * group_q + u
                start = head * d
            else:
                kind = u - group_q     # 0: key, 1: value
                start = cfg.q_size + kind * cfg.kv_size + t.arg * d
            row = layer.wqkv[start:start + d] @ h
            if layer.bqkv is not None:
                row = row + layer.bqkv[start:start + d]
            if u < group_q:
                self.q[head] = apply_rope(row[None, None], self.cos[None], self.sin[None])[0, 0]
            elif u == group_q:
                self.k[t.layer][self.pos, t.arg] = apply_rope(row[None, None], self.cos[None],
                                                              self.sin[None])[0, 0]
            else:
                self.v[t.layer][self.pos, t.arg] = row

    def _attn(self, t):
        cfg = self.cfg
        group_q = cfg.num_heads // cfg.num_kv_heads
        lo = t.unit0 * ATTN_CHUNK_KEYS
        hi = min(lo + ATTN_CHUNK_KEYS, self.pos + 1)
        heads = self.q[t.arg * group_q:(t.arg + 1) * group_q]          # [group, d]
        if hi <= lo:   # past the step's length: an empty partial
            self.partial[t.arg, t.unit0] = (np.full(group_q, -np.inf, np.float32),
                                            np.zeros(group_q, np.float32),
                                            np.zeros((group_q, cfg.head_dim), np.float32))
            return
        keys, values = self.k[t.layer][lo:hi, t.arg], self.v[t.layer][lo:hi, t.arg]
        scores = (heads * np.float32(1.0 / np.sqrt(cfg.head_dim))) @ keys.T   # [group, keys]
        top = scores.max(axis=1)
        p = np.exp(scores - top[:, None])
        self.partial[t.arg, t.unit0] = (top, p.sum(axis=1), p @ values)

    def _o(self, t):
        cfg, layer = self.cfg, self.backend.layers[t.layer]
        group_q = cfg.num_heads // cfg.num_kv_heads
        chunks = sorted({c for _, c in self.partial})
        out = np.zeros((cfg.num_heads, cfg.head_dim), np.float32)
        for g in range(cfg.num_kv_heads):
            parts = [self.partial[g, c] for c in chunks]
            top = np.max([m for m, _, _ in parts], axis=0)                # [group]
            total = np.zeros(group_q, np.float32)
            acc = np.zeros((group_q, cfg.head_dim), np.float32)
            for m, s, o in parts:
                w = np.where(np.isfinite(m), np.exp(m - top), 0).astype(np.float32)
                total += w * s
                acc += w[:, None] * o
            out[g * group_q:(g + 1) * group_q] = acc / total[:, None]
        rows = slice(t.unit0, t.unit0 + t.units)
        self.x[rows] += layer.wo[rows] @ out.reshape(-1)

    def _gate_up(self, t):
        cfg, layer = self.cfg, self.backend.layers[t.layer]
        h = self._norm(layer.mlp_norm)
        rows = slice(t.unit0, t.unit0 + t.units)
        inter = cfg.intermediate_size
        gate = layer.wgate_up[rows] @ h
        up = layer.wgate_up[inter + t.unit0:inter + t.unit0 + t.units] @ h
        self.act[rows] = silu(gate) * up

    def _down(self, t):
        layer = self.backend.layers[t.layer]
        rows = slice(t.unit0, t.unit0 + t.units)
        self.x[rows] += layer.wdown[rows] @ self.act

    def _lm_head(self, t):
        h = self._norm(self.backend.final_norm)
        rows = slice(t.unit0, t.unit0 + t.units)
        self.logits[rows] = self.backend.lm_head[rows] @ h
        at = int(np.argmax(self.logits[rows]))
        self.best[t.arg] = (self.logits[rows][at], t.unit0 + at)

    def _argmax(self, t):
        best = max(self.best[i] for i in range(t.units))   # the value, then the lower index
        ties = [i for v, i in self.best.values() if v == best[0]]
        self.token = min(ties)
