"""rt_llm_node: a small LLM inside a robot's control loop, on time or explicitly not."""

import os
import sys

# One BLAS thread: the numpy backend's matrices are small, and OpenBLAS's worker threads
# spin on the other cores between calls, starving the executor and the robot's other
# processes. A value set by the user wins. The variable works where numpy comes after this
# package; where the host program imported numpy first, it is applied to the loaded OpenBLAS.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
os.environ.setdefault('OMP_NUM_THREADS', '1')
if 'numpy' in sys.modules:
    from rt_llm_node._blas import limit_blas_threads
    limit_blas_threads()
