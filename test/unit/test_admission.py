"""Admission on its own: the cost model's arithmetic and file, the scale, probes, calibration.

The engine tests drive these through whole ticks; here each rule is checked with exact
figures.
"""

import json
import math

import pytest

from rt_llm_node.admission import Admission
from rt_llm_node.admission import calibrate
from rt_llm_node.admission import CostModel
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import load_checkpoint


def test_a_tick_costs_compaction_prefill_and_each_decode_step_at_its_length():
    model = CostModel(prefill=(1.0, 0.5, 0.01), decode=(2.0, 0.001), compact=(0.3, 0.002))
    assert model.prefill_ms(0, 100) == 0.0
    assert model.prefill_ms(10, 100) == pytest.approx(1.0 + 5.0 + 10.0)
    # no compaction: 10 tokens at 100 cached, then decode steps at 110 and 111
    assert model.tick_ms(10, 100, 2) == pytest.approx(16.0 + 2.11 + 2.111)
    # compaction to 50 kept slots first: the prefill and the steps see the shorter cache
    assert model.tick_ms(10, 100, 1, kept=50) == pytest.approx(
        0.3 + 0.1 + 1.0 + 5.0 + 5.0 + 2.06)


def test_a_cost_model_reads_back_what_it_wrote_and_refuses_anything_else():
    model = CostModel(prefill=(1.0, 0.5, 0.01), decode=(2.0, 0.001), compact=(0.3, 0.002))
    assert CostModel.from_json(model.to_json()) == model
    with_verify = CostModel(model.prefill, model.decode, model.compact, (0.2, 0.1, 0.0001))
    assert CostModel.from_json(with_verify.to_json()) == with_verify
    assert with_verify.verify_ms(5, 100) == pytest.approx(0.2 + 0.5 + 0.05)
    # a model without the verify term prices a pass as the decode steps it stands for
    assert model.verify is None
    assert model.verify_ms(3, 100) == pytest.approx(3 * 2.0 + 0.001 * (100 + 101 + 102))
    bad_verify = json.loads(with_verify.to_json())
    bad_verify['verify'] = [1, 2]
    with pytest.raises(ValueError, match='not a cost model'):
        CostModel.from_json(json.dumps(bad_verify))
    # drafts verified beside a prefill: the calibrated term on top of the prefill, or
    # without one a verify pass after it; a tick with them prices its prefill so
    fused = CostModel(model.prefill, model.decode, model.compact, with_verify.verify,
                      (0.4, 0.05, 0.001))
    assert CostModel.from_json(fused.to_json()) == fused
    assert fused.fused_ms(10, 6, 100) == pytest.approx(16.0 + 0.4 + 0.3 + 0.6)
    assert with_verify.fused_ms(10, 6, 100) == pytest.approx(
        16.0 + with_verify.verify_ms(6, 110))
    assert fused.tick_ms(10, 100, 2, pass_tokens=6, fused_tokens=6) == pytest.approx(
        fused.fused_ms(10, 6, 100) + fused.decode_ms(110) + fused.decode_ms(111))
    bad_fused = json.loads(fused.to_json())
    bad_fused['fused'] = [1, math.nan, 0]
    with pytest.raises(ValueError, match='not a cost model'):
        CostModel.from_json(json.dumps(bad_fused))
    for bad in ('not json', '[]', json.dumps({'prefill': [1, 2, 3], 'decode': [1]}),
                json.dumps({'prefill': [1, 2], 'decode': [1, 2], 'compact': [1, 2]}),
                json.dumps({'prefill': [1, 2, 'x'], 'decode': [1, 2], 'compact': [1, 2]}),
                json.dumps({'prefill': [1, 2, math.inf], 'decode': [1, 2], 'compact': [1, 2]})):
        with pytest.raises(ValueError, match='not a cost model'):
            CostModel.from_json(bad)


def test_admission_adds_the_margin_and_admits_only_what_fits():
    admission = Admission(CostModel(prefill=(10.0, 0.0, 0.0)), margin_ms=2.0)
    assert admission.predict_ms(1, 0, 0) == pytest.approx(12.0)
    assert admission.admit(12.0, 12.0) and not admission.admit(12.01, 12.0)
    for bad in ({'margin_ms': -1.0}, {'probe_ticks': -1}, {'min_scale': 0.0},
                {'min_scale': 1.5}):
        with pytest.raises(ValueError):
            Admission(CostModel(), **bad)


def test_one_stall_in_the_window_does_not_refuse_the_ticks_after_it():
    """The scale is a high quantile of the window's ratios, not the worst.

    One stall of the host (5x) leaves the next ticks admitted, where the worst refused them for a
    window; a host that stays slower moves the quantile within a tenth of the window.
    """
    model = CostModel(prefill=(10.0, 0.0, 0.0))   # a tick of one token: 10 ms
    worst = Admission(model, margin_ms=0.0, window=60, quantile=1.0)
    robust = Admission(model, margin_ms=0.0, window=60)
    for admission in (worst, robust):
        for i in range(40):
            admission.new_tick()
            admission.observe(1, 0, 0, None, 50.0 if i == 20 else 12.0)
    assert worst.scale == pytest.approx(5.0)
    assert robust.scale == pytest.approx(1.2)
    assert not worst.admit(worst.predict_ms(1, 0, 0), 30.0)
    assert robust.admit(robust.predict_ms(1, 0, 0), 30.0)
    for _ in range(4):   # now 2.5x slower for good
        robust.new_tick()
        robust.observe(1, 0, 0, None, 25.0)
    assert robust.scale == pytest.approx(2.5)
    for bad in (0.3, 1.5, float('nan')):
        with pytest.raises(ValueError):
            Admission(model, quantile=bad)


