"""One OpenBLAS thread whether numpy or this package is imported first (a real process each)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = """
import importlib.util, json, sys
import numpy
spec = importlib.util.spec_from_file_location('blas', sys.argv[1])
blas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blas)   # the helper alone: the package is not imported yet
before = blas.blas_threads()
import rt_llm_node
print(json.dumps([before, blas.blas_threads()]))
"""


def threads_before_and_after(**env):
    clean = {k: v for k, v in os.environ.items()
             if k not in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS')}
    done = subprocess.run([sys.executable, '-c', PROBE, str(ROOT / 'rt_llm_node' / '_blas.py')],
                          env={**clean, 'PYTHONPATH': str(ROOT), **env}, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason='OpenBLAS takes one thread on one core')
def test_numpy_imported_first_still_gets_one_blas_thread():
    before, after = threads_before_and_after()
    if not before:
        pytest.skip("this numpy's BLAS is not an OpenBLAS whose thread count can be read")
    assert len(before) == 1 and before[0] > 1   # unset: OpenBLAS takes a thread a core
    assert after == [1]
    # a count the user set is theirs: applied as it is
    assert threads_before_and_after(OPENBLAS_NUM_THREADS='2') == [[2], [2]]
