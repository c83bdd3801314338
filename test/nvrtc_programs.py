"""Every (arch, weight dtype, int8 KV) NVRTC program of the runtime, compiled at once.

``python test/nvrtc_programs.py OUT.pickle`` compiles them all into OUT.pickle ({case: (cubin,
log) or the KernelBuildError}); the suite starts it at the lowest CPU priority when the
session is collected, so that the compiles use the core the other tests leave idle and their
checks (test_cuda_compile.py, run last) find them done.
"""

from concurrent.futures import ThreadPoolExecutor
import os
from pathlib import Path
import pickle
import sys

ARCHS = (87, 90)   # Jetson Orin, Hopper


def cases():
    from rt_llm_node.backends.cuda_kernels import WEIGHT_DTYPES
    return [(arch, dtype, kv) for arch in ARCHS for dtype in WEIGHT_DTYPES
            for kv in (False, True)]


def build(case):
    """Return (cubin, log) of one program, or its KernelBuildError."""
    from rt_llm_node.backends.cuda_kernels import compile_cubin
    from rt_llm_node.backends.cuda_kernels import KernelBuildError
    try:
        return compile_cubin(case[0], case[1], kv_int8=case[2])
    except KernelBuildError as exc:
        return exc


def compile_all():
    """Return {case: build(case)}; NVRTC releases the GIL, so a thread a core compiles."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(cases(), pool.map(build, cases())))


def idle():
    """Run this process only on CPU time nothing else wants (SCHED_IDLE, else nice 19)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


if __name__ == '__main__':
    idle()   # before the compile's threads start: they inherit the policy
    out = Path(sys.argv[1])
    partial = out.with_suffix('.partial')
    partial.write_bytes(pickle.dumps(compile_all()))
    partial.replace(out)
