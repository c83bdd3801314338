"""Every kernel compiles with NVRTC for Jetson Orin (sm_87) and Hopper (sm_90): no GPU needed."""

import pytest

nvrtc = pytest.importorskip('cupy_backends.cuda.libs.nvrtc',
                            reason='CuPy (for its NVRTC bindings) is not installed')

import re  # noqa: E402,I100

import nvrtc_programs  # noqa: E402

from rt_llm_node.backends.cuda_kernels import compile_cubin  # noqa: E402,I100
from rt_llm_node.backends.cuda_kernels import kernel_names  # noqa: E402
from rt_llm_node.backends.cuda_kernels import KernelBuildError  # noqa: E402
from rt_llm_node.backends.cuda_kernels import KERNELS  # noqa: E402
from rt_llm_node.backends.cuda_kernels import program_source  # noqa: E402
from rt_llm_node.backends.cuda_kernels import runtime_sources  # noqa: E402
from rt_llm_node.backends.cuda_kernels import source_dir  # noqa: E402
from rt_llm_node.backends.cuda_kernels import WEIGHT_DTYPES  # noqa: E402

from conftest import compiled_programs  # noqa: E402,I100


ARCHS = nvrtc_programs.ARCHS


@pytest.fixture(scope='module')
def programs(request):
    """Return every (arch, weight dtype, int8 KV) program.

    From the compile the session started in the background (conftest.py), else compiled here
    on all the cores.
    """
    return compiled_programs(request.config) or nvrtc_programs.compile_all()


@pytest.mark.parametrize('kv_int8', [False, True], ids=['kv_fp32', 'kv_int8'])
@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('dtype', WEIGHT_DTYPES)
def test_kernels_compile_without_warnings(programs, arch, dtype, kv_int8):
    built = programs[(arch, dtype, kv_int8)]
    if isinstance(built, KernelBuildError):
        pytest.fail(str(built))
    cubin, log = built
    assert log == '', f'NVRTC printed for sm_{arch} {dtype}:\n{log}'
    assert len(cubin) > 10000
    for name in kernel_names():  # every kernel the backend launches is in the binary
        assert name.encode() in cubin, name


def front_end_errors(path, arch, dtype, kv_int8, folder=None):
    """Run NVRTC's front end alone on one .cu (no code generated); return its log, '' if clean."""
    from rt_llm_node.backends.cuda_kernels import compile_options
    from rt_llm_node.backends.cuda_kernels import headers
    included = headers(folder)
    program = nvrtc.createProgram(program_source([path]), 'one_file.cu',
                                  [text.encode() for text in included.values()],
                                  [name.encode() for name in included])
    try:
        try:
            nvrtc.compileProgram(program, [*compile_options(arch, dtype, kv_int8),
                                           '--fdevice-syntax-only'])
        except nvrtc.NVRTCError:
            return nvrtc.getProgramLog(program) or 'NVRTC failed without a log'
        return nvrtc.getProgramLog(program).strip()
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize('name', sorted(KERNELS))
def test_every_file_compiles_on_its_own(name):
    """Each .cu includes the headers it uses, for every arch, weight dtype and cache.

    The one translation unit is an optimisation, and no file depends on the order in which the
    loader joins them. The front end alone decides this (what it declares and includes); the
    programs above run the whole compile.
    """
    for arch in ARCHS:
        for dtype in WEIGHT_DTYPES:
            for kv_int8 in (False, True):
                log = front_end_errors(source_dir() / name, arch, dtype, kv_int8)
                assert log == '', (arch, dtype, kv_int8, log)


def test_the_file_check_sees_a_missing_include(tmp_path):
    import shutil
    for path in source_dir().iterdir():
        shutil.copy(path, tmp_path / path.name)
    bare = tmp_path / 'argmax.cu'   # it includes common.cuh alone
    bare.write_text(bare.read_text().replace('#include "common.cuh"\n', ''))
    assert '#include' not in bare.read_text()
    assert 'error' in front_end_errors(bare, 90, 'BF16', False, folder=tmp_path)


