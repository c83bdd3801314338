"""The state store: a warm restart restores exactly what a fresh prefill makes, or prefills.

Real configure runs of the shipped demo model (numpy backend, a fixed cost model so that no
test depends on timing), a real safetensors store on disk, real files flipped and changed.
"""

import json
from pathlib import Path
import shutil

import numpy as np
import pytest

from rt_llm_node.admission import calibrate
from rt_llm_node.admission import check_cost_model
from rt_llm_node.admission import CostModel
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.configure import configure_engine
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.engine import ModelClock
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.state_store import StateStore

from conftest import demo_values  # noqa: I100
from conftest import run_ticks

COST = CostModel(prefill=(0.5, 0.01, 0.0), decode=(0.3, 0.0), compact=(0.1, 0.0))


def configure(state_dir, **overrides):
    lines = []
    clock = ModelClock()
    engine = configure_engine(demo_values(backend='numpy', state_dir=str(state_dir),
                                          **overrides),
                              clock=clock, log=lines.append, cost_model=COST)
    return engine, clock, lines


def actions(engine, clock, ticks=60):
    world = DemoWorld(11, messages=MessageFactory(ros=False))
    out = []
    for result in run_ticks(engine, clock, world, ticks):
        out.append(None if result.action is None else result.action.token_ids)
        world.step(0.2, 0.0)
    return out


def restored(lines):
    return any('KV state restored' in line for line in lines)


def test_a_restored_prompt_is_the_fresh_prefill_bit_for_bit(tmp_path):
    fresh, fresh_clock, lines = configure(tmp_path / 'state')
    assert not restored(lines) and any('the store holds none' in line for line in lines)
    warm, warm_clock, lines = configure(tmp_path / 'state')
    assert restored(lines), lines
    n = len(fresh.system_ids)
    for a, b in ((fresh.backend.kv.k, warm.backend.kv.k), (fresh.backend.kv.v, warm.backend.kv.v)):
        assert np.array_equal(a[:, :n], b[:, :n])
    cache_a, cache_b = fresh.session.cache, warm.session.cache
    assert np.array_equal(cache_a.mass[:n], cache_b.mass[:n])
    assert np.array_equal(cache_a.token_ids[:n], cache_b.token_ids[:n])
    assert actions(fresh, fresh_clock) == actions(warm, warm_clock)
    assert np.array_equal(fresh.backend.logits(), warm.backend.logits())


@pytest.mark.parametrize('kv_dtype', ['native', 'int8'])
def test_slots_imported_after_a_prefix_continue_as_prefilled(tiny_checkpoint, kv_dtype):
    """The backend's import_kv at an offset: the instruction cache's path, bit for bit."""
    from rt_llm_node.backends import BackendError
    checkpoint = load_checkpoint(tiny_checkpoint)
    prompt = np.random.default_rng(3).integers(0, checkpoint.config.vocab_size, 60)
    source = NumpyBackend(checkpoint, 100, kv_dtype)
    source.prefill(prompt[:20])      # as the engine runs a prompt, then an instruction
    source.prefill(prompt[20:40])
    tail = source.export_kv(20, 40)
    source.prefill(prompt[40:])
    target = NumpyBackend(checkpoint, 100, kv_dtype)
    target.prefill(prompt[:20])
    assert target.import_kv(tail, 20) == 40
    target.prefill(prompt[40:])
    assert np.array_equal(target.logits(), source.logits())
    assert np.array_equal(target.attention_mass(), source.attention_mass())
    with pytest.raises(BackendError, match='cannot import at slot 61'):
        target.import_kv(tail, 61)
    with pytest.raises(BackendError, match='does not fit'):
        target.import_kv(source.export_kv(0, 60), 60)
    with pytest.raises(BackendError, match='cannot export'):
        source.export_kv(50, 70)


def test_a_restored_int8_cache_is_the_fresh_prefill_too(tmp_path):
    fresh, fresh_clock, _ = configure(tmp_path / 's', kv_dtype='int8')
    warm, warm_clock, lines = configure(tmp_path / 's', kv_dtype='int8')
    assert restored(lines)
    assert actions(fresh, fresh_clock, 30) == actions(warm, warm_clock, 30)
    assert np.array_equal(fresh.backend.logits(), warm.backend.logits())


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize('where', ['data', 'header'])
def test_a_flipped_byte_of_the_store_is_refused_and_prefilled(tmp_path, where):
    configure(tmp_path / 'state')
    entry = next((tmp_path / 'state').glob('prefix-*.safetensors'))
    size = entry.stat().st_size
    flip(entry, size - 7 if where == 'data' else 12)
    engine, clock, lines = configure(tmp_path / 'state')
    assert not restored(lines)
    said = [line for line in lines if 'not used' in line or 'unreadable' in line]
    assert said, lines
    assert ('checksum' in said[0]) if where == 'data' else True
    assert actions(engine, clock, 10)   # a fresh prefill, and the node works


