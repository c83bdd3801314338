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
corrupt, truncated or foreign file, another model, format or prompt, a FIFO, a device, a
directory or an oversized file where an entry should be) is one warning saying why and a
fresh prefill or calibration, never an error. Entries are opened through ``files``: regular
files only, without blocking, their size bounded by the store's before a byte is read.

The store fails safe the other way too: a folder that cannot be written (a read-only file
system, a full disk, a file where the folder should be, a directory in an entry's way) is one
warning naming ``state_dir`` and the path, and the node runs without saving; what a
read-only folder holds is still restored.
"""

import hashlib
import json
import os
from pathlib import Path
import platform
import tempfile

import numpy as np

from rt_llm_node.files import FileError
from rt_llm_node.files import GB
from rt_llm_node.files import MB
from rt_llm_node.files import open_regular
from rt_llm_node.files import read_json
from rt_llm_node.files import read_text

FORMAT = 'rt_llm_node.state/1'
MAX_COST_MODEL = 1 * MB
CUDA_SOURCES = Path(__file__).resolve().parents[1] / 'cuda'


def file_digest(paths):
    """Return the SHA-256 (hex) of the files' names and contents, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        path = Path(path)
        digest.update(path.name.encode() + b'\0')
        with open_regular(path, 'model file', 64 * GB) as f:
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
        for line in read_text('/proc/cpuinfo', 'CPU description', 4 * MB).splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    except FileError:
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


def fingerprint(model_path, backend, weight_format, adapter=''):
    """Return the fields a stored prefix must match (the cost model adds the host).

    A LoRA ``adapter`` merged into the model is part of it: its files join the digest.
    """
    from rt_llm_node.model.adapter import adapter_files
    files = model_files(model_path) + (adapter_files(adapter) if adapter else [])
    return {'model': file_digest(files), 'weight_format': weight_format,
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
    """A folder of prefix states and cost models (see the module docstring).

    ``log`` takes the lines of what was found, ``warn`` those of what is wrong with the
    folder or an entry (the node logs them as warnings).
    """

    def __init__(self, folder, max_bytes, log=print, warn=None):
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self.log = log
        self.warn = warn or log
        self.writable = True
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._unwritable(self.folder, exc)
            return
        if not self.folder.is_dir():   # mkdir leaves a file in place without a word
            self._unwritable(self.folder, 'a file is in the way')
        elif not os.access(self.folder, os.W_OK | os.X_OK):
            self._unwritable(self.folder, 'read-only file system' if _read_only(self.folder)
                             else 'not writable')

    def _unwritable(self, path, why):
        """Say once that nothing will be saved, naming state_dir and the path."""
        if self.writable:
            reason = why if isinstance(why, str) else (
                'read-only file system' if getattr(why, 'errno', None) == 30
                else why.strerror or type(why).__name__)
            self.warn(f'state_dir {self.folder}: cannot write {path} ({reason}); running '
                      'without saving state')
        self.writable = False

    def _entries(self, pattern):
        try:
            return sorted(self.folder.glob(pattern), key=_mtime, reverse=True)
        except OSError:
            return []

    # -- prefixes -------------------------------------------------------------------------
    def _prefix_path(self, fields, ids, start):
        key = {**fields, 'token_ids': ids, **({'start': start} if start else {})}
        return self.folder / f"prefix-{_key('prefix', key)}.safetensors"

    def save_prefix(self, fields, token_ids, tensors, mass, start=0):
        """Store the KV ``tensors`` and attention ``mass`` of prefix ``token_ids``.

        ``start``: the tensors hold slots ``start`` .. only (an instruction after the system
        prompt: ``token_ids`` are both, the slots the instruction's).
        """
        from safetensors.numpy import save
        ids = [int(t) for t in token_ids]
        tensors = dict(tensors, mass=np.asarray(mass, np.float32))
        meta = {'format': FORMAT, 'kind': 'prefix', 'fields': json.dumps(fields, sort_keys=True),
                'token_ids': json.dumps(ids), 'start': str(int(start)),
                'sha256': _tensor_digest(tensors)}
        path = self._prefix_path(fields, ids, start)
        self._write(path, save(tensors, metadata=meta))
        return path

    def load_prefix(self, fields, token_ids, start=0):
        """Return (tensors, mass) stored for prefix ``token_ids`` under ``fields``, or None.

        None comes with a log line saying why (nothing stored, what differs, a damaged file);
        for slots from ``start`` > 0 (an instruction) nothing stored is no news: no line.
        """
        ids = [int(t) for t in token_ids]
        path = self._prefix_path(fields, ids, start)
        if not os.path.lexists(path):
            if not start:
                self.log(f'no stored KV state for this prefix: {self._nearest(fields, ids)}; '
                         'prefilling')
            return None
        try:
            meta, tensors = self._read_prefix(path)
        except FileError as exc:   # a FIFO, a device, a directory, too large
            self.warn(f'stored KV state not used: {exc}; prefilling')
            return None
        except Exception as exc:   # any damage: a warning and a fresh prefill
            self.warn(f'stored KV state {path.name} is unreadable ({type(exc).__name__}: '
                      f'{" ".join(str(exc).split())[:200]}); prefilling')
            return None
        problem = self._mismatch(meta, fields, ids)
        if problem is None and meta.get('start', '0') != str(int(start)):
            problem = f"it holds slots from {meta.get('start')}, not {start}"
        if problem is None and _tensor_digest(tensors) != meta.get('sha256'):
            problem = 'its tensors do not match their checksum (damaged)'
        if problem:
            self.log(f'stored KV state {path.name} not used: {problem}; prefilling')
            return None
        self._touch(path)
        mass = tensors.pop('mass')
        return tensors, mass

    def _touch(self, path):
        """Mark an entry recently used (a read-only store keeps its order)."""
        if self.writable:
            try:
                os.utime(path)
            except OSError:
                pass

    def _read_prefix(self, path):
        """Return (metadata, tensors) of a prefix entry: a regular file of the store's size.

        Read whole through the guarded reader (an entry is at most ``max_bytes``), then
        parsed from memory by safetensors.
        """
        from safetensors.numpy import load
        with open_regular(path, 'stored KV state', self.max_bytes) as f:
            blob = f.read(self.max_bytes + 1)
        header = int.from_bytes(blob[:8], 'little') if len(blob) >= 8 else 0
        if not 0 < header <= len(blob) - 8:
            raise ValueError(f'its header claims {header} bytes of a {len(blob)}-byte file')
        meta = json.loads(blob[8:8 + header]).get('__metadata__') or {}
        return meta, load(blob)

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
        for path in self._entries('prefix-*.safetensors')[:1]:
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
        self._write(path, (text + '\n').encode('utf-8'))
        return path

    def load_cost_model(self, fields):
        """Return the CostModel stored under ``fields``, or None with a log line saying why."""
        from rt_llm_node.admission import CostModel
        path = self.folder / f"cost-{_key('cost_model', fields)}.json"
        if not os.path.lexists(path):
            self.log('no stored cost model for this model, format, backend and host; '
                     'calibrating')
            return None
        try:
            data = read_json(path, 'stored cost model', MAX_COST_MODEL)
            if data.get('format') != FORMAT or data.get('fields') != fields:
                raise ValueError('made for another model, format, backend or host')
            model = CostModel.from_json(json.dumps(data['model']))
        except FileError as exc:
            self.warn(f'{exc}; calibrating')
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.warn(f'stored cost model {path.name} not used ({exc}); calibrating')
            return None
        self._touch(path)
        return model

    # -- files ----------------------------------------------------------------------------
    def _write(self, path, data):
        """Write an entry's bytes atomically, then keep the store within its size.

        Nothing is written once the store is unwritable; a failure (read-only, full, a
        directory in the way) is one warning, never an error.
        """
        if not self.writable:
            return
        tmp = None
        try:
            if os.path.isdir(path):
                raise IsADirectoryError(21, 'a directory is in the way')
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix='.tmp-', suffix=path.suffix)
            with os.fdopen(fd, 'wb') as f:
                f.write(data)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self._unwritable(path, exc)
            return
        finally:
            if tmp is not None and os.path.exists(tmp):
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self._trim(keep=path)

    def _trim(self, keep):
        """Remove the least recently used entries until the store fits ``max_bytes``."""
        entries = sorted((p for p in self.folder.iterdir()
                          if p.name.startswith(('prefix-', 'cost-')) and p.is_file()),
                         key=_mtime)
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


def _read_only(folder):
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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
