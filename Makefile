# `make demo`: set up and run the pipeline on the bundled demo corpus.
# `make test`: set up and run the test suite.
# Both create .venv when it is missing and install the project into it.

VENV    ?= .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.assay-installed
ENGINES := $(VENV)/.assay-engines-installed

# Stage commands (dvc.yaml) find `assay` and `python` through PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# Nothing is fetched from a model or dataset hub at run time.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90

.PHONY: install install-engines demo test test-slow test-parallel bench bench-verdicts clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	@# PyTorch first, pinned (torch==2.13.0): anything looser lets pip fetch a multi-GB CUDA build.
	$(PYTHON) -m pip install --quiet 'torch==2.13.0'
	$(PYTHON) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# Dask and Ray, for the stage flows on real engines (tests/test_scaleout.py in `make test-slow`);
# apart from `install` so that `make demo` does not pay for Ray's 240 MB.
install-engines: $(ENGINES)

$(ENGINES): $(STAMP)
	$(PYTHON) -m pip install --quiet -e '.[dev,dask,ray]'
	@touch $(ENGINES)

demo: install
	dvc repro
	dvc push --quiet
	assay stats data/curated
	dvc metrics show
	@echo "report: $(CURDIR)/reports/index.html"

# pytest's own exit code stands: 5 ("no tests collected") means discovery broke,
# and a suite that ran nothing must not pass.
test: install
	@export PREFECT_HOME=$$(mktemp -d); \
	$(PYTHON) -m pytest -m "not slow and (not parallel or parallel_quick)" $(PYTEST_ARGS); rc=$$?; \
	rm -rf "$$PREFECT_HOME"; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; fi; \
	exit $$rc

# End to end and heavy: the whole loop under `dvc repro` (and what reruns after a change),
# tier 3 on the labelled code set, the planted-corruption proof, the Prefect UI, the report in Chromium,
# the stage flows on Dask and Ray, two runs at once, the vector store killed mid-write.
test-slow: install-engines
	@export PREFECT_HOME=$$(mktemp -d); \
	$(PYTHON) -m pytest -m "slow and not parallel" $(PYTEST_ARGS); rc=$$?; \
	rm -rf "$$PREFECT_HOME"; exit $$rc

# Every parallel mode against one process, with real ranks on gloo (torchrun and assay train's own launcher; slower).
test-parallel: install
	$(PYTHON) -m pytest -m parallel $(PYTEST_ARGS)

bench: install
	$(PYTHON) bench/ingest.py
	$(PYTHON) bench/static.py
	$(PYTHON) bench/domain.py
	$(PYTHON) bench/dedup.py
	$(PYTHON) bench/vectors.py
	$(PYTHON) bench/attention.py
	$(PYTHON) bench/grad_norms.py
	$(PYTHON) bench/train.py
	$(PYTHON) bench/score.py
	$(PYTHON) bench/parallel.py
	$(PYTHON) bench/parallel_ep.py
	$(PYTHON) bench/pipeline.py
	OMP_NUM_THREADS=1 $(PYTHON) bench/context_parallel.py

# Verdicts and memory, not speed: tier 1 on the labelled pool, tier 3 on labelled
# code (needs models/domain: run `make demo` first), dedup's memory at 1M documents.
bench-verdicts: install
	$(PYTHON) bench/tier1_pool.py
	$(PYTHON) bench/labelled_code.py --model models/domain --calibrate --legacy
	$(PYTHON) bench/dedup_memory.py
	$(PYTHON) bench/memory_bound.py stream --gb 0.5 --models models
	$(PYTHON) bench/memory_bound.py dedup --docs 100000,200000 --words 20-80,200-320 --models models
	$(PYTHON) bench/planted.py --out $$(mktemp -d)

clean:
	rm -rf $(VENV) .pytest_cache
