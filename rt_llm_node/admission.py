"""Admission control: predict whether prefill plus decode finish before the tick's deadline.

A linear cost model is calibrated on the real backend at configure, over a grid
of prefill lengths, cache lengths and decode steps:

    prefill_ms(n, L) = a0 + a1 * n + a2 * n * L     (n new tokens over L cached)
    decode_ms(L)     = b0 + b1 * L                  (one token over L cached)
    compact_ms(m)    = c0 + c1 * m                  (m kept tokens re-rotated)
    verify_ms(k, L)  = v0 + v1 * k + v2 * k * L     (a verify pass of k tokens)
    fused_ms(n, k, L) = prefill_ms(n, L) + f0 + f1 * k + f2 * k * L
                                                    (a prefill with k drafts verified beside it)

Each grid point is timed several times and its upper quantile is what the model
fits, so predictions lean pessimistic. Online, the measured time of every tick that
ran (admitted, or aborted by the watchdog, or late) is compared with the model; the
prediction is scaled by a high quantile (``quantile``, 0.9 by default; 1: the worst) of
the measured/model ratios in a recent window, never below a floor (the window counts
ticks, refused ones too, so old ratios expire). Not the worst: on a shared or busy host a
tick now and then stalls for tens of milliseconds (the process descheduled), and the
worst ratio made every tick of the next window refused, 2 s of refusals for one stall
(20 s of `make demo` on a 2-core host: 164-292 of 600 ticks refused; docs/history.md). A
slower host raises the quantile within a tenth of a window; a tick admitted meanwhile
that would overrun is caught by the watchdog, refused and never published late. A safety
margin in milliseconds is added on top.

The floor starts at 1: the calibrated model is trusted until a tick shows otherwise.
A model calibrated while the host was slow (another process, a thermal throttle)
would otherwise refuse every tick for good, since refused ticks measure nothing.
So after ``probe_ticks`` deadline refusals in a row, one tick is admitted as a probe
if it would fit were the model ``1 / min_scale`` times too pessimistic; what it
measures lowers the floor (to no less than ``min_scale``). A probe runs under the
same watchdog and the same never-late rule as any tick: one that overruns is an
``overrun_abort`` refusal, and the next probe waits twice as long (up to 64x).
"""

from collections import defaultdict
from collections import deque
from dataclasses import dataclass
import json
import math
import time
from typing import Optional

import numpy as np

from rt_llm_node.backends import verify_limit


