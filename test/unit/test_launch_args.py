"""The packed argument structs of the one-launch decode steps are the kernels' structs."""

from pathlib import Path

import pytest

from rt_llm_node.backends import launch_args

CUDA = Path(__file__).resolve().parents[2] / 'cuda'


@pytest.mark.parametrize('source, name, fields', [
    ('persistent_ops.cuh', 'DecodeLayer', launch_args.DECODE_LAYER),
    ('persistent_ops.cuh', 'DecodeArgs', launch_args.DECODE_ARGS),
    ('decode_dataflow.cu', 'DataflowArgs', launch_args.DATAFLOW_ARGS),
])
def test_each_packed_struct_lists_the_kernels_fields_in_order(source, name, fields):
    assert launch_args.c_struct((CUDA / source).read_text(), name) == list(fields)


def test_packing():
    assert launch_args.layout(launch_args.DECODE_ARGS) == '<' + 16 * 'Q' + 9 * 'i' + 2 * 'f'
    values = {'tasks': 1, 'ready': 2, 'max_len': 3, 'n_ready': 4, 'n_lm': 5}
    assert len(launch_args.pack(launch_args.DATAFLOW_ARGS, values)) == 28
    with pytest.raises(ValueError, match=r"missing \['n_lm'\]"):
        launch_args.pack(launch_args.DATAFLOW_ARGS, dict.fromkeys(list(values)[:4], 1))
    with pytest.raises(ValueError, match='pointers go first'):
        launch_args.layout((('n', 'int'), ('p', 'ptr')))
    with pytest.raises(ValueError, match='of type double'):
        launch_args.c_struct('struct S { double a; };', 'S')
    assert launch_args.c_struct('struct S { const int *a, b; // note\n float c; };', 'S') == [
        ('a', 'ptr'), ('b', 'int'), ('c', 'float')]