def test_the_kernel_table_lists_every_file_and_wrapper():
    """KERNELS names every .cu of cuda/ and every extern "C" kernel each defines."""
    folder = source_dir()
    assert sorted(p.name for p in folder.glob('*.cu')) == sorted(KERNELS)
    for name, kernels in KERNELS.items():
        text = (folder / name).read_text()
        defined = set(re.findall(r'extern "C" __global__ void(?: \w+(?:\([^)]*\))?)?\s+'
                                 r'(\w+)\(', text))
        defined |= set(re.findall(r'^(?:MATMUL|QMATVEC|QDEQUANT|QEMBED)_\w+\((\w+),', text,
                                  re.M))
        assert defined == set(kernels), name


def test_compile_errors_name_the_real_file_and_line(tmp_path):
    import shutil
    from rt_llm_node.backends.cuda_kernels import source_dir
    for path in source_dir().iterdir():
        shutil.copy(path, tmp_path / path.name)
    broken = tmp_path / 'argmax.cu'
    lines = broken.read_text().splitlines()
    lines.insert(20, 'this is not CUDA;')
    broken.write_text('\n'.join(lines))
    with pytest.raises(KernelBuildError) as error:
        compile_cubin(90, 'BF16', folder=tmp_path)
    assert 'argmax.cu(21)' in str(error.value)


def test_program_source_marks_each_file_once_and_leaves_headers_to_nvrtc():
    source = program_source(runtime_sources())
    for name in KERNELS:
        assert source.count(f'#line 1 "{name}"') == 1
    assert '#line 1 "common.cuh"' not in source   # headers come by #include


@pytest.mark.parametrize('units,k,mv_batch,expected', [
    (480, 576, 8, 2),      # SmolLM2 qkv: 120 blocks would leave SMs idle
    (768, 576, 8, 1),      # SmolLM2 gate/up: enough blocks, one batch
    (448, 4864, 8, 4),     # Qwen2.5 down: 608 chunks, one batch each only split 4 ways
    (1024, 8192, 8, 4),    # Llama-3.2 down: 1024 chunks -> 256 a warp
    (1024, 2048, 8, 1),    # Llama-3.2 o: one batch, 256 blocks
    (64128, 2048, 8, 1),   # an LM head
    (20, 64, 8, 1),        # a warp's share would be under 32 chunks
    (20, 36, 8, 1),        # scalar path: 36 weights
    # the shipped batch for 16-bit weights (MV_BATCH 2: 64 chunks a warp in one batch)
    (8192, 2048, 2, 4),    # Llama-3.2 gate/up: 256 chunks a row, 4 warps a row pair
    (24576, 576, 2, 2),    # SmolLM2 LM head: 72 chunks, split while a share is >= 32
    (768, 576, 2, 2),
])
def test_matvec_split(units, k, mv_batch, expected):
    from rt_llm_node.backends.cuda_backend import matvec_split
    assert matvec_split(units, k, mv_batch, n_sm=132) == expected


@pytest.mark.parametrize('units,k,wbytes,expected', [
    (480, 576, 2, (120, 4, 4 * 2 * 576 * 2 + 576 * 2 + 576 * 4)),   # SmolLM2 qkv
    (1536, 576, 2, (128, 12, 25 * 576 * 2 + 576 * 4)),   # SmolLM2 gate/up: 12 units a block
    (4864, 896, 2, (256, 19, 39 * 896 * 2 + 896 * 4)),   # Qwen2.5 gate/up: two an SM
    (1536, 2048, 2, (256, 6, 13 * 2048 * 2 + 2048 * 4)),   # Llama-3.2 qkv: two an SM
    (8192, 2048, 2, None),   # Llama-3.2 gate/up: 31 units a block at two an SM, 254 KB
    (1024, 8192, 2, None),   # Llama-3.2 down: K 8192, even 4 units a block are 147 KB
    (1536, 576, 4, (128, 12, 25 * 576 * 4 + 576 * 4)),   # fp32 weights: twice the bytes
    (24, 36, 2, None),       # K not a multiple of 8: no 16-byte copies
])
def test_staged_plan(units, k, wbytes, expected):
    """Blocks, units a block and the shared memory that matmul.cu's staged_body lays out.

    2 rows a unit and the norm weights in the weight dtype, xhat in fp32.
    """
    from rt_llm_node.backends.cuda_backend import staged_plan
    assert staged_plan(units, k, wbytes, n_sm=132) == expected


