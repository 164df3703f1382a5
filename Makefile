# The two commands the README opens with:
#   make demo   set this host up (scripts/install: Debian packages, a virtualenv with the
#               project's runtime dependencies only, dockerd, runsc, the images), then the tour
#   make test   lint, types, the whole test suite, bounded fuzz runs, the C under ASan+UBSan
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PYTHON VENV
# The tour needs root (the engine, network namespaces, nftables); scripts/install asks sudo itself.
AS_ROOT := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# A smoke run in CI, whose whole run must stay under 30 minutes (28 on this machine with the
# provisioning test); longer campaigns: FUZZ_RUNS=N. The suite's fuzz regression tests replay
# every crash found so far on each run.
FUZZ_RUNS ?= 5000
FUZZ_RUNS_SLOW ?= 400
# The scrubber's harnesses run the Python reference on every input (~150 inputs a second).
FUZZ_RUNS_SCRUB ?= 2500
# The scrubber's differential harness runs the Python reference on every input, about 30 inputs a
# second under the sanitizers (Python's allocations go through ASan's): fewer runs there.
FUZZ_RUNS_SANITIZE_SCRUB ?= 1000
# The fold matcher's harness (the reference decodes every pending byte on every feed): about 25
# inputs a second under the sanitizers.
FUZZ_RUNS_SANITIZE_FOLD ?= 300

NATIVE_SRC := $(wildcard native/src/*.c native/src/*.h) native/_build_headscan.py \
	native/_build_scrub.py native/_build_fold.py
NATIVE_LIB := native/.built

.PHONY: demo setup engine images test install native native-sanitize lint types unit fuzz-smoke bench clean dist wheel-check

install: $(VENV)/.installed $(NATIVE_LIB)

# The virtualenv with the development dependencies (no root needed for this step).
$(VENV)/.installed: pyproject.toml setup.py
	scripts/install --dev --only venv
	touch $@

# The C extensions, in place (an editable install does not rebuild them when the C changes).
native: $(NATIVE_LIB)
$(NATIVE_LIB): $(VENV)/.installed $(NATIVE_SRC)
	$(BIN)/python -m native.build
	touch $@

# Everything `make demo` sets up, and no tour.
setup:
	scripts/install

# A Docker engine answering on /var/run/docker.sock, runsc registered: started when nothing
# answers (machines without an init system: development, CI). An operator's host runs its own.
engine: install
	scripts/install --only engine

# The base, infra and agent images, built locally (debootstrap, npm, docker import); a tag that
# already exists for the recipe's hash is a cache hit. See images/README.md.
images: install engine
	scripts/install --only images

# One script sets the host up (idempotent: a second run takes about a second); the tour needs
# no development dependency.
demo:
	scripts/install
	$(AS_ROOT) $(BIN)/appliancectl demo

test: install lint types images unit fuzz-smoke native-sanitize

# The native tests and a fuzz run again, on modules built with ASan + UBSan (issue #4 asks for
# it of every C module), then the normal build back. Python itself is not instrumented, so the
# runtimes are preloaded and leak checking is off (the interpreter's allocations are not ours).
# PYTHONMALLOC=malloc: every Python object is its own malloc block, so a read past the end of a
# bytes object handed to C is caught (pymalloc's pools would hide it).
SANITIZE_ENV := LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	PYTHONMALLOC=malloc
native-sanitize: install
	rm -f $(NATIVE_LIB)
	$(BIN)/python -m native.build --sanitize
	$(SANITIZE_ENV) $(BIN)/python -m pytest -p no:cacheprovider -q \
		tests/test_native_headscan.py tests/test_http1.py tests/test_http1_relay.py \
		tests/test_native_scrub.py tests/test_scrub_fold.py tests/test_scrub_composed.py
	@for harness in fuzz/fuzz_native_headscan.py fuzz/fuzz_scrub_differential.py \
		fuzz/fuzz_scrub_fold_differential.py; do \
		runs=$(FUZZ_RUNS); \
		case $$harness in *scrub_fold*) runs=$(FUZZ_RUNS_SANITIZE_FOLD);; \
			*scrub*) runs=$(FUZZ_RUNS_SANITIZE_SCRUB);; esac; \
		log=$$(mktemp); \
		$(SANITIZE_ENV) $(BIN)/python $$harness -runs=$$runs -max_len=4096 \
			>$$log 2>&1 || { tail -n 40 $$log; exit 1; }; \
		grep -E '^Done [0-9]+ runs' $$log; \
	done
	$(MAKE) native

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: install
	$(BIN)/mypy proxycore netns native appliance images

# tests/test_provision.py (5 to 7 minutes, most of it waiting on Debian's archive and on the
# machine's own apt and image build) runs in a second pytest beside the rest of the suite: the two
# share only the Docker engine, and the machine touches nothing of the host's but its own
# container. Its report follows the suite's; either failing fails the target.
PROVISION_LOG := build/test-provision.log
unit: install
	@mkdir -p build
	@nice -n 10 $(BIN)/python -m pytest -p no:cacheprovider tests/test_provision.py > $(PROVISION_LOG) 2>&1 & \
	provision=$$!; \
	$(BIN)/python -m pytest --ignore=tests/test_provision.py; suite=$$?; \
	wait $$provision; provisioned=$$?; \
	echo "--- tests/test_provision.py, run beside the suite (exit $$provisioned) ---"; \
	cat $(PROVISION_LOG); \
	[ $$suite -eq 0 ] && [ $$provisioned -eq 0 ]

# Each harness runs for a bounded number of executions (CI). The request-path harness runs a
# whole proxy exchange per input (~40/s), so it gets fewer. Longer runs: see fuzz/README.md.
fuzz-smoke: install
	@for harness in fuzz/fuzz_*.py; do \
		runs=$(FUZZ_RUNS); \
		case $$harness in *request_path*) runs=$(FUZZ_RUNS_SLOW);; *scrub*) runs=$(FUZZ_RUNS_SCRUB);; esac; \
		echo "fuzz: $$harness ($$runs runs)"; \
		log=$$(mktemp); \
		$(BIN)/python $$harness -runs=$$runs -max_len=4096 >$$log 2>&1 \
			|| { tail -n 40 $$log; exit 1; }; \
		grep -E '^Done [0-9]+ runs' $$log; \
	done

# The artifact (docs/artifact.md): dist/agent-appliance/, one executable with its own Python, the
# native modules and every dependency (applianced, appliancectl and the proxy workers), and its
# tarball. PyPI only (PyInstaller and the dependencies, in a build virtualenv of its own).
dist:
	nice -n 10 scripts/dist dist

# The wheel (cp311-abi3) built once, installed and run under every CPython 3.11 to 3.13 found.
wheel-check:
	nice -n 10 scripts/wheel-check

bench: install
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache build dist *.egg-info native/_*.so $(NATIVE_LIB)
