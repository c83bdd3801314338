"""Write benchmark tables into benchmarks/RESULTS.md, each section with command, machine, date.

A section sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``;
rerunning a benchmark replaces its section and leaves the others alone.
"""

import datetime
import os
from pathlib import Path
import platform
import re
import shlex
import sys

from rt_llm_node.state_store import cpu_model

RESULTS_MD = Path(__file__).resolve().parent / 'RESULTS.md'


def machine_description():
    """One line: CPU model and cores, and the Python version."""
    return f'{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}'


def markdown_table(header, rows):
    """Rows of cells -> a markdown table."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def print_table(header, rows):
    """Print rows aligned in columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print('  '.join(str(c).rjust(w) for c, w in zip(row, widths)))


def write_section(name, title, body, machine=None, command=None, path=RESULTS_MD):
    """Replace (or add) section ``name`` of the results file."""
    command = command or 'python ' + ' '.join(shlex.quote(a) for a in sys.argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
    section = (f'<!-- bench:{name} -->\n## {title}\n\n'
               f'- command: `{command}`\n- machine: {machine or machine_description()}\n'
               f'- date: {stamp}\n\n{body.strip()}\n<!-- /bench:{name} -->')
    text = path.read_text(encoding='utf-8') if path.exists() else '# Results\n'
    pattern = re.compile(rf'<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->',
                         re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip('\n') + '\n\n' + section + '\n'
    path.write_text(text, encoding='utf-8')
