# The two commands the README opens with:
#   make demo   set up (a virtualenv with the project) and run the scripted tour
#   make test   lint, types, the whole test suite and a bounded fuzz run
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
FUZZ_RUNS ?= 20000
FUZZ_RUNS_SLOW ?= 800

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
	$(BIN)/mypy proxycore netns appliance

unit: install
	$(BIN)/python -m pytest

# Each harness runs for a bounded number of executions (CI). The request-path harness runs a
# whole proxy exchange per input (~40/s), so it gets fewer. Longer runs: see fuzz/README.md.
fuzz-smoke: install
	@for harness in fuzz/fuzz_*.py; do \
		runs=$(FUZZ_RUNS); \
		case $$harness in *request_path*) runs=$(FUZZ_RUNS_SLOW);; esac; \
		echo "fuzz: $$harness ($$runs runs)"; \
		log=$$(mktemp); \
		$(BIN)/python $$harness -runs=$$runs -max_len=4096 >$$log 2>&1 \
			|| { tail -n 40 $$log; exit 1; }; \
		grep -E '^Done [0-9]+ runs' $$log; \
	done

bench: install
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build *.egg-info
