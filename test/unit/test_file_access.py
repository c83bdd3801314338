"""Every file the package opens goes through rt_llm_node.files, or is named here with why.

The walk reads the package's source (its syntax trees): a call that opens, reads, maps or
writes a file anywhere but in ``files.py`` must be one of ``ALLOWED``. A new reader either
uses ``files`` or is added here with its reason, and ``test_file_damage.py`` gains a case.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / 'rt_llm_node'
# calls that open, read, map or write files by name (a method of these names, or a function)
OPENING = {'open', 'read_text', 'read_bytes', 'write_text', 'write_bytes', 'safe_open',
           'GGUFReader', 'from_file', 'fromfile', 'memmap', 'mmap', 'safe_load', 'savefig',
           'Reader', 'Writer', 'save_file', 'load_file', 'loadtxt', 'genfromtxt'}
ALLOWED = {
    ('bags.py', 'Reader(path)'): 'rosbags reads the bag after _check_files checked its files',
    ('bags.py', 'reader.open()'): 'the rosbags Reader above',
    ('demo/recorder.py', 'Writer(folder.staging'): 'a new bag inside its OutputFolder staging',
    ('demo/recorder.py', 'writer.open()'): 'the rosbags Writer above',
    ('replay.py', 'Writer(bag_out'): 'the output bag inside its OutputFolder staging',
    ('replay.py', 'writer.open()'): 'the rosbags Writer above',
    ('replay.py', "(out / 'actions.jsonl').write_text"): 'inside its OutputFolder staging',
    ('replay.py', "(out / 'cost_model.json').write_text"): 'inside its OutputFolder staging',
    ('replay.py', "(out / 'summary.json').write_text"): 'inside its OutputFolder staging',
    ('model/gguf_file.py', 'GGUFReader(path)'): 'after gguf_layout.check_layout',
    ('model/gguf_layout.py', 'mmap.mmap(f.fileno()'): 'a map of a file files.open_regular '
                                                      'opened and checked',
    ('model/checkpoint.py', 'mmap.mmap(f.fileno()'): 'the same, after its header was '
                                                     'checked against the file',
    ('model/synthetic.py', "open(path, 'wb')"): 'writes a fresh random checkpoint for tests '
                                                'and benchmarks',
    ('model/synthetic.py', "(directory / 'config.json').write_text"): 'the same',
    ('demo/evaluate.py', 'fig.savefig(path'): 'the plot file the user named (--plot)',
    ('demo/run.py', 'fig.savefig(path'): 'the picture the user named (--out)',
    ('timeline.py', "fig.savefig(job['path']"): "timeline.png inside replay's staging",
}


def opening_calls():
    """Yield (file relative to the package, line, call source) of every file-opening call."""
    for path in sorted(ROOT.rglob('*.py')):
        if path.name == 'files.py':
            continue
        tree = ast.parse(path.read_text(encoding='utf-8'))
        guarded = {alias.asname or alias.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module == 'rt_llm_node.files'
                   for alias in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = (func.id if isinstance(func, ast.Name)
                    else func.attr if isinstance(func, ast.Attribute) else None)
            if isinstance(func, ast.Name) and name in guarded:
                continue   # rt_llm_node.files' own read_text, read_bytes, ...
            if name in OPENING:
                yield str(path.relative_to(ROOT)), node.lineno, ast.unparse(node)


def test_every_file_the_package_opens_goes_through_the_guarded_module():
    found = list(opening_calls())
    unguarded = [f'{file}:{line}: {source[:80]}' for file, line, source in found
                 if not any(file == f and source.startswith(s) for f, s in ALLOWED)]
    assert not unguarded, ('open files through rt_llm_node.files (or add the call to ALLOWED '
                           'with why):\n' + '\n'.join(unguarded))
    stale = [key for key in ALLOWED if not any(file == key[0] and source.startswith(key[1])
                                               for file, _, source in found)]
    assert not stale, f'ALLOWED names calls that are gone: {stale}'


def test_the_walk_finds_a_bypass():
    """The walk itself: a plain open() in a module is reported."""
    tree = ast.parse("with open('/etc/hosts') as f:\n    f.read()\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, 'id', None) in OPENING]
    assert calls and ast.unparse(calls[0]).startswith('open(')