@pytest.mark.parametrize('units,chunks,resident,expected', [
    (1024, 512, 1, (128, 2)),    # Llama-3.2 down, i8: 2048 warps fit 132 SMs x 16
    (1024, 256, 1, (128, 2)),    # the same in u4 (32 columns a chunk)
    (1024, 128, 1, (128, 2)),    # Llama-3.2 o
    (1536, 128, 1, (96, 1)),     # Llama-3.2 qkv: 3072 warps would not all be resident
    (8192, 128, 1, (132, 1)),    # Llama-3.2 gate/up: more units than warps, grid-stride
    (448, 304, 1, (112, 4)),     # Qwen2.5 down: 76 chunks a quarter, 1792 warps
    (288, 36, 1, (18, 1)),       # SmolLM2 o: a half of 36 chunks is under a lane's 32
    (1024, 512, 2, (256, 4)),    # two blocks an SM: room for 4096 warps
])
def test_qmatvec_plan(units, chunks, resident, expected):
    """Grid and K split of qmatmul.cu's one-token kernels in blocks of 512 threads."""
    from rt_llm_node.backends.cuda_backend import qmatvec_plan
    assert qmatvec_plan(units, chunks, 132, resident, 512) == expected


@pytest.mark.parametrize('units,chunks,expected', [
    (8192, 128, (132, 1, 512)),   # Llama-3.2 gate/up, i8: large blocks fill every SM
    (1536, 128, (96, 1, 512)),    # Llama-3.2 qkv: 96 SMs of 132 stream
    (480, 36, (120, 1, 128)),     # SmolLM2 qkv: 30 blocks of 512, 60 of 256, 120 of 128
    (288, 96, (72, 2, 256)),      # SmolLM2 down, i8: split in two, 36 blocks of 512
    (24576, 36, (132, 1, 512)),   # SmolLM2 LM head
])
def test_qmatvec_geometry(units, chunks, expected):
    """The block size of a one-token quantized matmul: the largest that fills half the SMs."""
    from rt_llm_node.backends.cuda_backend import qmatvec_geometry

    def resident(threads):   # 96 registers a thread
        return 65536 // (96 * threads)
    assert qmatvec_geometry(units, chunks, 132, resident) == expected


@pytest.mark.parametrize('units,chunks,n_sm,expected', [
    (8192, 64, 132, ('q_d2', 132, 1, 512)),    # Llama-3.2 gate/up, u4: 4 units a warp
    (64128, 64, 132, ('q_d2', 132, 1, 512)),   # its LM head
    (4864, 28, 132, ('q_d2', 132, 1, 512)),    # Qwen2.5 gate/up, u4: one chunk a lane
    (8192, 128, 132, ('q', 132, 1, 512)),      # Llama-3.2 gate/up, i8: 4 chunks a lane
    (1024, 256, 132, ('q', 128, 2, 512)),      # Llama-3.2 down, u4: 4 chunks a lane
    (1536, 64, 132, ('q', 96, 1, 512)),        # Llama-3.2 qkv: one unit a warp
    (1536, 64, 16, ('q_d2', 16, 1, 512)),      # ... on 16 SMs (Jetson AGX Orin): six
])
def test_qmatvec_launch_takes_two_deep_kernels_where_warps_take_several_units(
        units, chunks, n_sm, expected):
    from rt_llm_node.backends.cuda_backend import qmatvec_launch

    def resident(kernel, threads):   # 128 registers a thread (_d2), else 96
        return 65536 // ((128 if kernel.endswith('_d2') else 96) * threads)
    assert qmatvec_launch('q', units, chunks, n_sm, resident) == expected


