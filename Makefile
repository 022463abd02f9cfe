# retrofitter: `make demo` runs the main job on the default model; `make test` runs the test suite.
# Both create/refresh a local virtual environment in .venv with pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build of torch from the local wheel; pinned so pip never pulls a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not real_model"

demo: venv
	$(PY) -m retrofitter demo --out runs/demo

clean:
	rm -rf $(VENV) runs .pytest_cache
