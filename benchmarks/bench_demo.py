"""The demo policy in closed loop (``rt-llm-eval``) recorded in the results file.

    python benchmarks/bench_demo.py [--episodes 200] [--workers N] [rt-llm-eval flags]

Runs ``rt-llm-eval`` on held-out seeds, then writes its table as the ``eviction`` section of
benchmarks/RESULTS.md (``--policies ''``: the expert alone, the ``expert`` section) and the
success-by-budget figure to docs/eviction.png.
"""

import json
from pathlib import Path
import shlex
import sys
import tempfile

from report import markdown_table
from report import write_section
from rt_llm_node.demo.evaluate import BUDGETS
from rt_llm_node.demo.evaluate import main as evaluate
from rt_llm_node.demo.evaluate import POLICIES
from rt_llm_node.demo.evaluate import table_rows

ROOT = Path(__file__).resolve().parents[1]


def option(argv, name, default):
    """Return the value of ``--name`` in argv (rt-llm-eval's flags), or ``default``."""
    if name in argv:
        return argv[argv.index(name) + 1]
    return default


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / 'eval.json'
        plot = ROOT / 'docs' / 'eviction.png'
        policies = [p for p in option(argv, '--policies', ','.join(POLICIES)).split(',') if p]
        extra = ['--plot', str(plot)] if policies else []
        status = evaluate(argv + ['--json', str(out)] + extra)
        if status:
            return status
        result = json.loads(out.read_text())
    table = result['table']
    budgets = [b if b == 'full' else int(b)
               for b in option(argv, '--budgets', ','.join(map(str, BUDGETS))).split(',')]
    command = 'python benchmarks/bench_demo.py ' + ' '.join(shlex.quote(a) for a in argv)
    if not policies:
        expert = table['expert']
        write_section('expert', 'Demo expert on held-out seeds (commands quantized to the '
                      'action grammar)', markdown_table(['episodes', 'goals', 'success'], [[
                          expert['episodes'], expert['goals'], f"{expert['success']:.3f}"]]),
                      command=command)
        return 0
    header, rows = table_rows(table, budgets, policies)
    seeds = table['expert']['seeds']
    body = (markdown_table(header, rows)
            + f'\n\nSeeds {seeds[0]}..{seeds[-1]} (held out), 3 goals each, '
            f"{result['backend']} backend; 'full' = the model's trained length. Success: "
            "goals reached / goals; agree: ticks whose action equals the expert's on the same "
            'observation.\n\n![success by budget](../docs/eviction.png)')
    write_section('eviction', 'Demo policy: eviction policies in closed loop', body,
                  command=command)
    return 0


if __name__ == '__main__':
    sys.exit(main())
