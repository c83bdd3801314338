"""The state store fails safe both ways: damaged entries start cold, unwritable folders run on.

Real configure runs of the demo model. A FIFO, a link to /dev/zero, a large sparse file or a
directory where an entry should be is one warning and a cold start, never a hang or an
error; a read-only file system (a robot's baked image) or a full one, or a file where the
folder should be, is one warning naming state_dir and the path, and the node runs without
saving. The read-only and full file systems are real mounts in a user and mount namespace.
"""

import os
from pathlib import Path
import shutil
import subprocess
import sys
import threading

import pytest

from rt_llm_node.configure import configure_engine
from rt_llm_node.engine import ModelClock

from conftest import demo_values  # noqa: I100
from conftest import ROOT

UNSHARE = shutil.which('unshare')


def configure(state_dir, timeout=120, **overrides):
    """Configure in a thread that must finish in ``timeout`` s: (lines, warnings)."""
    lines, warnings, out = [], [], {}

    def run():
        try:
            out['engine'] = configure_engine(
                demo_values(backend='numpy', state_dir=str(state_dir), calibration_repeats=2,
                            **overrides),
                clock=ModelClock(), log=lines.append, warn=warnings.append)
        except BaseException as exc:   # re-raised below, on the test's thread
            out['error'] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f'configure hung: {lines[-3:]}'
    if 'error' in out:
        raise out['error']
    return lines, warnings


def restored(lines):
    return any('KV state restored' in line for line in lines)


@pytest.fixture
def stored(tmp_path):
    """Return a state_dir holding a prefix and a cost model, as a first configure leaves it."""
    state = tmp_path / 'state'
    lines, warnings = configure(state)
    assert not warnings, warnings
    entries = sorted(p.name for p in state.iterdir())
    assert any(n.startswith('prefix-') for n in entries)
    assert any(n.startswith('cost-') for n in entries)
    return state


@pytest.mark.parametrize('damage', ['fifo', 'dev_zero', 'sparse', 'directory'])
def test_a_damaged_entry_is_one_warning_and_a_cold_start(stored, damage):
    for entry in list(stored.iterdir()):
        entry.unlink()
        if damage == 'fifo':
            os.mkfifo(entry)
        elif damage == 'dev_zero':
            entry.symlink_to('/dev/zero')
        elif damage == 'sparse':
            with open(entry, 'wb') as f:
                f.truncate(8 << 30)   # 8 GiB of nothing, on no disk
        else:
            entry.mkdir()
    lines, warnings = configure(stored)
    assert not restored(lines)
    assert any('calibrating the cost model' in line for line in lines), lines
    what = {'fifo': 'a FIFO', 'dev_zero': 'a character device', 'sparse': 'bytes, more than',
            'directory': 'a directory'}[damage]
    assert any(what in w for w in warnings), warnings
    assert all('\n' not in w and str(stored) in w for w in warnings), warnings


def test_a_file_where_the_folder_should_be_is_one_warning_naming_state_dir(tmp_path):
    state = tmp_path / 'state'
    state.write_text('not a folder')
    lines, warnings = configure(state)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f'state_dir {state}') and 'without saving' in warnings[0]
    assert state.read_text() == 'not a folder'


CHILD = """
import sys
from rt_llm_node.configure import configure_engine
from rt_llm_node.engine import ModelClock
sys.path.insert(0, sys.argv[2])
from conftest import demo_values
lines, warnings = [], []
configure_engine(demo_values(backend='numpy', state_dir=sys.argv[1], calibration_repeats=2),
                 clock=ModelClock(), log=lines.append, warn=warnings.append)
print('RESTORED' if any('KV state restored' in l for l in lines) else 'COLD')
for w in warnings:
    print('WARNING', w)
"""


def in_namespace(mount, state):
    """Configure in a child whose ``state`` is ``mount`` (shell) in its own namespaces."""
    script = f'{mount} && exec {sys.executable} -c "$0" "$1" "$2"'
    result = subprocess.run([UNSHARE, '-rm', 'sh', '-c', script, CHILD, str(state),
                             str(ROOT / 'test')], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


@pytest.mark.skipif(not UNSHARE, reason='unshare (util-linux) mounts the test file systems')
def test_a_valid_state_on_a_read_only_file_system_restores_and_saves_nothing(stored, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in stored.iterdir()}
    target = tmp_path / 'ro'
    target.mkdir()
    out = in_namespace(f'mount --bind {stored} {target} && mount -o remount,bind,ro {target}',
                       target)
    assert out[0] == 'RESTORED', out
    warnings = [line for line in out if line.startswith('WARNING')]
    assert len(warnings) == 1 and f'state_dir {target}' in warnings[0], out
    assert 'read-only file system' in warnings[0] and 'without saving' in warnings[0]
    assert {p.name: p.stat().st_mtime_ns for p in stored.iterdir()} == before


@pytest.mark.skipif(not UNSHARE, reason='unshare (util-linux) mounts the test file systems')
def test_an_empty_read_only_or_full_state_dir_runs_without_saving(tmp_path):
    empty = tmp_path / 'empty'
    empty.mkdir()
    out = in_namespace(f'mount -o remount,bind,ro {empty} 2>/dev/null || '
                       f'(mount --bind {empty} {empty} && mount -o remount,bind,ro {empty})',
                       empty)
    assert out[0] == 'COLD' and sum(line.startswith('WARNING') for line in out) == 1, out
    full = tmp_path / 'full'
    full.mkdir()
    out = in_namespace(f'mount -t tmpfs -o size=8k tmpfs {full}', full)
    assert out[0] == 'COLD', out
    warnings = [line for line in out if line.startswith('WARNING')]
    assert len(warnings) == 1 and f'state_dir {full}' in warnings[0], out
    assert 'No space left' in warnings[0], warnings
    assert not list(Path(full).iterdir()), "the mount was the namespace's own"