@pytest.mark.parametrize('bad', [{'decode_step': 'ring'}, {'decode_step': None},
                                 {'dependent_launch': 'yes'}, {'staged_decode': 1.5}])
def test_cuda_options_refuse_nonsense(bad):
    from rt_llm_node.backends.cuda_backend import CudaOptions
    with pytest.raises(ValueError):
        CudaOptions(**bad)


def test_compiled_kernels_are_kept_by_source_and_options(tmp_path, monkeypatch):
    """cached_cubin compiles once per sources, options and NVRTC.

    A damaged entry is compiled again; an unwritable cache only costs the compile. Real NVRTC
    throughout, on a one-kernel program so that it stays quick.
    """
    from rt_llm_node.backends import cuda_kernels
    src = tmp_path / 'src'
    src.mkdir()
    (src / 'common.cuh').write_text('#pragma once\n')
    (src / 'tiny.cu').write_text('#include "common.cuh"\n'
                                 'extern "C" __global__ void twice(float* x) '
                                 '{ x[threadIdx.x] *= 2.f; }\n')
    tiny = [src / 'tiny.cu']
    compiled = []
    real = cuda_kernels.compile_cubin

    def counting(*args):
        compiled.append(args)
        return real(*args)

    monkeypatch.setattr(cuda_kernels, 'compile_cubin', counting)
    cache = tmp_path / 'cache'
    first = cuda_kernels.cached_cubin(90, 'BF16', tiny, src, cache)
    assert len(compiled) == 1 and b'twice' in first[0]
    assert cuda_kernels.cached_cubin(90, 'BF16', tiny, src, cache) == first and len(compiled) == 1
    # other options or other sources: another entry
    cuda_kernels.cached_cubin(87, 'BF16', tiny, src, cache)
    cuda_kernels.cached_cubin(90, 'F16', tiny, src, cache)
    assert len(compiled) == 3 and len(list(cache.glob('*.cubin'))) == 3
    (src / 'tiny.cu').write_text((src / 'tiny.cu').read_text().replace('2.f', '3.f'))
    cuda_kernels.cached_cubin(90, 'BF16', tiny, src, cache)
    assert len(compiled) == 4
    # a damaged entry is compiled again and replaced
    entry = max(cache.glob('*.cubin'), key=lambda p: p.stat().st_mtime_ns)
    entry.write_bytes(entry.read_bytes()[:100])
    again = cuda_kernels.cached_cubin(90, 'BF16', tiny, src, cache)
    assert len(compiled) == 5 and b'twice' in again[0]
    assert cuda_kernels.cached_cubin(90, 'BF16', tiny, src, cache) == again and len(compiled) == 5
    # no cache (None, or RT_LLM_KERNEL_CACHE=off), or one that cannot be written: compiled
    assert cuda_kernels.cached_cubin(90, 'BF16', tiny, src, None)[0] == again[0]
    blocked = tmp_path / 'file'
    blocked.write_text('not a folder')
    assert cuda_kernels.cached_cubin(90, 'BF16', tiny, src, blocked / 'cache')[0] == again[0]
    assert len(compiled) == 7
    monkeypatch.setenv('RT_LLM_KERNEL_CACHE', 'off')
    assert cuda_kernels.kernel_cache_dir() is None
    monkeypatch.setenv('RT_LLM_KERNEL_CACHE', str(cache))
    assert cuda_kernels.kernel_cache_dir() == cache
