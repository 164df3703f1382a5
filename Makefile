# The two commands the README opens with:
#   make demo   set up (a virtualenv with the project) and run the scripted tour
#   make test   lint, types, the whole test suite and a bounded fuzz run
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
FUZZ_RUNS ?= 20000

.PHONY: demo test install lint types unit fuzz-smoke bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: install
	$(BIN)/appliancectl demo

test: install lint types unit fuzz-smoke

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: install
	$(BIN)/mypy proxycore appliance

unit: install
	$(BIN)/python -m pytest

# Each harness runs for a bounded number of executions (CI); longer runs: see fuzz/README.md.
fuzz-smoke: install
	@for harness in fuzz/fuzz_*.py; do \
		echo "fuzz: $$harness ($(FUZZ_RUNS) runs)"; \
		$(BIN)/python $$harness -runs=$(FUZZ_RUNS) -max_len=4096 >/tmp/fuzz-$$(basename $$harness).log 2>&1 \
			|| { tail -n 40 /tmp/fuzz-$$(basename $$harness).log; exit 1; }; \
	done

bench: install
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build *.egg-info