def test_another_prompt_model_or_format_is_refused_with_the_reason(tmp_path):
    state = tmp_path / 'state'
    configure(state)
    _, _, lines = configure(state, system_prompt='go to the object in the task!')
    assert not restored(lines)
    assert any('token ids differ at position' in line for line in lines), lines
    _, _, lines = configure(state, weight_format='int8')
    assert any('weight_format differs' in line for line in lines), lines
    _, _, lines = configure(state, kv_dtype='int8')
    assert any('kv_dtype differs' in line for line in lines), lines
    # the same model with one byte of its weights changed
    model = tmp_path / 'model'
    shutil.copytree(default_model_path(), model)
    configure(state, model_path=str(model))
    weights = model / 'model.safetensors'
    flip(weights, weights.stat().st_size - 3)
    _, _, lines = configure(state, model_path=str(model))
    assert not restored(lines)
    assert any('model differs' in line for line in lines), lines


def test_the_store_stays_within_its_bound(tmp_path):
    store = StateStore(tmp_path / 'state', max_bytes=64 << 10, log=lambda _: None)
    rng = np.random.default_rng(0)
    fields = {'model': 'x', 'weight_format': 'native', 'kv_dtype': 'native', 'build': 'b'}
    for i in range(200):
        ids = rng.integers(0, 1000, 20)
        store.save_prefix(fields, ids, {'k': rng.standard_normal((2, 20, 2, 16), np.float32)},
                          np.zeros(20, np.float32))
        assert store.size_bytes() <= 64 << 10
    assert store.load_prefix(fields, ids) is not None   # the newest stays
    assert not list((tmp_path / 'state').glob('.tmp-*'))


def test_a_stored_cost_model_is_kept_only_while_the_device_agrees(tmp_path):
    """The check times four points; a synthetic clock makes every timed call 0.5 ms."""
    tiny = load_checkpoint(default_model_path())
    backend = NumpyBackend(tiny, 256)

    def clock():
        clock.calls += 1
        return clock.calls * 0.25e-3   # start and end of a call: 0.5 ms apart
    clock.calls = 0
    model = calibrate(backend, tiny.config.vocab_size, repeats=3, clock=clock)
    ok, detail = check_cost_model(backend, model, tiny.config.vocab_size, repeats=3,
                                  clock=clock)
    assert ok, detail
    slow = CostModel(prefill=tuple(3 * v for v in model.prefill),
                     decode=tuple(3 * v for v in model.decode), compact=model.compact)
    ok, detail = check_cost_model(backend, slow, tiny.config.vocab_size, repeats=3,
                                  clock=clock)
    assert not ok and 'measured / predicted 0.33' in detail
    store = StateStore(tmp_path, 1 << 20, log=lambda _: None)
    fields = {'model': 'm', 'host': 'h'}
    store.save_cost_model(fields, model)
    assert store.load_cost_model(fields) == model
    assert store.load_cost_model({'model': 'm', 'host': 'another'}) is None
    path = next(Path(tmp_path).glob('cost-*.json'))
    data = json.loads(path.read_text())
    data['fields']['host'] = 'forged'
    path.write_text(json.dumps(data))
    assert store.load_cost_model(fields) is None


def test_a_cost_model_is_kept_for_the_calls_it_priced(tmp_path):
    """Another longest verify pass or decode step makes a stored cost model not apply."""
    from rt_llm_node.configure import _cost_fields
    backend = NumpyBackend(load_checkpoint(default_model_path()), 256)
    values = demo_values(backend='numpy')
    store = StateStore(tmp_path, 1 << 20, log=lambda _: None)
    store.save_cost_model(_cost_fields({'model': 'm'}, backend, values), COST)
    assert store.load_cost_model(_cost_fields({'model': 'm'}, backend, values)) == COST
    backend.verify_tokens = 6   # as the CUDA backend built for speculative_tokens 5
    assert store.load_cost_model(_cost_fields({'model': 'm'}, backend, values)) is None
