# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RAY_STAMP := $(VENV)/.ray
PROTO_OUT := protos/feeder_pb2.py
NATIVE_LIBS := $(VENV)/.native-libraries
DEMO    := .demo
# Bytecode of the project's own modules and pytest's rewritten tests is cached in their __pycache__
# (ignored by git) even where the environment says not to write it: every worker, daemon and rank a
# test run starts would otherwise compile them again (each pytest worker's collection 12 s, not 10).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-parallel test-quick docs-check test-cluster slurm test-under-load chaos install proto typecheck lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

UV      := $(BIN)/uv
# uv installs the dependencies' wheels side by side (pip unpacks the 7 GB one wheel at a time:
# about 70 s here, uv 17 s), from the indexes pip is configured with (deploy/uv_args.py), choosing
# among them as pip does; its cache is the venv's, so a fresh clone installs as a fresh machine does.
UV_PIP  = UV_CACHE_DIR=$(CURDIR)/$(VENV)/.uv-cache $(UV) pip install --quiet --python $(BIN)/python \
          $$($(BIN)/python deploy/uv_args.py)
$(UV): | $(BIN)/python
	$(BIN)/pip install --quiet uv==0.13.9

# Byte-compiled on every core once (left to the tests' first imports, it would be done by every
# worker, daemon and rank that starts at once), but for the packages' own test suites (a sixth of
# their files, never imported here). Files that do not compile (other Python versions' samples in
# some packages) are skipped quietly, as pip skips them.
COMPILE = $(BIN)/python -m compileall -qq -j 0 -x '/tests?/' $(VENV)/lib >/dev/null || true
$(STAMP): pyproject.toml deploy/uv_args.py | $(UV)
	$(UV_PIP) -e '.[dev]'
	$(COMPILE)
	touch $@

# Ray (the feeder[ray] extra) for the cluster tests of `feeder shard --ray`; `make test` runs without it.
$(RAY_STAMP): pyproject.toml $(STAMP)
	$(UV_PIP) -e '.[dev,ray]'
	$(COMPILE)
	touch $@

$(PROTO_OUT): protos/feeder.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/feeder.proto

# The C libraries: shards/'s JPEG windows (without it the pipeline decodes with DALI) and decode/'s
# batch resize (without it, OpenCV's); both optional.
$(NATIVE_LIBS): shards/_jpeg.c decode/_resize.c setup.py $(STAMP)
	$(BIN)/python setup.py --quiet build_ext --inplace
	touch $@

install: $(STAMP) $(PROTO_OUT) $(NATIVE_LIBS)

proto: $(PROTO_OUT)

# The typecheck and the lint beside the tests that wait more than they compute (three workers on two
# cores: mypy's minute of CPU goes into their waits); then the ones comparing rates or shares of the
# machine (marked serial), alone.
test: install
	$(MAKE) --no-print-directory -j 3 typecheck lint test-parallel
	$(BIN)/python -m pytest -q -m "serial and not cluster" --durations=5 $(SERIAL_FILES)

# The files that mark tests serial (a test is marked where it is written, never by a conftest):
# collecting only them takes 3 s, the whole suite 11 s.
SERIAL_FILES = $(shell grep -rlE 'mark\.serial' tests --include='test_*.py')

# make test's first phase alone: every test but the serial and cluster ones, three workers.
test-parallel: install
	$(BIN)/python -m pytest -q -n 3 -m "not serial and not cluster" --durations=15

# The documents against the code (part of `make test` too): every path, link and result file they
# name exists, every command in their shell blocks parses with its own parser (nothing is run).
docs-check: install
	$(BIN)/python -m pytest -q tests/docs

# The edit loop: the tests that start no process or daemon and take under a second each (not slow),
# without the typecheck and the lint; `make test` runs these and the rest.
test-quick: install
	$(BIN)/python -m pytest -q -n 3 -m "not slow and not serial and not cluster" --durations=10

# The tests that run a whole cluster on this host: a real Slurm (installed by `make slurm`
# where the machine allows it, else skipped with the reason), two nodes of one job, fault
# schedules, the sharder on a two-node Ray cluster (Ray installed here). CI runs it after `make test`.
# Test by test to its two workers (--dist load): two of its longest tests share a module.
test-cluster: install slurm $(RAY_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist load -m cluster --durations=10

# slurm-wlm and munge from the distribution's packages (root and apt needed; else a line says why).
slurm:
	deploy/slurm/install.sh

# make test three times in a row in a fresh clone, beside two CPU-bound processes (RUNS=N; HOGS=0 quiet).
test-under-load:
	tests/under-load.sh

# Seeded fault schedules with the durations a cluster makes (a store stopped for up to
# 90 s): make chaos SEEDS=20. Results in .chaos/results.json (docs/reliability.md).
SEEDS ?= 3
chaos: install
	$(BIN)/python -m tests.chaos --seeds $(SEEDS) --json .chaos/results.json

typecheck: install
	$(BIN)/python -m mypy core protocol shards sharder decode feeder clients launcher trainer cli bench

lint: install
	$(BIN)/python -m ruff check .

demo: install
	$(BIN)/python -m cli.demo --workdir $(DEMO)

clean:
	rm -rf $(DEMO) protos/*_pb2*.py protos/*_pb2*.pyi shards/_jpeg*.so decode/_resize*.so $(NATIVE_LIBS)