@dataclass
class CostModel:
    """Coefficients of the linear cost terms (milliseconds).

    ``verify`` (a speculative verify pass) may be None: the backend has none, or the model
    was written before it; a pass is then priced as the decode steps it stands for.
    ``fused`` (what verifying drafts beside a prefill adds to it, ``prefill_verify``) may be
    None too: the drafts are then priced as a verify pass after the prefill.
    """

    prefill: tuple = (0.0, 0.0, 0.0)   # a0, a1 (per token), a2 (per token x cached token)
    decode: tuple = (0.0, 0.0)         # b0, b1 (per cached token)
    compact: tuple = (0.0, 0.0)        # c0, c1 (per kept token)
    verify: Optional[tuple] = None     # v0, v1 (per token), v2 (per token x cached token)
    fused: Optional[tuple] = None      # f0, f1 (per draft), f2 (per draft x cached token)

    def to_json(self):
        """Return the coefficients as JSON text (what rt-llm-replay --cost-model reads)."""
        data = {'prefill': list(self.prefill), 'decode': list(self.decode),
                'compact': list(self.compact)}
        for name in ('verify', 'fused'):
            if getattr(self, name) is not None:
                data[name] = list(getattr(self, name))
        return json.dumps(data, indent=2) + '\n'

    @classmethod
    def from_json(cls, text):
        """Return the CostModel that ``to_json`` wrote; ValueError naming what is wrong."""
        try:
            data = json.loads(text)
            model = cls(prefill=tuple(float(v) for v in data['prefill']),
                        decode=tuple(float(v) for v in data['decode']),
                        compact=tuple(float(v) for v in data['compact']),
                        verify=(None if data.get('verify') is None
                                else tuple(float(v) for v in data['verify'])),
                        fused=(None if data.get('fused') is None
                               else tuple(float(v) for v in data['fused'])))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f'not a cost model ({type(exc).__name__}: {exc})') from None
        verify, fused = model.verify or (0.0, 0.0, 0.0), model.fused or (0.0, 0.0, 0.0)
        if (len(model.prefill), len(model.decode), len(model.compact), len(verify),
                len(fused)) != (3, 2, 2, 3, 3) or not all(
                    math.isfinite(v) for v in model.prefill + model.decode + model.compact
                    + verify + fused):
            raise ValueError('not a cost model (prefill, verify and fused need 3 finite '
                             'coefficients, decode and compact 2)')
        return model

    def prefill_ms(self, n, cache_length):
        if n <= 0:
            return 0.0
        a0, a1, a2 = self.prefill
        return a0 + a1 * n + a2 * n * cache_length

    def decode_ms(self, cache_length):
        b0, b1 = self.decode
        return b0 + b1 * cache_length

    def compact_ms(self, kept):
        c0, c1 = self.compact
        return c0 + c1 * kept

    def verify_ms(self, n, cache_length):
        """Raw predicted time of a verify pass of ``n`` tokens over ``cache_length`` cached.

        The calibrated term, or without one the ``n`` decode steps the pass stands for.
        """
        if self.verify is None:
            return sum(self.decode_ms(cache_length + i) for i in range(n))
        v0, v1, v2 = self.verify
        return v0 + v1 * n + v2 * n * cache_length

    def fused_ms(self, n, k, cache_length):
        """Raw predicted time of a prefill of ``n`` tokens with ``k`` drafts verified beside it.

        The calibrated term on top of the prefill, or without one a verify pass after it.
        """
        if self.fused is None:
            return self.prefill_ms(n, cache_length) + self.verify_ms(k, cache_length + n)
        f0, f1, f2 = self.fused
        return self.prefill_ms(n, cache_length) + f0 + f1 * k + f2 * k * cache_length

    def tick_ms(self, n_prefill, cache_length, n_decode, kept=None, restored=0,
                pass_tokens=0, fused_tokens=0):
        """Raw predicted time of a whole tick (compaction if ``kept`` is given).

        ``restored``: tokens whose stored state is copied into the cache (an instruction
        switched back to), priced as a compaction that moves as many slots.
        ``pass_tokens``: with speculative decoding, the ``n_decode`` forward passes after the
        prefill are each priced as the dearer of a decode step and a verify pass of this many
        tokens (0: decode steps). ``fused_tokens``: drafts verified beside the prefill.
        """
        total = self.compact_ms(restored) if restored else 0.0
        if kept is not None:
            total += self.compact_ms(kept)
            cache_length = kept
        total += (self.fused_ms(n_prefill, fused_tokens, cache_length) if fused_tokens
                  else self.prefill_ms(n_prefill, cache_length))
        for step in range(n_decode):
            length = cache_length + n_prefill + step
            total += (max(self.decode_ms(length), self.verify_ms(pass_tokens, length))
                      if pass_tokens else self.decode_ms(length))
        return total


