"""What a node keeps across restarts: prefix KV state and calibrated cost models. No ROS here.

A folder (parameter ``state_dir``) of entries, one file each, written atomically (a temporary
file renamed into place) and bounded in total size (``state_max_mb``; the least recently used
entries go first):

- ``prefix-<key>.safetensors``: the KV cache of a token prefix from slot 0 (the system
  prompt) as the backend left it after prefilling exactly those tokens, and the attention
  mass that prefill reported, with a SHA-256 of the tensors;
- ``cost-<key>.json``: a calibrated cost model.

Every entry carries the fingerprint it was made under (the model files' digest, weight and KV
formats, backend and its build, the host for cost models) and, for a prefix, the exact token
ids at positions 0 .. n-1. An entry is used only when all of it matches; anything else (a
corrupt, truncated or foreign file, another model, format or prompt) is one log line saying
why and a fresh prefill or calibration, never an error.
"""

import hashlib
import json
import os
from pathlib import Path
import platform
import tempfile

import numpy as np

FORMAT = 'rt_llm_node.state/1'
CUDA_SOURCES = Path(__file__).resolve().parents[1] / 'cuda'


def file_digest(paths):
    """Return the SHA-256 (hex) of the files' names and contents, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        path = Path(path)
        digest.update(path.name.encode() + b'\0')
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 20), b''):
                digest.update(block)
    return digest.hexdigest()


def model_files(path):
    """Return the files that make a checkpoint: a .gguf, or its config, weights, tokenizer."""
    path = Path(path)
    if path.is_file():
        return [path]
    names = ('config.json', 'tokenizer.json', 'generation_config.json')
    return sorted([p for p in path.iterdir() if p.name in names or p.suffix == '.safetensors'
                   or p.name.endswith('.safetensors.index.json')])


def cpu_model():
    """Return the CPU's model name (from /proc/cpuinfo where there is one)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return cpu


def host_description(backend):
    """Return the device a backend times on: its GPU's name, or the CPU model and cores."""
    if backend.name == 'cuda':
        device_id = getattr(getattr(backend, 'options', None), 'device_id', 0)
        try:
            import cupy
            name = cupy.cuda.runtime.getDeviceProperties(device_id)['name']
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:   # the key then names no model: a weaker match, never an error
            name = 'unnamed'
        return f'CUDA device {device_id}: {name}'
    return f'{cpu_model()}, {os.cpu_count()} cores'


def backend_build(backend):
    """Return what makes a backend's numbers.

    Its name and numpy's version; for CUDA, its kernel sources and compile options.
    """
    build = f'{backend.name}; numpy {np.__version__}'
    if backend.name == 'cuda' and CUDA_SOURCES.is_dir():
        from rt_llm_node.backends.cuda_kernels import compile_options
        options = ' '.join(compile_options(backend.kernels.arch, backend.weight_dtype,
                                           backend.kv_int8))
        build += ('; kernels ' + file_digest(sorted(CUDA_SOURCES.glob('*.cu*')))[:16]
                  + '; options ' + hashlib.sha256(options.encode()).hexdigest()[:16])
    return build


def fingerprint(model_path, backend, weight_format):
    """Return the fields a stored prefix must match (the cost model adds the host)."""
    return {'model': file_digest(model_files(model_path)), 'weight_format': weight_format,
            'kv_dtype': backend.kv_dtype, 'build': backend_build(backend)}


