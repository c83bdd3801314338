"""Every file the package reads, damaged every way: one clear line, no hang, bounded memory.

For each reader (``READERS``: a checkpoint's config, tokenizer, weights and shard index, a
GGUF file, a stored cost model and KV state, a cost model and a golden for replay, a
parameters file, a bag's metadata and storage, a training record, kernel sources, an
output folder's marker) and each damage (a FIFO, a link to /dev/zero, a directory, an 8 GiB
sparse file, garbage bytes), a child process under a 3 GiB address-space limit calls the
reader with an alarm: it must end in the reader's own error (one line naming the file) or,
where the reader promises a fallback (a state entry, a marker), in that fallback. Add a
reader here whenever the package gains one (test_file_access.py lists them).
"""

import json
import os
from pathlib import Path
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAMAGES = ('fifo', 'dev_zero', 'directory', 'sparse', 'garbage')
SECONDS = 30


def _checkpoint(tmp, name):
    """Return a copy of the demo checkpoint with ``name`` replaced later; returns (dir, file)."""
    from rt_llm_node.model.embedded import default_model_path
    folder = tmp / 'model'
    if not folder.exists():
        shutil.copytree(default_model_path(), folder)
    return folder, folder / name


def _load(folder):
    from rt_llm_node.model import load_checkpoint
    load_checkpoint(folder)


def _sharded(tmp):
    folder, _ = _checkpoint(tmp, 'x')
    index = folder / 'model.safetensors.index.json'
    if not index.exists():
        from safetensors import safe_open
        with safe_open(str(folder / 'model.safetensors'), 'np') as f:
            names = list(f.keys())
        os.rename(folder / 'model.safetensors', folder / 'model-00001-of-00001.safetensors')
        index.write_text(json.dumps({'weight_map': dict.fromkeys(
            names, 'model-00001-of-00001.safetensors')}))
    return folder, index


def _state(tmp, kind):
    from rt_llm_node.state_store import StateStore
    lines = []
    store = StateStore(tmp / 'state', 1 << 30, log=lines.append)
    fields = {'model': 'm'}
    if kind == 'cost':
        from rt_llm_node.admission import CostModel
        path = store.save_cost_model(fields, CostModel())
        return path, lambda: store.load_cost_model(fields), lines
    import numpy as np
    ids = [1, 2, 3]
    path = store.save_prefix(fields, ids, {'k': np.zeros((1, 3, 1, 2), np.float32)},
                             np.zeros(3, np.float32))
    return path, lambda: store.load_prefix(fields, ids), lines


def _bag(tmp, name):
    bag = tmp / 'bag'
    if not bag.exists():
        from rt_llm_node.demo.recorder import record_demo_bag
        record_demo_bag(bag, 0.3)
    target = bag / name if name == 'metadata.yaml' else next(bag.glob('*.mcap'))
    return bag, target


def _replay(args):
    from rt_llm_node.replay import main
    code = main([str(a) for a in args])
    if code != 2:
        raise AssertionError(f'exit {code}, not 2')
    raise _Reported('exit 2')


class _Reported(Exception):
    """The reader reported the damage its own way (the message is checked by the caller)."""


def setup(tmp, reader):
    """Return (the file to damage, a call that reads it, fallback lines or None)."""
    if reader in ('config.json', 'tokenizer.json', 'model.safetensors'):
        folder, path = _checkpoint(tmp, reader)
        return path, lambda: _load(folder), None
    if reader == 'safetensors index':
        folder, path = _sharded(tmp)
        return path, lambda: _load(folder), None
    if reader == 'gguf':
        path = tmp / 'model.gguf'
        path.write_bytes(b'GGUF')
        return path, lambda: _load(path), None
    if reader in ('stored cost model', 'stored KV state'):
        return _state(tmp, 'cost' if reader == 'stored cost model' else 'prefix')
    if reader == 'cost model':
        path = tmp / 'cost_model.json'
        return path, lambda: __import__('rt_llm_node.replay').replay.read_cost_model(path), None
    if reader == 'golden':
        golden = tmp / 'golden'
        golden.mkdir(exist_ok=True)
        from rt_llm_node.replay import compare
        return golden / 'actions.jsonl', lambda: compare(golden, golden), None
    if reader == 'parameters':
        path = tmp / 'params.yaml'
        from rt_llm_node.replay import load_params
        return path, lambda: load_params(path), None
    if reader in ('bag metadata', 'bag storage'):
        bag, path = _bag(tmp, 'metadata.yaml' if reader == 'bag metadata' else 'storage')
        from rt_llm_node.bags import open_bag
        return path, lambda: open_bag(bag).close(), None
    if reader == 'training record':
        folder = tmp / 'policy'
        folder.mkdir(exist_ok=True)
        from rt_llm_node.demo.task import model_aim
        return folder / 'training.json', lambda: model_aim(folder), None
    if reader == 'kernel source':
        folder = tmp / 'cuda'
        folder.mkdir(exist_ok=True)
        from rt_llm_node.backends.cuda_kernels import program_source
        return folder / 'argmax.cu', lambda: program_source([folder / 'argmax.cu']), None
    if reader == 'output marker':
        out = tmp / 'out'
        out.mkdir(exist_ok=True)
        (out / 'actions.jsonl').write_text('')
        from rt_llm_node.files import OutputFolder
        return out / 'rt-llm-output.json', lambda: OutputFolder(out, 'rt-llm-replay'), None
    raise KeyError(reader)


