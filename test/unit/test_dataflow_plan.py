"""The dataflow decode step's plans, checked on the CPU (no GPU, no CuPy).

For the benchmark shapes at a robot's SM counts (Orin Nano 8, AGX Orin 16) and an H100/H200's
132, under every assignment: the counts balance, every task waits for all it reads or
overwrites, the per-SM lists run to the end in any interleaving the device could choose, and
the packed words say what the tasks say. Broken plans are named: a missing wait, a wrong
count, lists that stall.
"""

import numpy as np
import pytest

from rt_llm_node.backends import dataflow_plan as plan_module
from rt_llm_node.backends.dataflow_plan import assign
from rt_llm_node.backends.dataflow_plan import build
from rt_llm_node.backends.dataflow_plan import check
from rt_llm_node.backends.dataflow_plan import dump
from rt_llm_node.backends.dataflow_plan import pack
from rt_llm_node.backends.dataflow_plan import PlanError
from rt_llm_node.backends.dataflow_plan import simulate
from rt_llm_node.backends.dataflow_plan import split
from rt_llm_node.backends.dataflow_plan import Task
from rt_llm_node.backends.dataflow_plan import TASK_FIELDS
from rt_llm_node.backends.dataflow_plan import TASK_OPS
from rt_llm_node.model.synthetic import shape_config

SHAPES = ('tiny', 'smollm2-135m', 'qwen2.5-0.5b', 'llama-3.2-1b')


@pytest.mark.parametrize('n_sm', [8, 16, 132])
@pytest.mark.parametrize('shape', SHAPES)
def test_plans_balance_wait_for_what_they_read_and_never_stall(shape, n_sm):
    cfg = shape_config(shape)
    plan = build(cfg, n_sm, capacity=256)
    check(plan)
    ops = {t.op for t in plan.tasks}
    assert ops == set(TASK_OPS) - {'nop'}
    assert sum(t.op == 'attn' for t in plan.tasks) == cfg.num_layers * cfg.num_kv_heads * 4
    for mode in plan_module.ASSIGN_MODES:
        queues = assign(plan, mode)
        assert sorted(i for q in queues for i in q) == list(range(len(plan.tasks)))
        assert all(q == sorted(q) for q in queues), 'each list in program order'
        orders = [simulate(plan, queues)]
        orders += [simulate(plan, queues, np.random.default_rng(seed)) for seed in range(2)]
        for order in orders:
            assert sorted(order) == list(range(len(plan.tasks)))
            assert order[-1] == len(plan.tasks) - 1, 'the argmax reduction comes last'
        words = pack(plan, queues)
        assert words.shape == (n_sm, max(len(q) for q in queues), len(TASK_FIELDS))
        for sm, queue in enumerate(queues):
            for at, index in enumerate(queue):
                assert words[sm, at].tolist() == plan.tasks[index].words()
            assert (words[sm, len(queue):, 0] == TASK_OPS.index('nop')).all()


def test_the_split_covers_every_unit_once_in_aligned_ranges():
    for n, parts, align in ((576, 132, 16), (49152, 16, 16), (11, 4, 1), (5, 10, 1), (17, 3, 16)):
        ranges = split(n, parts, align)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and len(ranges) <= parts
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo % align == 0 for lo, _ in ranges)


def test_a_missing_wait_a_wrong_count_and_a_stalling_list_are_named():
    cfg = shape_config('tiny')
    plan = build(cfg, 8, capacity=128)
    down = next(t for t in plan.tasks if t.op == 'down')
    saved = down.waits
    down.waits = []
    with pytest.raises(PlanError, match='without waiting for'):
        check(plan)
    down.waits = [(saved[0][0], saved[0][1] - 1)]
    with pytest.raises(PlanError, match='signals'):
        check(plan)
    down.waits = saved
    check(plan)
    # one SM given a reader before the writer it waits for: nothing can move
    queues = assign(plan, 'round_robin')
    first_o = next(i for i, t in enumerate(plan.tasks) if t.op == 'o')
    bad = [[first_o] + [i for q in queues for i in q if i != first_o]]
    plan.n_sm = 1
    with pytest.raises(PlanError, match=r'stall: SM 0: L0 o.*attn\[0\] 0/'):
        simulate(plan, bad)
    assert 'SM 0:' in dump(plan, bad)


def test_the_task_format_holds_two_waits():
    task = Task('o', 0, 0, 16, waits=[(0, 1), (1, 1), (2, 1)], signal=3)
    with pytest.raises(PlanError, match='two'):
        task.words()
    with pytest.raises(PlanError, match='assign mode'):
        assign(build(shape_config('tiny'), 4, 64), 'random')


@pytest.mark.parametrize('shape,n_sm', [('tiny', 8), ('tiny', 16), ('qwen-like', 8)])
def test_the_tasks_compute_the_decode_step_in_any_order(tmp_path, shape, n_sm):
    """Each task on its slice, in orders the lists allow: the logits of a decode step."""
    import dataclasses

    from dataflow_vm import DataflowVM
    from rt_llm_node.backends.numpy_backend import NumpyBackend
    from rt_llm_node.model import load_checkpoint
    from rt_llm_node.model.synthetic import random_weights
    from rt_llm_node.model.synthetic import write_checkpoint
    from tokenizers import models
    from tokenizers import Tokenizer
    cfg = shape_config('tiny')
    if shape == 'qwen-like':   # biases on q/k/v, one kv head for three query heads
        cfg = dataclasses.replace(cfg, family='qwen2', attention_bias=True, num_heads=6,
                                  num_kv_heads=2, hidden_size=96, head_dim=16)
    tokenizer = Tokenizer(models.WordLevel({f't{i}': i for i in range(cfg.vocab_size)},
                                           unk_token='t0'))
    weights = random_weights(cfg, 5)
    for name in weights:   # sharper logits than the 0.02 init
        if not name.endswith('norm.weight'):
            weights[name] *= 8
    path = write_checkpoint(tmp_path / 'm', cfg, weights, tokenizer, 'F32')
    checkpoint = load_checkpoint(path)
    rng = np.random.default_rng(0)
    reference = NumpyBackend(checkpoint, 128)
    reference.prefill(rng.integers(0, cfg.vocab_size, 70))   # across a 64-key chunk's end
    token = 17
    plan = build(checkpoint.config, n_sm, capacity=128, weight_bytes=4.0)
    check(plan)
    queues = assign(plan, 'greedy')
    results = []
    for seed in range(3):
        vm = DataflowVM(reference, token)
        for index in simulate(plan, queues, np.random.default_rng(seed)):
            vm.run(plan.tasks[index])
        results.append(vm)
    reference.decode(token)
    expected = reference.logits()
    for vm in results:
        assert np.array_equal(vm.logits, results[0].logits), 'another order, other bits'
        assert vm.token == results[0].token
    np.testing.assert_allclose(results[0].logits, expected, rtol=2e-4, atol=2e-4)
    assert results[0].token == int(np.argmax(expected))
    for layer in range(cfg.num_layers):   # the new key and value were appended at its slot
        k, v = reference.kv.read(layer, 71)
        np.testing.assert_allclose(results[0].k[layer][70], k[70], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(results[0].v[layer][70], v[70], rtol=1e-5, atol=1e-5)
