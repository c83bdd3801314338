"""One loader for every CUDA kernel: find the sources, compile them with NVRTC, load them.

The ``cuda/*.cu`` files become one NVRTC program per weight dtype (one translation unit, an
optimisation: every file includes the headers it uses and also compiles alone), each file
behind a ``#line 1`` directive so that compiler messages name the real file and line; the
``.cuh`` headers are handed to NVRTC by name. Options, and every launch-geometry constant
that Python also needs, are fixed here and nowhere else (``GEOMETRY``, passed as ``-D``).
Compilation needs only NVRTC (no driver, no GPU, no CUDA headers), so CI compiles every
kernel for sm_87 and sm_90; loading the result needs CuPy and a device.
"""

import os
from pathlib import Path
import sys

from rt_llm_node.files import MB
from rt_llm_node.files import read_bytes
from rt_llm_node.files import read_text
from rt_llm_node.files import write_atomic

WEIGHT_DTYPES = ('BF16', 'F16', 'F32')
MAX_CUBIN = 256 * MB       # a cached compiled program
COMMON = 'common.cuh'
# Launch geometry and device-state layout shared by the kernels and the backend: each is a
# -D option of every build and a Python constant of cuda_backend, from this one table.
GEOMETRY = {
    # the run state (common.cuh): token, start, n, mass_acc, flags are written by the host
    'STATE_TOKEN': 0, 'STATE_START': 1, 'STATE_N': 2, 'STATE_MASS_ACC': 3, 'STATE_FLAGS': 4,
    'STATE_RESULT': 5, 'STATE_COUNTER': 6,
    # matmul.cu: prefill tiles of T16_TOKENS tokens and T16_UNITS row pairs a block, each
    # warp loading T16_BATCH chunks of K together; staged one-token blocks
    'T16_TOKENS': 16, 'T16_UNITS': 16, 'T16_MAX_WARPS': 16, 'T16_BATCH': 1, 'SP_THREADS': 128,
    # and the verify rows' one-token matmuls (_tv): tokens a block (dev/cuda/sweep_tv.py)
    'VERIFY_NT': 4,
    # decode_persistent.cu: its block, and the cached keys of one attention work item
    'PD_THREADS': 256, 'PD_KEYS': 32,
    # attention.cu: most splits of the cache length one attention row merges (a weight each
    # in shared memory); the backend checks its capacity against it. A prefill's
    # attn_partial block of ATT_THREADS takes ATT_QTILE queries, their exps ATT_PQ floats a
    # key apart; an attn_mass block MASS_KEYS keys
    'ATT_MAX_SPLITS': 1024, 'ATT_QTILE': 16, 'ATT_PQ': 20, 'ATT_THREADS': 512, 'MASS_KEYS': 8,
    # qmatmul.cu: the most chunks a lane a unit of the two-deep one-token kernels (_d2)
    'QMV_DEEP_CPL': 2,
}
# Chunks of 8 weights a lane of a one-token matmul loads in one batch (-DMV_BATCH), and the
# blocks of 128 threads such a kernel must fit on one multiprocessor (-DMV_MIN_BLOCKS, its
# __launch_bounds__; caps its registers at 65536 / (128 * this)). Two 16-byte chunks
# (bf16, fp16) keep a _t1 kernel at 96 registers and five blocks an SM, which measured
# fastest on the H200 (docs/architecture.md, "CUDA decode step").
MV_BATCH = {'BF16': 2, 'F16': 2, 'F32': 1}
MV_MIN_BLOCKS = 1
ATT_MAX_SPLITS = GEOMETRY['ATT_MAX_SPLITS']
# Every kernel of the runtime's program, by file; get_function on each forces the module
# to load. A file added to cuda/ must be listed here (test_cuda_compile checks both ways).
KERNELS = {
    'embedding.cu': ('embed_gather',),
    'matmul.cu': ('matmul_residual_t1', 'matmul_residual_t16', 'matmul_residual_tv',
                  'matmul_store_t1', 'matmul_store_tv', 'matmul_swiglu_t1',
                  'matmul_swiglu_t16', 'matmul_swiglu_tv', 'matmul_qkv_rope_t1',
                  'matmul_qkv_rope_t16', 'matmul_qkv_rope_tv', 'matmul_residual_sp',
                  'matmul_swiglu_sp', 'matmul_qkv_rope_sp'),
    'attention.cu': ('attn_partial', 'attn_combine', 'attn_decode', 'attn_mass'),
    'argmax.cu': ('argmax_masked', 'argmax_rows'),
    'compact.cu': ('compact_gather', 'compact_store', 'kv_quantize'),
    'decode_persistent.cu': ('decode_persistent',),
    'decode_dataflow.cu': ('decode_dataflow',),
    'qmatmul.cu': tuple(f'{kind}_{fmt}{deep}' for fmt in ('i8', 'u4', 'i8h', 'u4h')
                        for kind, deeps in (
                            ('qmatvec_residual', ('', '_d2')), ('qmatvec_store', ('', '_d2')),
                            ('qmatvec_swiglu', ('', '_d2')), ('qmatvec_qkv_rope', ('', '_d2')),
                            ('qdequant', ('',)), ('qembed_gather', ('',)))
                        for deep in deeps),
}