READERS = ('config.json', 'tokenizer.json', 'model.safetensors', 'safetensors index', 'gguf',
           'stored cost model', 'stored KV state', 'cost model', 'golden', 'parameters',
           'bag metadata', 'bag storage', 'training record', 'kernel source', 'output marker')
# readers whose promise is a fallback, not an error: None returned (with a log line)
FALLBACK = ('stored cost model', 'stored KV state')


def damage(path, kind):
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if kind == 'fifo':
        os.mkfifo(path)
    elif kind == 'dev_zero':
        os.symlink('/dev/zero', path)
    elif kind == 'directory':
        os.mkdir(path)
    elif kind == 'sparse':
        with open(path, 'wb') as f:
            f.truncate(8 << 30)
    else:
        path.write_bytes(bytes(range(256)) * 64)


def child(tmp, reader, kind):
    """Run one case here (the child): print a JSON line of what happened."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    tmp = Path(tmp)
    path, read, lines = setup(tmp, reader)
    damage(path, kind)

    def expire(*_):
        raise TimeoutError(f'still reading after {SECONDS} s')
    signal.signal(signal.SIGALRM, expire)
    signal.alarm(SECONDS)
    try:
        result = read()
        outcome = {'outcome': 'returned', 'value': repr(result)[:80], 'lines': lines or []}
    except _Reported as exc:
        outcome = {'outcome': 'reported', 'message': str(exc)}
    except (TimeoutError, MemoryError) as exc:
        outcome = {'outcome': 'failed', 'message': f'{type(exc).__name__}: {exc}'}
    except Exception as exc:
        outcome = {'outcome': 'error', 'type': type(exc).__name__, 'message': str(exc)}
    signal.alarm(0)
    outcome['path'] = str(path)
    print('CASE ' + json.dumps(outcome), flush=True)


@pytest.mark.parametrize('reader', READERS)
@pytest.mark.parametrize('kind', DAMAGES)
def test_a_damaged_file_is_one_clear_line(tmp_path, reader, kind, capfd):
    if reader == 'gguf':
        pytest.importorskip('gguf', reason='the gguf package reads GGUF files')
    if reader.startswith('bag'):
        pytest.importorskip('rosbags', reason='rosbags reads the bags')
    result = subprocess.run([sys.executable, __file__, str(tmp_path), reader, kind],
                            capture_output=True, text=True, timeout=SECONDS + 60,
                            cwd=ROOT)
    cases = [json.loads(line[5:]) for line in result.stdout.splitlines()
             if line.startswith('CASE ')]
    assert cases, f'the child died (exit {result.returncode}): {result.stderr[-2000:]}'
    case = cases[0]
    assert case['outcome'] != 'failed', case
    assert 'Traceback' not in result.stderr, result.stderr[-2000:]
    if reader in FALLBACK:
        assert case['outcome'] == 'returned' and case['value'] == 'None', case
        assert case['lines'] and all('\n' not in line for line in case['lines']), case
        return
    if reader == 'output marker':   # a damaged marker is no marker: the folder is foreign
        assert case['outcome'] == 'error' and 'did not write' in case['message'], case
        return
    if case['outcome'] == 'reported':   # rt-llm-replay's exit 2: its line is on stderr
        lines = [line for line in result.stderr.splitlines() if 'error' in line]
        assert len(lines) == 1 and case['path'].split('/')[-1] in lines[0], result.stderr
        return
    assert case['outcome'] == 'error', case
    message = case['message']
    assert '\n' not in message and len(message) < 600, message
    named = case['path'] in message or Path(case['path']).parent.name in message
    assert named, f'the message does not name the file: {message}'


if __name__ == '__main__':
    sys.path.insert(0, str(ROOT / 'test'))
    child(*sys.argv[1:])
