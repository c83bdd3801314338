"""The one guarded way the package opens the files it reads, and writes without destroying.

Every reader opens through ``open_regular``: the path is opened without blocking (a FIFO
cannot hang configure), must then be a regular file (not a FIFO, a device such as
``/dev/zero``, a socket or a directory; a link is followed to what it names, which is
checked), and its size is bounded before any byte is read by what its format can justify.
Errors are ``FileError``: one line naming what the file is for, the path and why.
``read_bytes``/``read_text``/``read_json``/``read_yaml`` read small files whole; large
formats (safetensors, GGUF) are checked here and then mapped lazily by their readers.

Writers go through ``write_atomic`` (a temporary name beside the target, then a rename):
a reader sees the old file or the new one, never half of one.
"""

import errno
import json
import os
from pathlib import Path
import stat
import tempfile

KB = 1 << 10
MB = 1 << 20
GB = 1 << 30
# bounds of the small formats the package reads whole
MAX_JSON = 64 * MB          # config.json, tokenizer.json, cost models, index files
MAX_PARAMS = 4 * MB         # a node's parameter YAML
MAX_TEXT = 16 * MB          # kernel sources and other text


class FileError(OSError):
    """A file that cannot be read or written as asked: one line, what it is for, the path, why.

    ``path`` and ``reason`` are kept apart for callers that word the line their own way
    (a CheckpointError names the file first).
    """

    def __init__(self, what, path, reason):
        self.what, self.path, self.reason = what, str(path), reason
        super().__init__(f'{what} {path}: {reason}')

    def __str__(self):
        return f'{self.what} {self.path}: {self.reason}'

    def __reduce__(self):   # intact across processes (rt-llm-eval's workers, Ray tasks)
        return type(self), (self.what, self.path, self.reason)


def _kind(mode):
    for test, name in ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO'),
                       (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
                       (stat.S_ISSOCK, 'a socket')):
        if test(mode):
            return name
    return 'not a regular file'


def check_regular(path, what, max_bytes):
    """Return the size of ``path`` after checking it is a regular file of at most ``max_bytes``.

    For readers that map the file themselves (safetensors, GGUF): the checks of
    ``open_regular`` without keeping the file open.
    """
    with open_regular(path, what, max_bytes) as f:
        return os.fstat(f.fileno()).st_size


def open_regular(path, what, max_bytes):
    """Open ``path`` for binary reading; FileError unless a regular file of <= max_bytes.

    ``what`` names the file's role in errors (e.g. 'checkpoint', 'state entry').
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, 'O_CLOEXEC', 0))
    except OSError as exc:
        raise FileError(what, path, f'cannot open ({_reason(exc)})') from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(what, path, f'{_kind(info.st_mode)}, not a regular file')
        if info.st_size > max_bytes:
            raise FileError(what, path, f'{info.st_size} bytes, more than the '
                            f'{_size(max_bytes)} such a file may be')
        # reads block normally from here on (a regular file never blocks anyway)
        os.set_blocking(fd, True)
        return os.fdopen(fd, 'rb')
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, what, max_bytes):
    """Return the whole content of a regular file of at most ``max_bytes``."""
    with open_regular(path, what, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:   # it grew while being read
        raise FileError(what, path, f'more than the {_size(max_bytes)} such a file may be')
    return data


def file_sha256(path, what, max_bytes):
    """Return the SHA-256 (hex) of a regular file of at most ``max_bytes``, read in blocks."""
    import hashlib
    digest = hashlib.sha256()
    with open_regular(path, what, max_bytes) as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def read_text(path, what, max_bytes=MAX_TEXT):
    """Return a UTF-8 text file of at most ``max_bytes``; FileError if it does not decode."""
    data = read_bytes(path, what, max_bytes)
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as exc:
        raise FileError(what, path, f'not UTF-8 text (byte {exc.start})') from None


def read_json(path, what, max_bytes=MAX_JSON):
    """Return the parsed JSON of a file; FileError naming the line where it does not parse."""
    text = read_text(path, what, max_bytes)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FileError(what, path, f'not valid JSON ({_one_line(exc)})') from None


def read_yaml(path, what, max_bytes=MAX_PARAMS):
    """Return the parsed YAML of a file (safe loader); FileError where it does not parse."""
    import yaml
    text = read_text(path, what, max_bytes)
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise FileError(what, path, f'not valid YAML ({_one_line(exc)})') from None


def write_atomic(path, data, what):
    """Write ``data`` (bytes or str) to ``path`` through a temporary name and a rename.

    FileError naming ``what`` and the path where it cannot (read-only, full, a directory in
    the way); the temporary file never stays behind.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode('utf-8')
    tmp = None
    try:
        if path.is_dir():
            raise FileError(what, path, 'a directory is in the way')
        fd, tmp = tempfile.mkstemp(prefix=f'.{path.name}.', suffix='.tmp', dir=path.parent)
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except FileError:
        raise
    except OSError as exc:
        raise FileError(what, path, f'cannot write ({_reason(exc)})') from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _reason(exc):
    if exc.errno in (errno.EROFS,):
        return 'read-only file system'
    return exc.strerror or type(exc).__name__


