"""The replay's timeline figure, drawn by a child process so matplotlib stays off the tick."""

import json
from pathlib import Path
import sys

import numpy as np


class TimelinePlotter:
    """Draw timeline.png in a child process started before the replay's first tick.

    Importing matplotlib and drawing take about 1 s, a fifth of a 60 s bag's whole replay on
    2 cores with the shipped policy; in a child process started first they run on another
    core while the engine ticks, and the child then only waits for the records. Tick
    latency against the deadline, refusals by reason, cache occupancy.
    """

    NO_MATPLOTLIB = 3   # the child's exit status when matplotlib cannot be imported

    def __init__(self):
        import os
        import subprocess
        # this package where the parent found it, installed or not
        package_root = str(Path(__file__).resolve().parents[1])
        path = os.environ.get('PYTHONPATH')
        env = dict(os.environ, PYTHONPATH=package_root + (os.pathsep + path if path else ''))
        self._proc = subprocess.Popen(
            [sys.executable, '-c', 'from rt_llm_node.timeline import TimelinePlotter; '
             'TimelinePlotter.child()'],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def draw(self, records, period_ms, margin_ms, path, warn):
        """Send the records, wait for the PNG; a failure is a warning, never an error."""
        job = {'path': str(path), 'period_ms': period_ms, 'margin_ms': margin_ms,
               'stamp': [r.stamp for r in records], 'total_ms': [r.total_ms for r in records],
               'predicted_ms': [r.predicted_ms for r in records],
               'refusal': [r.reason if r.decision == 'refusal' else None for r in records],
               'cache_length': [r.cache_length for r in records]}
        try:
            _, err = self._proc.communicate(json.dumps(job).encode(), timeout=120)
        except Exception as exc:   # a child that hangs or died: the replay's outputs stand
            self.close()
            warn(f'timeline.png not drawn ({exc})')
            return
        if self._proc.returncode == self.NO_MATPLOTLIB:
            warn('matplotlib is not installed: no timeline.png')
        elif self._proc.returncode:
            tail = err.decode(errors='replace').strip().splitlines()[-1:] or ['no message']
            warn(f'timeline.png not drawn: {tail[0]}')

    def close(self):
        """Stop a child that has not finished (never given records, or hung) and reap it."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    @classmethod
    def child(cls):
        """Return the child process: import matplotlib now, then draw what stdin brings."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            sys.stdin.read()
            sys.exit(cls.NO_MATPLOTLIB)
        text = sys.stdin.read()
        if not text:          # the parent closed without a job
            return
        job = json.loads(text)
        if not job['stamp']:
            return
        t = np.array(job['stamp'])
        t = t - t[0]
        period_ms = job['period_ms']
        fig = Figure(figsize=(11, 6))
        ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={'height_ratios': [3, 1]})
        ax.plot(t, job['total_ms'], lw=0.8, label='tick latency (ms)')
        ax.plot(t, job['predicted_ms'], lw=0.6, alpha=0.7, label='predicted (ms)')
        ax.axhline(period_ms, color='red', ls='--', lw=1, label='tick deadline')
        ax.axhline(period_ms - job['margin_ms'], color='orange', ls=':', lw=1,
                   label='engine budget (deadline - margin)')
        reasons = sorted({r for r in job['refusal'] if r is not None})
        for i, reason in enumerate(reasons):
            xs = [tt for tt, r in zip(t, job['refusal']) if r == reason]
            ax.scatter(xs, [period_ms * (1.05 + 0.05 * i)] * len(xs), s=8, marker='|',
                       label=f'refusal: {reason}')
        ax.set_ylabel('ms')
        ax.legend(loc='upper right', fontsize=7)
        ax2.plot(t, job['cache_length'], lw=0.8, color='tab:green')
        ax2.set_ylabel('cache tokens')
        ax2.set_xlabel('bag time (s)')
        fig.tight_layout()
        fig.savefig(job['path'], dpi=90)
