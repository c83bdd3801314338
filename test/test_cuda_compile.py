"""Every kernel compiles with NVRTC for Jetson Orin (sm_87) and Hopper (sm_90): no GPU needed."""

import pytest

nvrtc = pytest.importorskip('cupy_backends.cuda.libs.nvrtc',
                            reason='CuPy (for its NVRTC bindings) is not installed')

from rt_llm_node.backends.cuda_kernels import compile_cubin  # noqa: E402
from rt_llm_node.backends.cuda_kernels import KernelBuildError  # noqa: E402
from rt_llm_node.backends.cuda_kernels import KERNELS  # noqa: E402
from rt_llm_node.backends.cuda_kernels import program_source  # noqa: E402
from rt_llm_node.backends.cuda_kernels import WEIGHT_DTYPES  # noqa: E402


@pytest.mark.parametrize('arch', [87, 90])
@pytest.mark.parametrize('dtype', WEIGHT_DTYPES)
def test_kernels_compile_without_warnings(arch, dtype):
    cubin, log = compile_cubin(arch, dtype)
    assert log == '', f'NVRTC printed for sm_{arch} {dtype}:\n{log}'
    assert len(cubin) > 10000
    for name in KERNELS:  # every kernel the backend launches is in the binary
        assert name.encode() in cubin, name


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


def test_program_source_inlines_the_common_header_once():
    source = program_source()
    assert source.count('#line 1 "common.cuh"') == 1
    assert '#include "common.cuh"' not in source