def _one_line(exc):
    return ' '.join(str(exc).split())


def _size(n):
    for unit, scale in (('GiB', GB), ('MiB', MB), ('KiB', KB)):
        if n >= scale:
            return f'{n / scale:g} {unit}'
    return f'{n} bytes'


MARKER = 'rt-llm-output.json'


class OutputFolder:
    """A folder a tool writes whole, without destroying what it did not write.

    ``path`` may not exist (it is made), be an empty folder, or hold an earlier output of
    the same ``tool`` and nothing else (recognised by the marker file it leaves, which lists
    the names it wrote): then it is replaced whole, only once the new output is complete.
    Anything else there is refused (FileError, one line) unless ``force``: then the new
    output is written beside what is there, replacing only names the marker says this tool
    wrote, and a name of its output that something else holds is still refused. A path that
    is a file is an error.

    Write into ``staging`` (a path that does not exist yet, in a fresh hidden folder beside
    ``path``), then ``commit``; ``discard`` (or a failure before commit) leaves ``path`` as
    it was.
    """

    def __init__(self, path, tool, force=False):
        self.path, self.tool, self.force = Path(path), tool, force
        what = f'{tool} output'
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
            raise FileError(what, self.path, 'not a folder (a file is there): choose a folder')
        self.ours = set()
        self.foreign = set()
        if self.path.is_dir():
            names = {p.name for p in self.path.iterdir()}
            self.ours = self._marked(names)
            self.foreign = names - self.ours - {MARKER}
            if self.foreign and not force:
                listed = ', '.join(sorted(self.foreign)[:3])
                more = f' and {len(self.foreign) - 3} more' if len(self.foreign) > 3 else ''
                raise FileError(what, self.path, f'holds what {tool} did not write ({listed}'
                                f'{more}): choose another folder, or --force to write beside '
                                'it (nothing of it is deleted)')
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f'.{self.path.name}.', dir=self.path.parent))
        self.staging = self._tmp / 'out'

    def _marked(self, names):
        """Names the marker says this tool wrote (none without a marker of this tool)."""
        if MARKER not in names:
            return set()
        try:
            data = read_json(self.path / MARKER, f'{self.tool} output marker', 1 * MB)
        except FileError:
            return set()
        if not isinstance(data, dict) or data.get('tool') != self.tool:
            return set()
        return {n for n in data.get('files', []) if isinstance(n, str)} & names

    def commit(self):
        """Put the staged output in place (see the class); the marker lists what it wrote."""
        import shutil
        names = sorted(p.name for p in self.staging.iterdir())
        clash = sorted(set(names) & self.foreign)
        if clash:
            self.discard()
            raise FileError(f'{self.tool} output', self.path, f'{", ".join(clash)} there was '
                            f'not written by {self.tool}: not replaced, even with --force')
        marker = json.dumps({'tool': self.tool, 'files': names}, indent=2) + '\n'
        (self.staging / MARKER).write_text(marker, encoding='utf-8')
        if not self.path.exists():
            os.rename(self.staging, self.path)
        elif not self.foreign:   # empty, or only an earlier output of this tool: replaced
            old = self._tmp / 'old'
            os.rename(self.path, old)
            os.rename(self.staging, self.path)
        else:                    # --force beside foreign files: ours replaced name by name
            old = self._tmp / 'old'
            old.mkdir()
            for name in names + [MARKER]:
                if (self.path / name).exists() or (self.path / name).is_symlink():
                    os.rename(self.path / name, old / name)
                os.rename(self.staging / name, self.path / name)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def discard(self):
        import shutil
        shutil.rmtree(self._tmp, ignore_errors=True)