def kernel_names():
    """Every kernel of the runtime's program."""
    return tuple(name for names in KERNELS.values() for name in names)


class KernelBuildError(RuntimeError):
    """NVRTC rejected the sources (the message holds its log) or they could not be found."""


def source_dir():
    """Return the folder holding the .cu files: $RT_LLM_CUDA_DIR, the source tree, or share/."""
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


def runtime_sources(folder=None):
    """Return the .cu files of the runtime's program, in KERNELS' order."""
    folder = Path(folder) if folder else source_dir()
    return [folder / name for name in KERNELS]


def headers(folder=None):
    """{name: text} of every .cuh header, handed to NVRTC for its #include lines."""
    folder = Path(folder) if folder else source_dir()
    return {path.name: read_text(path, 'kernel header') for path in sorted(folder.glob('*.cuh'))}


def program_source(files):
    """Return the .cu ``files`` as one translation unit, each behind a ``#line 1`` directive."""
    parts = []
    for path in map(Path, files):
        parts.append(f'#line 1 "{path.name}"')
        parts.append(read_text(path, 'kernel source'))
    return '\n'.join(parts) + '\n'


# No implicit multiply-add contraction: every product and sum is rounded as written (the
# kernels ask for fused multiply-adds explicitly, fmaf), so the same source gives the same
# bits in every kernel that inlines it, whatever the compiler schedules around it. A verify
# row (the _tv matmuls) must repeat a decode step (_t1) bit for bit: with contraction on,
# the RoPE epilogue's y0 * c - y1 * s fused differently in the two and rows differed by an
# ulp.
EXACT = ('--fmad=false',)


def task_format():
    """Return the dataflow step's task words as -D names (dataflow_plan.py's tables)."""
    from rt_llm_node.backends import dataflow_plan as plan
    names = {f'TASK_OP_{op.upper()}': i for i, op in enumerate(plan.TASK_OPS)}
    names.update({f'TASK_F_{f.upper()}': i for i, f in enumerate(plan.TASK_FIELDS)})
    return {**names, 'TASK_WORDS': plan.TASK_WORDS, 'TASK_CHUNK_KEYS': plan.ATTN_CHUNK_KEYS}


