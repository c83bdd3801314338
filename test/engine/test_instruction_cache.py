"""The instruction cache: an instruction seen before is restored by copy, exactly.

A new instruction goes right after the system prompt; one seen before is restored as
prefilling it again would leave the cache.

Real configure runs of the shipped demo model (numpy backend, a fixed cost model so that no
test depends on timing), the demo world's messages, a real state store on disk.
"""

import copy

import numpy as np
import pytest

from rt_llm_node.admission import CostModel
from rt_llm_node.configure import configure_engine
from rt_llm_node.demo.messages import MessageFactory
from rt_llm_node.demo.world import DemoWorld
from rt_llm_node.engine import ModelClock
from rt_llm_node.instruction_cache import InstructionCache
from rt_llm_node.kvcache import INSTRUCTION
from rt_llm_node.kvcache import SYSTEM

from conftest import demo_values  # noqa: I100

COST = CostModel(prefill=(0.5, 0.01, 0.0), decode=(0.3, 0.0), compact=(0.1, 0.0))
A, B = 'go to the red box', 'go to the blue ball'


def configure(**overrides):
    lines = []
    clock = ModelClock()
    engine = configure_engine(demo_values(backend='numpy', **overrides), clock=clock,
                              log=lines.append, cost_model=COST)
    return engine, clock, lines


def ticks(engine, clock, texts, per_text=4, seed=5):
    """Tick the demo world, the instruction switched to each of ``texts`` in turn."""
    world = DemoWorld(seed, messages=MessageFactory(ros=False))
    snapshot, results, i = {}, [], 0
    for text in texts:
        for k in range(per_text):
            now = i / 30
            clock.advance_to(now)
            msgs = world.observe()
            snapshot.update({t: (m, now) for t, m in msgs.items() if t != '/instruction'})
            if k == 0:
                msg = copy.copy(msgs.get('/instruction') or snapshot['/instruction'][0])
                msg.data = text
                snapshot['/instruction'] = (msg, now)
            results.append(engine.tick(snapshot, now, now + 1 / 30))
            world.step(0.0, 0.0)
            i += 1
    return results


def kinds(engine):
    cache = engine.session.cache
    return [cache.segments[uid].kind for uid in dict.fromkeys(
        cache.owner[:cache.length].tolist())]


def test_a_switch_back_restores_the_instruction_by_copy_exactly():
    """A, B, A: the second A is a copy, and the tick after it is what a fresh A gives."""
    engine, clock, _ = configure()
    results = ticks(engine, clock, [A, B, A])
    placed = [r.record.instruction for r in results if r.record.instruction]
    assert placed == ['prefilled', 'prefilled', 'restored']
    # under the model clock a copy costs what admission priced: less than the prefill
    cost = {r.record.instruction: r.record.instruction_ms for r in results}
    assert 0 < cost['restored'] < cost['prefilled']
    assert all(r.action is not None for r in results), [r.refusal for r in results]
    # the cache starts over at each switch: the system prompt, the instruction, then inputs
    assert kinds(engine)[:2] == [SYSTEM, INSTRUCTION]
    # the same world and ticks with only A seen: the last four ticks are identical, bit for bit
    fresh, fresh_clock, _ = configure()
    fresh_results = ticks(fresh, fresh_clock, [B, B, A])
    assert [r.record.instruction for r in fresh_results if r.record.instruction] == [
        'prefilled', 'prefilled']   # B twice is no switch; A is new here
    for ours, theirs in zip(results[-4:], fresh_results[-4:]):
        assert ours.action.token_ids == theirs.action.token_ids
    n = engine.session.length
    assert n == fresh.session.length
    assert np.array_equal(engine.backend.kv.k[:, :n], fresh.backend.kv.k[:, :n])
    assert np.array_equal(engine.backend.logits(), fresh.backend.logits())
    # eviction scores after the system prompt too (the prompt's own add up its history)
    m = len(engine.system_ids)
    assert np.array_equal(engine.session.cache.mass[m:n], fresh.session.cache.mass[m:n])


