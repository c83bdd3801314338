"""Registers, spills and shared memory of every kernel, with no GPU: NVRTC to PTX, then ptxas.

    python dev/cuda/ptxas_report.py [--arch 90] [--dtype BF16] [--ptxas PATH] [--match NAME]
        [--define NAME=VALUE ...] [--extra FILE ...]

NVRTC compiles the program as the backend does (same options) but to PTX for
compute_ARCH; the CUDA toolkit's ptxas (`/usr/local/cuda*/bin/ptxas`) assembles it for
sm_ARCH with -v. NVRTC from PyPI may write a newer PTX ISA version than the installed
ptxas reads: the header is lowered to what that ptxas knows (the kernels use no newer
instruction). For register budgets (`__launch_bounds__`, MV_BATCH) before a GPU run.
"""

import argparse
import glob
from pathlib import Path
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rt_llm_node.backends.cuda_kernels import compile_options  # noqa: E402
from rt_llm_node.backends.cuda_kernels import headers  # noqa: E402
from rt_llm_node.backends.cuda_kernels import program_source  # noqa: E402
from rt_llm_node.backends.cuda_kernels import runtime_sources  # noqa: E402


def find_ptxas():
    found = sorted(glob.glob('/usr/local/cuda*/bin/ptxas'))
    return found[-1] if found else None


def ptx_for(arch, dtype, defines=(), extra=()):
    from cupy_backends.cuda.libs import nvrtc
    options = [o for o in compile_options(arch, dtype) if not o.startswith('--gpu-architecture')]
    options += [f'-D{d}' for d in defines]
    options.append(f'--gpu-architecture=compute_{arch}')
    included = headers()
    program = nvrtc.createProgram(program_source([*runtime_sources(), *extra]), 'rt_llm_node.cu',
                                  [text.encode() for text in included.values()],
                                  [name.encode() for name in included])
    try:
        nvrtc.compileProgram(program, options)
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def report(ptx, arch, ptxas, isa):
    ptx = re.sub(r'^\.version \d+\.\d+', f'.version {isa}', ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / 'k.ptx'
        src.write_text(ptx)
        run = subprocess.run([ptxas, f'-arch=sm_{arch}', '-v', str(src), '-o',
                              str(Path(tmp) / 'k.cubin')], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f'ptxas failed:\n{run.stderr[-3000:]}')
    rows, name = {}, None
    for line in run.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            rows[name] = {}
        elif name and 'spill stores' in line:
            rows[name]['spills'] = re.search(r'(\d+) bytes spill stores', line).group(1)
        elif name and 'Used' in line:
            rows[name]['registers'] = re.search(r'Used (\d+) registers', line).group(1)
            smem = re.search(r'(\d+) bytes smem', line)
            rows[name]['smem'] = smem.group(1) if smem else '0'
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--arch', type=int, default=90)
    parser.add_argument('--dtype', default='BF16', choices=('BF16', 'F16', 'F32'))
    parser.add_argument('--ptxas', default=None, help='default: the newest /usr/local/cuda*')
    parser.add_argument('--isa', default='9.0', help='PTX ISA version the ptxas reads')
    parser.add_argument('--match', default='', help='only kernels whose name contains this')
    parser.add_argument('--define', action='append', default=[], metavar='NAME=VALUE',
                        help='an extra -D option (a macro with a default, e.g. QBATCH=2)')
    parser.add_argument('--extra', action='append', default=[], metavar='FILE',
                        help='a .cu file compiled after the runtime program (a probe)')
    args = parser.parse_args()
    ptxas = args.ptxas or find_ptxas()
    if not ptxas:
        raise SystemExit('no ptxas found: install the CUDA toolkit or pass --ptxas')
    ptx = ptx_for(args.arch, args.dtype, args.define, args.extra)
    rows = report(ptx, args.arch, ptxas, args.isa)
    print(f'sm_{args.arch} {args.dtype} ({ptxas})')
    print(f"{'kernel':28s} {'registers':>9s} {'spill bytes':>11s} {'smem bytes':>10s}")
    for name, r in sorted(rows.items()):
        if args.match in name:
            print(f"{name:28s} {r.get('registers', '?'):>9s} {r.get('spills', '?'):>11s} "
                  f"{r.get('smem', '?'):>10s}")


if __name__ == '__main__':
    main()
