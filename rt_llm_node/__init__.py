"""rt_llm_node: a small LLM inside a robot's control loop, on time or explicitly not."""

import os

# One BLAS thread: the numpy backend's matrices are small, and OpenBLAS's worker threads
# spin on the other cores between calls, starving the executor and the robot's other
# processes. Set before numpy is first imported; a value set by the user wins.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
os.environ.setdefault('OMP_NUM_THREADS', '1')