def _fit(features, targets):
    """Non-negative least squares by clipping (tiny systems; enough for cost terms)."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(targets, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    # refit the free terms with the clipped ones fixed, so the fit is not biased low
    for i in np.flatnonzero(coef == 0.0):
        x[:, i] = 0.0
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return tuple(float(c) for c in np.maximum(coef, 0.0))


def calibrate(backend, vocab_size, quantile=0.9, repeats=5, prefill_lengths=(1, 8, 24, 48),
              cache_fractions=(0.0, 0.5, 0.9), log=None, clock=time.perf_counter, rounds=3,
              verify_sizes=(2, 5, 9)):
    """Time ``backend`` over a grid and fit a CostModel to the upper ``quantile``.

    The whole grid is timed ``rounds`` times over, ``repeats`` samples a point a round;
    a point's figure is the median over the rounds of each round's ``quantile``. So a
    stall of the host (another process, a page fault storm) inflates one round's figures,
    not the fit: with one pass, a 0.3 s stall during one point's samples set the decode
    intercept to 5 ms instead of 1.8 and the node refused every tick of its run (no tick
    ran, so the admission scale, which learns from admitted ticks, could not correct it).
    A backend with speculative verify passes is timed on passes of ``verify_sizes`` tokens
    too, and (``prefill_verify``) on as many drafts verified beside the longest prefill, the
    prefill alone subtracted. Leaves the backend's cache empty. ``log(text)`` receives
    progress lines.
    """
    if rounds < 1 or repeats < 1:
        raise ValueError('calibration needs at least one round and one repeat')
    rng = np.random.default_rng(0)
    capacity = backend.capacity
    prefill_lengths = [n for n in prefill_lengths if n < capacity]
    max_prefill = max(prefill_lengths)
    lengths = [max(0, min(int(f * capacity), capacity - max_prefill - 1))
               for f in cache_fractions]
    prefill_ids = {n: rng.integers(0, vocab_size, n) for n in prefill_lengths}
    fills = {length: rng.integers(0, vocab_size, length) for length in lengths}
    figures = defaultdict(list)   # (what, its cost-model features) -> one figure a round

    def upper(samples):
        return float(np.quantile(samples, quantile))

    def fill(length):
        backend.rollback(0)
        if length:
            backend.prefill(fills[length])

    def timed(run, before):
        samples = []
        for _ in range(repeats):
            before()
            start = clock()
            run()
            samples.append((clock() - start) * 1e3)
        return upper(samples)

    for _ in range(rounds):
        for length in lengths:
            fill(length)
            for n in prefill_lengths:
                figures['prefill', (1.0, n, n * length)].append(timed(
                    lambda: backend.prefill(prefill_ids[n]), lambda: backend.rollback(length)))
            figures['decode', (1.0, length)].append(timed(
                lambda: backend.decode(1), lambda: backend.rollback(length)))
            sizes = [n for n in verify_sizes if n <= verify_limit(backend)]
            for n in [n for n in sizes if n <= max_prefill and length + n < capacity]:
                figures['verify', (1.0, n, n * length)].append(timed(
                    lambda: backend.verify(prefill_ids[max_prefill][:n], [None] * n),
                    lambda: backend.rollback(length)))
            alone = figures['prefill', (1.0, max_prefill, max_prefill * length)][-1]
            fusable = sizes if hasattr(backend, 'prefill_verify') else []
            for n in [n for n in fusable if length + max_prefill + n < capacity]:
                # what the drafts add to the prefill they run beside
                figures['fused', (1.0, n, n * length)].append(max(0.0, timed(
                    lambda: backend.prefill_verify(prefill_ids[max_prefill],
                                                   prefill_ids[max_prefill][:n],
                                                   [None] * (n + 1)),
                    lambda: backend.rollback(length)) - alone))
            if length > 1:
                keep = np.arange(0, length, 2)
                figures['compact', (1.0, len(keep))].append(timed(
                    lambda: backend.compact(keep), lambda: fill(length)))
    backend.rollback(0)
    median = {key: float(np.median(values)) for key, values in figures.items()}
    if log:
        for length in lengths:
            log(f'calibrated at cache length {length}: decode '
                f'{median["decode", (1.0, length)]:.2f} ms, prefill of {max_prefill} tokens '
                f'{median["prefill", (1.0, max_prefill, max_prefill * length)]:.2f} ms '
                f'(median of {rounds} rounds)')

    def fit(what):
        points = [(list(x), y) for (kind, x), y in median.items() if kind == what]
        return _fit([x for x, _ in points], [y for _, y in points]) if points else None
    return CostModel(prefill=fit('prefill'), decode=fit('decode'),
                     compact=fit('compact') or (0.0, 0.0), verify=fit('verify'),
                     fused=fit('fused'))


CHECK_TOLERANCE = 1.5   # a stored cost model is kept while every checked point is within 1.5x


def check_cost_model(backend, model, vocab_size, repeats=5, tolerance=CHECK_TOLERANCE,
                     clock=time.perf_counter):
    """Check a stored cost model against this device: (ok, one line saying what was found).

    Times a few points of the calibration grid (a decode step and a 24-token prefill over an
    empty and a half-full cache, one round) and compares each with the model's prediction:
    ok when every measured / predicted ratio lies within [1 / tolerance, tolerance].
    """
    quick = calibrate(backend, vocab_size, repeats=repeats, prefill_lengths=(24,),
                      cache_fractions=(0.0, 0.5), rounds=1, verify_sizes=(), clock=clock)
    capacity = backend.capacity
    lengths = sorted({max(0, min(int(f * capacity), capacity - 25)) for f in (0.0, 0.5)})
    ratios = []
    for length in lengths:
        for measured, predicted in ((quick.decode_ms(length), model.decode_ms(length)),
                                    (quick.prefill_ms(24, length), model.prefill_ms(24, length))):
            ratios.append(measured / predicted if predicted > 0 else float('inf'))
    ok = all(1 / tolerance <= r <= tolerance for r in ratios)
    return ok, (f'measured / predicted {", ".join(f"{r:.2f}" for r in ratios)} at '
                f'{len(ratios)} points (kept within {1 / tolerance:.2f}..{tolerance:.2f})')


class Admission:
    """Decides admit/refuse from the cost model, a learned worst-case scale and a margin."""

    MAX_BACKOFF = 64

    def __init__(self, model, margin_ms=2.0, window=60, probe_ticks=0, min_scale=0.25,
                 quantile=0.9):
        if margin_ms < 0:
            raise ValueError('margin_ms must be non-negative')
        if not 0.5 <= quantile <= 1.0:
            raise ValueError('quantile must be in [0.5, 1] (1: the worst ratio of the window)')
        if probe_ticks < 0:
            raise ValueError('probe_ticks must be non-negative (0: no probes)')
        if not 0.0 < min_scale <= 1.0:
            raise ValueError('min_scale must be in (0, 1]')
        self.model = model
        self.margin_ms = float(margin_ms)
        self.window = int(window)
        self.probe_ticks = int(probe_ticks)
        self.min_scale = float(min_scale)
        self.quantile = float(quantile)
        self.floor = 1.0               # lowered only by what probe ticks measure
        self.ticks_seen = 0
        self.ratios = deque()          # (tick, measured / model) of admitted ticks
        self.scale = 1.0               # max(floor, quantile of ratios): kept current
        self.refused_in_a_row = 0      # deadline refusals since the last admitted tick
        self.backoff = 1               # the next probe waits probe_ticks * backoff refusals

    def _rescale(self):
        """Recompute the scale from the window's ratios.

        The ``quantile`` of the last ``window`` ticks' measured/model ratios (the nearest ratio at
        or above it: with few ratios, the worst), at least the floor.
        """
        if not self.ratios:
            self.scale = self.floor
            return
        ratios = sorted(r for _, r in self.ratios)
        at = min(len(ratios) - 1, int(np.ceil(self.quantile * (len(ratios) - 1))))
        self.scale = max(self.floor, ratios[at])

    def new_tick(self):
        """Advance the window by one tick, admitted or not, so old spikes expire."""
        self.ticks_seen += 1
        if self.ratios and self.ratios[0][0] <= self.ticks_seen - self.window:
            while self.ratios and self.ratios[0][0] <= self.ticks_seen - self.window:
                self.ratios.popleft()
            self._rescale()

    def predict_ms(self, n_prefill, cache_length, n_decode, kept=None, restored=0,
                   pass_tokens=0, fused_tokens=0):
        """Pessimistic prediction of a tick's model time, margin included."""
        raw = self.model.tick_ms(n_prefill, cache_length, n_decode, kept, restored, pass_tokens,
                                 fused_tokens)
        return raw * self.scale + self.margin_ms

    def fused_ms(self, n, k, cache_length, scale=None):
        """Pessimistic prediction of a prefill with ``k`` drafts beside it (for the watchdog)."""
        return self.model.fused_ms(n, k, cache_length) * (self.scale if scale is None else scale)

    def verify_ms(self, n, cache_length, scale=None):
        """Pessimistic prediction of a verify pass of ``n`` tokens (for the watchdog)."""
        return self.model.verify_ms(n, cache_length) * (self.scale if scale is None else scale)

    def step_ms(self, cache_length, scale=None):
        """Pessimistic prediction of one decode step (for the watchdog), margin excluded.

        ``scale``: instead of the learned one (``probe_scale`` in a probe tick).
        """
        return self.model.decode_ms(cache_length) * (self.scale if scale is None else scale)

    def admit(self, predicted_ms, available_ms):
        return predicted_ms <= available_ms

    def probe_instead(self, n_prefill, cache_length, n_decode, kept, available_ms, restored=0,
                      pass_tokens=0, fused_tokens=0):
        """Whether a tick ``admit`` refused should run as a probe instead.

        True after enough deadline refusals in a row, if it would fit were the model
        1 / min_scale times too pessimistic; else it counts as one more deadline refusal.
        """
        if self.probe_ticks and self.refused_in_a_row >= self.probe_ticks * self.backoff:
            raw = self.model.tick_ms(n_prefill, cache_length, n_decode, kept, restored,
                                     pass_tokens, fused_tokens)
            if raw * self.min_scale + self.margin_ms <= available_ms:
                return True
        self.refused_in_a_row += 1
        return False

    def probe_scale(self, n_prefill, cache_length, n_decode, kept, elapsed_ms, restored=0,
                    pass_tokens=0, fused_tokens=0):
        """Return the watchdog's scale in a probe tick.

        What the tick has measured so far against the model (the learned scale is what the probe
        doubts), min_scale at the least.
        """
        raw = self.model.tick_ms(n_prefill, cache_length, n_decode, kept, restored, pass_tokens,
                                 fused_tokens)
        return max(self.min_scale, elapsed_ms / raw if raw > 0 else 1.0)

    def observe(self, n_prefill, cache_length, n_decode, kept, measured_ms, probe=False,
                in_time=True, restored=0, pass_tokens=0, fused_tokens=0):
        """Learn from one admitted tick's measured model time.

        A ``probe`` that finished ``in_time`` lowers the floor to what it measured (min_scale at
        the least), one that did not doubles the wait for the next.
        """
        raw = self.model.tick_ms(n_prefill, cache_length, n_decode, kept, restored, pass_tokens,
                                 fused_tokens)
        ratio = measured_ms / raw if raw > 0 and np.isfinite(measured_ms) else None
        self.refused_in_a_row = 0
        if ratio is not None:
            self.ratios.append((self.ticks_seen, ratio))
            if probe and in_time:
                self.floor = min(1.0, max(self.min_scale, ratio))
            elif not in_time:   # late: a floor a probe lowered was too low
                self.floor = min(1.0, max(self.floor, ratio))
        if probe:
            self.backoff = 1 if in_time and ratio is not None else min(self.MAX_BACKOFF,
                                                                       2 * self.backoff)
        self._rescale()
