"""One loader for every CUDA kernel: find the sources, compile them with NVRTC, load them.

All ``cuda/*.cu`` files (and ``common.cuh``, inlined once) become one NVRTC program per
weight dtype, with ``#line`` directives so that compiler messages name the real file and
line. Options are fixed here and nowhere else. Compilation needs only NVRTC (no driver,
no GPU, no CUDA headers), so CI compiles every kernel for sm_87 and sm_90; loading the
result needs CuPy and a device.
"""

import os
from pathlib import Path
import sys

WEIGHT_DTYPES = ('BF16', 'F16', 'F32')
COMMON = 'common.cuh'
# Every kernel the backend launches; get_function on each forces the module to load.
KERNELS = (
    'embed_gather',
    'matmul_residual_t1', 'matmul_residual_t16', 'matmul_store_t1',
    'matmul_swiglu_t1', 'matmul_swiglu_t16', 'matmul_qkv_rope_t1', 'matmul_qkv_rope_t16',
    'attn_partial', 'attn_combine', 'attn_decode', 'attn_mass',
    'argmax_masked',
    'compact_gather', 'compact_store',
    'read_sum',
)


class KernelBuildError(RuntimeError):
    """NVRTC rejected the sources (the message holds its log) or they could not be found."""


def source_dir():
    """The folder holding the .cu files: $RT_LLM_CUDA_DIR, the source tree, or share/."""
    candidates = []
    if os.environ.get('RT_LLM_CUDA_DIR'):
        candidates.append(Path(os.environ['RT_LLM_CUDA_DIR']))
    candidates.append(Path(__file__).resolve().parents[2] / 'cuda')
    candidates.append(Path(sys.prefix) / 'share' / 'rt_llm_node' / 'cuda')
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory('rt_llm_node')) / 'cuda')
    except Exception:  # not a ROS install, or the package is not in the index
        pass
    for folder in candidates:
        if (folder / COMMON).is_file():
            return folder
    raise KernelBuildError('CUDA kernel sources not found; looked in '
                           + ', '.join(str(c) for c in candidates))


def program_source(folder=None):
    """All kernels as one translation unit, each file behind a ``#line 1`` directive."""
    folder = Path(folder) if folder else source_dir()
    parts = []
    for path in [folder / COMMON] + sorted(folder.glob('*.cu')):
        lines = path.read_text().splitlines()
        body = [('' if line.strip() in ('#include "common.cuh"', '#pragma once') else line)
                for line in lines]
        parts.append(f'#line 1 "{path.name}"')
        parts.extend(body)
    return '\n'.join(parts) + '\n'


def compile_options(arch, weight_dtype):
    """NVRTC options for compute capability ``arch`` (e.g. 90) and a weight dtype."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise KernelBuildError(f'no kernels for weight dtype {weight_dtype!r}')
    return [f'--gpu-architecture=sm_{arch}', '--std=c++17', f'-DRT_WEIGHT_{weight_dtype}',
            '--restrict', '-lineinfo']


def compile_cubin(arch, weight_dtype, folder=None):
    """Compile every kernel; return (cubin bytes, NVRTC log). Raises KernelBuildError."""
    from cupy_backends.cuda.libs import nvrtc
    source = program_source(folder)
    program = nvrtc.createProgram(source, 'rt_llm_kernels.cu', [], [])
    try:
        try:
            nvrtc.compileProgram(program, compile_options(arch, weight_dtype))
        except nvrtc.NVRTCError as exc:
            raise KernelBuildError(f'NVRTC failed for sm_{arch} {weight_dtype}: {exc}\n'
                                   + nvrtc.getProgramLog(program)) from None
        log = nvrtc.getProgramLog(program).strip()
        return nvrtc.getCUBIN(program), log
    finally:
        nvrtc.destroyProgram(program)


class KernelSet:
    """The loaded module for one device and weight dtype; ``k.name`` is a kernel."""

    def __init__(self, weight_dtype, device_id=0):
        import cupy
        device = cupy.cuda.Device(device_id)
        self.arch = int(device.compute_capability)  # '90' on Hopper, '87' on Orin
        self.cubin, self.log = compile_cubin(self.arch, weight_dtype)
        self.module = cupy.cuda.function.Module()
        self.module.load(self.cubin)
        self.functions = {name: self.module.get_function(name) for name in KERNELS}

    def __getattr__(self, name):
        try:
            return self.__dict__['functions'][name]
        except KeyError:
            raise AttributeError(name) from None