def compile_options(arch, weight_dtype, kv_int8=False):
    """NVRTC options for compute capability ``arch`` (e.g. 90), a weight dtype and the cache's.

    ``kv_int8``: the KV cache holds int8 codes with a scale per token and kv head
    (-DRT_KV_INT8), else fp32.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise KernelBuildError(f'no kernels for weight dtype {weight_dtype!r}')
    defines = [f'-D{name}={value}' for name, value in {**GEOMETRY, **task_format()}.items()]
    return [f'--gpu-architecture=sm_{arch}', '--std=c++17', f'-DRT_WEIGHT_{weight_dtype}',
            *defines, f'-DMV_BATCH={MV_BATCH[weight_dtype]}',
            f'-DMV_MIN_BLOCKS={MV_MIN_BLOCKS}', *(['-DRT_KV_INT8'] if kv_int8 else []),
            '--restrict', '-lineinfo', *EXACT]


def compile_cubin(arch, weight_dtype, files=None, folder=None, kv_int8=False):
    """Compile ``files`` with NVRTC; return (cubin bytes, NVRTC log).

    ``files`` default to the runtime's program, the headers come from ``folder`` (default:
    ``source_dir()``). Raises KernelBuildError.
    """
    from cupy_backends.cuda.libs import nvrtc
    folder = Path(folder) if folder else source_dir()
    source = program_source(files or runtime_sources(folder))
    included = headers(folder)
    program = nvrtc.createProgram(source, 'rt_llm_kernels.cu',
                                  [text.encode() for text in included.values()],
                                  [name.encode() for name in included])
    try:
        try:
            nvrtc.compileProgram(program, compile_options(arch, weight_dtype, kv_int8))
        except nvrtc.NVRTCError as exc:
            raise KernelBuildError(f'NVRTC failed for sm_{arch} {weight_dtype}: {exc}\n'
                                   + nvrtc.getProgramLog(program)) from None
        log = nvrtc.getProgramLog(program).strip()
        return nvrtc.getCUBIN(program), log
    finally:
        nvrtc.destroyProgram(program)


def kernel_cache_dir():
    """Where compiled kernels are kept.

    $RT_LLM_KERNEL_CACHE ('' or 'off': nowhere), else $XDG_CACHE_HOME/rt_llm_node/kernels (~/.cache
    by default).
    """
    value = os.environ.get('RT_LLM_KERNEL_CACHE')
    if value is not None:
        return None if value.strip() in ('', 'off') else Path(value)
    base = os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
    return Path(base) / 'rt_llm_node' / 'kernels'


def cached_cubin(arch, weight_dtype, files=None, folder=None, cache_dir=False, kv_int8=False):
    """Compile the kernels once per build and device, cached on disk.

    ``compile_cubin``'s (cubin, log), kept on disk under a hash of the sources, the options and
    NVRTC's version: configure compiles once per build and device (about 10-30 s of NVRTC on one
    core), not on every start. ``cache_dir``: a folder, None for no cache, False (default) for
    ``kernel_cache_dir()``. A cache that cannot be read or written is passed over: the kernels are
    compiled as without one; a damaged entry (checked by its digest) is compiled again and
    replaced.
    """
    import hashlib
    from cupy_backends.cuda.libs import nvrtc
    if cache_dir is False:
        cache_dir = kernel_cache_dir()
    if cache_dir is None:
        return compile_cubin(arch, weight_dtype, files, folder, kv_int8)
    folder = Path(folder) if folder else source_dir()
    key = hashlib.sha256('\0'.join([
        program_source(files or runtime_sources(folder)), *headers(folder).values(),
        *compile_options(arch, weight_dtype, kv_int8),
        repr(nvrtc.getVersion())]).encode()).hexdigest()
    path = Path(cache_dir) / f'{key}.cubin'
    try:
        blob = read_bytes(path, 'cached kernels', MAX_CUBIN)
        digest, size = blob[:32], int.from_bytes(blob[32:40], 'little')
        cubin, log = blob[40:40 + size], blob[40 + size:].decode()
        if hashlib.sha256(blob[32:]).digest() == digest and len(cubin) == size:
            return cubin, log
    except (OSError, ValueError, UnicodeDecodeError):   # FileError included: compile anew
        pass
    cubin, log = compile_cubin(arch, weight_dtype, files, folder, kv_int8)
    body = len(cubin).to_bytes(8, 'little') + cubin + log.encode()
    try:   # atomic: a concurrent reader sees the old entry or the new
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, hashlib.sha256(body).digest() + body, 'cached kernels')
    except OSError:   # FileError included: the cache is an optimization
        pass
    return cubin, log


class KernelSet:
    """The loaded module for one device and weight dtype; ``k.name`` is a kernel.

    By default the runtime's program; benchmarks and studies pass their own ``files`` and
    ``names`` (compiled with the same options and headers).
    """

    def __init__(self, weight_dtype, device_id=0, files=None, names=None, kv_int8=False):
        import cupy
        device = cupy.cuda.Device(device_id)
        self.arch = int(device.compute_capability)  # '90' on Hopper, '87' on Orin
        self.cubin, self.log = cached_cubin(self.arch, weight_dtype, files, kv_int8=kv_int8)
        self.module = cupy.cuda.function.Module()
        self.module.load(self.cubin)
        self.functions = {name: self.module.get_function(name)
                          for name in (names or kernel_names())}

    def __getattr__(self, name):
        try:
            return self.__dict__['functions'][name]
        except KeyError:
            raise AttributeError(name) from None


# -- programmatic dependent launch (Hopper and later) ---------------------------------
# CuPy launches through cuLaunchKernel, which takes no launch attributes; this calls the
# driver's cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so
# the next kernel's blocks start (and load their weights) while this one finishes. The
# kernels pair it with griddepcontrol.wait before they read what the previous one wrote
# (pdl_wait_then_release in common.cuh). Stream capture keeps it as a programmatic edge.
COOPERATIVE = 2                         # CUlaunchAttributeID, cuda.h
PROGRAMMATIC_STREAM_SERIALIZATION = 6


def _launch_structs():
    import ctypes

    class Value(ctypes.Union):
        _fields_ = [('pad', ctypes.c_char * 64), ('i', ctypes.c_int), ('align', ctypes.c_void_p)]

    class Attribute(ctypes.Structure):
        _fields_ = [('id', ctypes.c_uint), ('pad', ctypes.c_char * 4), ('value', Value)]

    class Config(ctypes.Structure):
        _fields_ = [('grid', ctypes.c_uint * 3), ('block', ctypes.c_uint * 3),
                    ('shared', ctypes.c_uint), ('stream', ctypes.c_void_p),
                    ('attrs', ctypes.POINTER(Attribute)), ('n_attrs', ctypes.c_uint)]
    return Attribute, Config


def _kernel_argument(value):
    """Return a kernel argument as the ctypes value whose address cuLaunchKernelEx reads."""
    import ctypes
    import numpy as np
    if hasattr(value, 'data') and hasattr(value.data, 'ptr'):   # a CuPy array
        return ctypes.c_uint64(value.data.ptr)
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    if isinstance(value, np.uint64):
        return ctypes.c_uint64(int(value))
    raise TypeError(f'kernel argument of type {type(value).__name__}: pass a CuPy array, '
                    'np.int32, np.float32 or np.uint64')


class LaunchWithAttribute:
    """Launch a kernel through cuLaunchKernelEx with one integer launch attribute set to 1."""

    def __init__(self, attribute_id):
        import ctypes
        self._ctypes = ctypes
        self._attribute_type, self._config_type = _launch_structs()
        driver = ctypes.CDLL('libcuda.so.1')
        self._launch = driver.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(self._config_type), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._attribute = self._attribute_type(id=attribute_id)
        self._attribute.value.i = 1

    def __call__(self, function, grid, block, args, shared_mem, stream):
        ctypes = self._ctypes
        values = [_kernel_argument(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        config = self._config_type((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block),
                                   int(shared_mem), ctypes.c_void_p(stream.ptr),
                                   ctypes.pointer(self._attribute), 1)
        status = self._launch(ctypes.byref(config), ctypes.c_void_p(function.ptr), params, None)
        if status != 0:
            from cupy_backends.cuda.api.driver import CUDADriverError
            raise CUDADriverError(status)


class DependentLauncher(LaunchWithAttribute):
    """Launch a kernel with programmatic dependent launch allowed on its stream."""

    def __init__(self):
        super().__init__(PROGRAMMATIC_STREAM_SERIALIZATION)


class CooperativeLauncher(LaunchWithAttribute):
    """Launch a kernel cooperatively.

    The driver refuses a grid whose blocks cannot all be resident at once (the persistent kernels'
    grid_sync needs that), also in a graph.
    """

    def __init__(self):
        super().__init__(COOPERATIVE)