def test_old_ratios_leave_the_window():
    admission = Admission(CostModel(prefill=(10.0, 0.0, 0.0)), margin_ms=0.0, window=10)
    admission.new_tick()
    admission.observe(1, 0, 0, None, 40.0)     # one slow tick: 4x
    assert admission.scale == pytest.approx(4.0)
    for _ in range(9):
        admission.new_tick()
    assert admission.scale == pytest.approx(4.0)
    admission.new_tick()                         # ten ticks on: it has left the window
    assert admission.scale == pytest.approx(1.0)


def test_probes_come_after_enough_refusals_and_back_off_when_they_overrun():
    # 41 ms predicted against 33 available: refused; at min_scale 0.25 it would fit
    model = CostModel(prefill=(1.0, 0.0, 0.0), decode=(40.0, 0.0))
    admission = Admission(model, margin_ms=0.0, probe_ticks=3, min_scale=0.25)
    assert [admission.probe_instead(1, 0, 1, None, 33.0) for _ in range(4)] == \
        [False, False, False, True]
    admission.observe(1, 0, 1, None, 60.0, probe=True, in_time=False)
    assert admission.backoff == 2 and admission.floor == 1.0
    assert [admission.probe_instead(1, 0, 1, None, 33.0) for _ in range(7)] == \
        [False] * 6 + [True]
    admission.observe(1, 0, 1, None, 8.2, probe=True, in_time=True)   # 5x faster than said
    assert admission.floor == pytest.approx(0.25) and admission.backoff == 1
    # the late probe's ratio (60 / 41) still sets the scale until it leaves the window
    assert admission.scale == pytest.approx(60.0 / 41.0)
    fresh = Admission(model, margin_ms=0.0, probe_ticks=1, min_scale=0.25)
    assert [fresh.probe_instead(1, 0, 1, None, 33.0) for _ in range(2)] == [False, True]
    fresh.observe(1, 0, 1, None, 8.2, probe=True, in_time=True)
    assert fresh.scale == pytest.approx(0.25)      # max(floor 0.25, the probe's 0.2)
    assert fresh.admit(fresh.predict_ms(1, 0, 1), 33.0)
    # a probe never runs where even min_scale would not fit
    tight = Admission(model, margin_ms=0.0, probe_ticks=1, min_scale=0.25)
    assert [tight.probe_instead(1, 0, 1, None, 5.0) for _ in range(3)] == [False] * 3


def test_calibration_shrugs_off_a_host_stall(tmp_path):
    """A stall of the host during some calibration samples must not set the cost model.

    The grid is timed in rounds and each point takes the median over them. The clock is synthetic
    (every timed call takes 0.5 ms, and 0.3 s while the stall lasts) so that the figures are exact;
    the backend is the real numpy one.
    """
    from rt_llm_node.model.synthetic import write_random_checkpoint
    tiny = load_checkpoint(write_random_checkpoint(tmp_path, 'tiny'))
    backend = NumpyBackend(tiny, 256)

    def stalled_clock(first, last):
        calls = [0]

        def clock():
            calls[0] += 1
            k = calls[0]   # the end of a timed call is an even call
            stalled = sum(1 for i in range(2, k + 1, 2) if first <= i < last)
            return (k * 0.5 + 300.0 * stalled) / 1e3
        return clock

    clean = calibrate(backend, tiny.config.vocab_size, repeats=3, clock=stalled_clock(0, 0))
    assert clean.decode_ms(100) == pytest.approx(0.5, abs=1e-6)
    assert clean.prefill_ms(48, 100) == pytest.approx(0.5, abs=1e-6)
    assert clean.verify_ms(5, 100) == pytest.approx(0.5, abs=1e-6)   # numpy verifies
    # drafts beside the prefill: the fused pass less the prefill alone (here nothing)
    assert clean.fused == pytest.approx((0.0, 0.0, 0.0), abs=1e-6)
    assert clean.fused_ms(48, 5, 100) == pytest.approx(0.5, abs=1e-6)
    # a stall over the 8 samples of round one's second grid point and the ones after it
    stall = (8, 24)
    once = calibrate(backend, tiny.config.vocab_size, repeats=3, rounds=1,
                     clock=stalled_clock(*stall))
    assert once.prefill_ms(48, 100) > 50.0   # one pass: the stall is in the model
    robust = calibrate(backend, tiny.config.vocab_size, repeats=3, clock=stalled_clock(*stall))
    for n, length in ((1, 0), (48, 100), (24, 200)):
        assert robust.prefill_ms(n, length) == pytest.approx(0.5, abs=1e-6)
    assert robust.decode_ms(200) == pytest.approx(0.5, abs=1e-6)
    assert backend.length == 0