def _key(kind, fields):
    text = json.dumps({'kind': kind, **fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _tensor_digest(tensors):
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f'{name}:{array.dtype.str}:{array.shape}\0'.encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


class StateStore:
    """A folder of prefix states and cost models (see the module docstring)."""

    def __init__(self, folder, max_bytes, log=print):
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self.log = log
        self.folder.mkdir(parents=True, exist_ok=True)

    # -- prefixes -------------------------------------------------------------------------
    def _prefix_path(self, fields, ids, start):
        key = {**fields, 'token_ids': ids, **({'start': start} if start else {})}
        return self.folder / f"prefix-{_key('prefix', key)}.safetensors"

    def save_prefix(self, fields, token_ids, tensors, mass, start=0):
        """Store the KV ``tensors`` and attention ``mass`` of prefix ``token_ids``.

        ``start``: the tensors hold slots ``start`` .. only (an instruction after the system
        prompt: ``token_ids`` are both, the slots the instruction's).
        """
        from safetensors.numpy import save_file
        ids = [int(t) for t in token_ids]
        tensors = dict(tensors, mass=np.asarray(mass, np.float32))
        meta = {'format': FORMAT, 'kind': 'prefix', 'fields': json.dumps(fields, sort_keys=True),
                'token_ids': json.dumps(ids), 'start': str(int(start)),
                'sha256': _tensor_digest(tensors)}
        path = self._prefix_path(fields, ids, start)
        self._write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
        return path

    def load_prefix(self, fields, token_ids, start=0):
        """Return (tensors, mass) stored for prefix ``token_ids`` under ``fields``, or None.

        None comes with a log line saying why (nothing stored, what differs, a damaged file);
        for slots from ``start`` > 0 (an instruction) nothing stored is no news: no line.
        """
        ids = [int(t) for t in token_ids]
        path = self._prefix_path(fields, ids, start)
        if not path.exists():
            if not start:
                self.log(f'no stored KV state for this prefix: {self._nearest(fields, ids)}; '
                         'prefilling')
            return None
        try:
            meta, tensors = self._read_prefix(path)
        except Exception as exc:   # any damage: a warning and a fresh prefill
            self.log(f'stored KV state {path.name} is unreadable ({type(exc).__name__}: '
                     f'{exc}); prefilling')
            return None
        problem = self._mismatch(meta, fields, ids)
        if problem is None and meta.get('start', '0') != str(int(start)):
            problem = f"it holds slots from {meta.get('start')}, not {start}"
        if problem is None and _tensor_digest(tensors) != meta.get('sha256'):
            problem = 'its tensors do not match their checksum (damaged)'
        if problem:
            self.log(f'stored KV state {path.name} not used: {problem}; prefilling')
            return None
        os.utime(path)   # recently used
        mass = tensors.pop('mass')
        return tensors, mass

    def _read_prefix(self, path):
        from safetensors import safe_open
        with safe_open(str(path), framework='np') as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return meta, tensors

    def _mismatch(self, meta, fields, ids):
        """Say what differs between a stored entry and what is wanted (None: nothing)."""
        if meta.get('format') != FORMAT:
            return f"format {meta.get('format')!r}, not {FORMAT!r}"
        try:
            stored_fields = json.loads(meta.get('fields', ''))
            stored_ids = json.loads(meta.get('token_ids', 'null'))
        except ValueError:
            return 'its description is not JSON (damaged)'
        for name in sorted(set(fields) | set(stored_fields)):
            if stored_fields.get(name) != fields.get(name):
                return (f'{name} differs (stored {str(stored_fields.get(name))[:24]}, '
                        f'now {str(fields.get(name))[:24]})')
        if stored_ids != ids:
            return _token_difference(stored_ids, ids)
        return None

    def _nearest(self, fields, ids):
        """Describe why the most recently used stored prefix does not fit (or that none is)."""
        entries = sorted(self.folder.glob('prefix-*.safetensors'), key=_mtime, reverse=True)
        for path in entries[:1]:
            try:
                meta, _ = self._read_prefix(path)
            except Exception:
                return f'the latest entry {path.name} is unreadable'
            return f'the latest entry differs: {self._mismatch(meta, fields, ids)}'
        return 'the store holds none'

    # -- cost models ----------------------------------------------------------------------
    def save_cost_model(self, fields, model):
        """Store a calibrated CostModel under ``fields``."""
        text = json.dumps({'format': FORMAT, 'kind': 'cost_model', 'fields': fields,
                           'model': json.loads(model.to_json())}, indent=2, sort_keys=True)
        path = self.folder / f"cost-{_key('cost_model', fields)}.json"
        self._write(path, lambda tmp: Path(tmp).write_text(text + '\n', encoding='utf-8'))
        return path

    def load_cost_model(self, fields):
        """Return the CostModel stored under ``fields``, or None with a log line saying why."""
        from rt_llm_node.admission import CostModel
        path = self.folder / f"cost-{_key('cost_model', fields)}.json"
        if not path.exists():
            self.log('no stored cost model for this model, format, backend and host; '
                     'calibrating')
            return None
        try:
            data = json.loads(path.read_text(encoding='utf-8'))
            if data.get('format') != FORMAT or data.get('fields') != fields:
                raise ValueError('made for another model, format, backend or host')
            model = CostModel.from_json(json.dumps(data['model']))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.log(f'stored cost model {path.name} not used ({exc}); calibrating')
            return None
        os.utime(path)
        return model

    # -- files ----------------------------------------------------------------------------
    def _write(self, path, write):
        """Write an entry atomically, then keep the store within its size."""
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix='.tmp-', suffix=path.suffix)
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._trim(keep=path)

    def _trim(self, keep):
        """Remove the least recently used entries until the store fits ``max_bytes``."""
        entries = sorted((p for p in self.folder.iterdir()
                          if p.name.startswith(('prefix-', 'cost-'))), key=_mtime)
        total = sum(_size(p) for p in entries)
        for path in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            total -= _size(path)
            try:
                path.unlink()
            except OSError:
                pass

    def size_bytes(self):
        """Return the bytes the store's entries take."""
        return sum(_size(p) for p in self.folder.iterdir()
                   if p.name.startswith(('prefix-', 'cost-')))


def _mtime(path):
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _size(path):
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _token_difference(stored, wanted):
    stored = list(stored or [])
    at = next((i for i, (a, b) in enumerate(zip(stored, wanted)) if a != b),
              min(len(stored), len(wanted)))
    return (f'the token ids differ at position {at} (stored {len(stored)} tokens, now '
            f'{len(wanted)})')
