"""ament's lint rules as tests: flake8 with ament_flake8's settings (setup.cfg)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT  # noqa: I100


def test_flake8():
    pytest.importorskip('flake8', reason='flake8 is in the test extra')
    paths = [p for p in ('rt_llm_node', 'test', 'launch', 'setup.py', 'benchmarks', 'training',
                         'dev')
             if os.path.exists(os.path.join(ROOT, p))]
    result = subprocess.run([sys.executable, '-m', 'flake8', *paths], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
