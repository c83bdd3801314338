"""One BLAS thread also where the host program loaded numpy before this package.

``OPENBLAS_NUM_THREADS`` is read once, when OpenBLAS loads: a program that imported numpy
first (a test runner, a launch script, a message package) leaves OpenBLAS with a thread a
core, whose workers spin between the numpy backend's small matrix products and take the
cores from the executor and from each other (rt-llm-eval, 2 workers on 2 cores: 63 s
against 7 s). Here the variable's value is applied to the OpenBLAS already loaded, through
its own setter, as threadpoolctl does.
"""

import ctypes
import os

# the setter's name in OpenBLAS builds: plain, 64-bit integer, and numpy's scipy-openblas
SETTERS = ('openblas_set_num_threads', 'openblas_set_num_threads64_',
           'scipy_openblas_set_num_threads', 'scipy_openblas_set_num_threads64_')
GETTERS = tuple(name.replace('_set_', '_get_') for name in SETTERS)


# where an OpenBLAS comes from: numpy's wheels bundle one beside the package (numpy.libs);
# a distribution's numpy links the system's, by these sonames (libblas.so.3 through the
# alternatives where OpenBLAS provides it)
SONAMES = ('libopenblas.so.0', 'libopenblasp.so.0', 'libopenblas64_.so.0', 'libblas.so.3',
           'libcblas.so.3')


def _candidates():
    """Return numpy's bundled OpenBLAS files, then the system sonames."""
    import glob
    import importlib.util
    spec = importlib.util.find_spec('numpy')
    bundled = []
    if spec is not None and spec.origin:
        site = os.path.dirname(os.path.dirname(spec.origin))
        bundled = sorted(glob.glob(os.path.join(site, 'numpy.libs', '*openblas*.so*')))
    return [*bundled, *SONAMES]


def _functions(names):
    """Yield the first of ``names`` each loaded OpenBLAS exports.

    A library is only looked up where the process has already loaded it (RTLD_NOLOAD):
    nothing is loaded and no file is read here.
    """
    if not hasattr(os, 'RTLD_NOLOAD'):
        return   # no way to look a library up without loading it
    mode = os.RTLD_NOLOAD | os.RTLD_LAZY
    seen = set()
    for name in _candidates():
        try:
            library = ctypes.CDLL(name, mode=mode)
        except OSError:
            continue   # not loaded
        if library._handle in seen:
            continue
        seen.add(library._handle)
        for symbol in names:
            function = getattr(library, symbol, None)
            if function is not None:
                yield function
                break


def limit_blas_threads():
    """Apply OPENBLAS_NUM_THREADS (a positive integer) to every OpenBLAS already loaded.

    Returns how many libraries took it; 0 where the variable is unset or not a count.
    """
    try:
        threads = int(os.environ.get('OPENBLAS_NUM_THREADS', ''))
    except ValueError:
        return 0
    if threads < 1:
        return 0
    done = 0
    for setter in _functions(SETTERS):
        setter.argtypes = [ctypes.c_int]
        setter(threads)
        done += 1
    return done


def blas_threads():
    """Return the thread count of each loaded OpenBLAS (for tests and diagnostics)."""
    counts = []
    for getter in _functions(GETTERS):
        getter.restype = ctypes.c_int
        counts.append(getter())
    return counts