def test_without_the_cache_instructions_are_appended_as_before():
    engine, clock, _ = configure(instruction_cache_entries=0)
    results = ticks(engine, clock, [A, B, A])
    assert engine.instructions is None
    assert not any(r.record.instruction for r in results)
    assert all(r.action is not None for r in results)


def test_the_current_instruction_is_stored_and_restored_after_a_restart(tmp_path):
    engine, clock, _ = configure(state_dir=str(tmp_path / 'state'))
    ticks(engine, clock, [A], per_text=2)
    engine.save_state(*engine.state)
    warm, warm_clock, lines = configure(state_dir=str(tmp_path / 'state'))
    results = ticks(warm, warm_clock, [A], per_text=2)
    assert results[0].record.instruction == 'restored'
    assert any('instruction: ' in line and 'restored from the state store' in line
               for line in lines), lines
    other, other_clock, _ = configure(state_dir=str(tmp_path / 'state'))
    assert ticks(other, other_clock, [B], per_text=1)[0].record.instruction == 'prefilled'


def test_a_long_instruction_is_cut_to_its_token_limit_and_placed():
    engine, clock, _ = configure(kv_capacity_tokens=160)
    long_text = ' '.join(['go to the red box'] * 40)
    results = ticks(engine, clock, [A, long_text, A], per_text=2)
    assert all(r.action is not None for r in results), [r.refusal for r in results]
    assert [r.record.instruction for r in results if r.record.instruction] == [
        'prefilled', 'prefilled', 'restored']
    limit = next(spec.max_tokens for spec in engine.inputs if spec.kind == INSTRUCTION)
    assert results[2].record.n_prefill + len(engine.system_ids) < 160
    assert max(len(key) for key in engine.instructions.entries) <= limit


def test_the_cache_keeps_its_bounds_least_recently_used_first():
    cache = InstructionCache(max_entries=3, max_bytes=1000)
    entry = ({'k': np.zeros(50, np.float32)}, np.zeros(25, np.float32))   # 300 bytes
    for ids in ([1], [2], [3]):
        assert cache.put(ids, *entry)
    assert cache.get([1]) is not None      # 1 is now the most recent
    cache.put([4], *entry)                 # 4 entries of 300 bytes: over both bounds
    assert sorted(cache.entries) == [(1,), (3,), (4,)] and cache.nbytes == 900
    assert not cache.put([5], {'k': np.zeros(300, np.float32)}, np.zeros(1, np.float32))
    assert len(cache) == 3 and cache.nbytes <= 1000
    with pytest.raises(ValueError):
        InstructionCache(max_entries=0)


def test_a_flood_of_instructions_places_each_in_one_prefill_with_the_inputs():
    """A new instruction every tick: one prefill call a tick, the latest instruction in place.

    The first is placed in a call of its own (and kept for a switch back); those that follow
    it tick after tick are prefilled with the inputs in one call, as admission prices a
    placement, and are not kept; once the flood stops the last one stays in place.
    """
    engine, clock, _ = configure()
    calls = []
    prefill = engine.backend.prefill

    def counting(ids):   # counts what reaches the backend (no stand-in: it runs)
        calls.append(len(ids))
        return prefill(ids)
    engine.backend.prefill = counting
    texts = [f'go to the red box {i}' for i in range(6)]
    results = ticks(engine, clock, texts + [texts[-1]], per_text=1)
    assert all(r.action is not None for r in results), [r.refusal for r in results]
    assert [r.record.instruction for r in results] == ['prefilled'] * 6 + ['']
    # the first alone, then the inputs; then one call a tick, the last no placement
    assert len(calls) == 2 + 5 + 1, calls
    assert texts[-1] in engine.tokenizer.decode(engine.instruction_ids)
    assert kinds(engine)[:2] == [SYSTEM, INSTRUCTION]
    assert len(engine.instructions.entries) == 1, 'only the first, placed alone, is kept'
