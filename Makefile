# labkit — every target bootstraps its own virtual environment (.venv) from nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
PYTEST_ARGS ?=
# Jupyter refuses to run as root (containers, CI) unless told to.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab venv test check nbval bench lint doctor grade clean-venv tensorboard site site-serve

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "labkit needs Python 3.10+, found " + sys.version' 
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --progress-bar off -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)  ## the virtual environment alone (.venv), as every target builds it

lab: $(STAMP)  ## open the course in JupyterLab (prints the URL; never needs a browser)
	@echo "Starting JupyterLab on notebooks/ — open the http://127.0.0.1:... URL printed below."
	$(BIN)/jupyter lab --no-browser --ip=127.0.0.1 --notebook-dir=notebooks $(ALLOW_ROOT)

NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=300

# Unit, distributed, grading and browser tests, in two pytest runs.  First everything that does not time itself,
# spread over $(WORKERS) processes, a test file each at a time, the longest first (tests/conftest.py; most tests
# wait on ranks and sockets as much as they compute).  Then, one at a time, what asserts on measured time (the
# `timing` marker: the browser test, a few unit tests), which beside other tests would measure them.  Both runs
# always run; the target fails if either does.  The browser test runs every notebook (Run All in JupyterLab) with
# PyTorch's portable kernels (ATEN_CPU_CAPABILITY=default) and compares each cell's outputs with the stored ones
# as nbval does; `make nbval` checks them again with this CPU's own kernels, and CI (.ci/run) runs both: what a
# notebook stores is what any learner's CPU reproduces.
WORKERS ?= 2
# Notebooks run in strict mode: a measured claim that misses its band fails (labkit/claims.py), and a notebook whose
# first failure is such a miss runs once more, whole (notebooks/rerun_missed.py; the browser test does the same).
PYTEST  := env LABKIT_SOLUTIONS=1 LABKIT_STRICT_CLAIMS=1 $(BIN)/python -m pytest
# Each stage's wall time is recorded (.ci/budget.py: $(LABKIT_TIMINGS)) and printed against its budget at the end;
# under CI an overrun past the margin fails.  Every pytest run lists its 25 slowest tests.
BUDGET  := python3 .ci/budget.py
SLOWEST := --durations=25 --durations-min=1
test: $(STAMP)  ## the whole suite but nbval (see README: Developing)
	@status=0; \
	$(BUDGET) run unit -- $(PYTEST) tests -m "not timing" -n $(WORKERS) --dist loadfile --no-loadscope-reorder $(SLOWEST) $(PYTEST_ARGS) || status=1; \
	$(BUDGET) run browser -- $(PYTEST) tests -m timing -p no:xdist $(SLOWEST) $(PYTEST_ARGS) || status=1; \
	$(BUDGET) report unit browser || status=1; \
	exit $$status

# The inner loop, under 2 minutes: ruff, the layout test, and the tests of what changed since $(BASE) (the working
# tree's edits by default), but those a previous run here measured over $(FAST) seconds and what times itself.
BASE ?= HEAD
FAST ?= 5
check: $(STAMP)  ## ruff, the layout test, the changed area's fast tests (README: Developing)
	$(BIN)/ruff check labkit tests benchmarks exercises solutions
	$(PYTEST) -q -n $(WORKERS) -m "not timing" --skip-slower-than=$(FAST) tests/test_layout.py \
		$$($(BIN)/python tests/changed.py $(BASE)) $(PYTEST_ARGS)

nbval: $(STAMP)  ## every notebook under nbval (solutions mode, this CPU's kernels), one at a time
	$(BIN)/python notebooks/rerun_missed.py notebooks -- $(PYTEST) notebooks $(NBVAL) -p no:xdist $(SLOWEST) $(PYTEST_ARGS)

bench: $(STAMP)  ## every benchmark against PyTorch's built-ins (long; labkit bench --quick is shorter); fails on a missed target
	$(BIN)/labkit bench

lint: $(STAMP)
	$(BIN)/ruff check labkit tests benchmarks exercises solutions

RUN ?= runs
tensorboard: $(STAMP)  ## TensorBoard on a --tensorboard folder (RUN=DIR): every rank's curves, overlaid
	$(BIN)/tensorboard --logdir $(RUN) --host 127.0.0.1 --port 6006

# The web edition: every stored lesson as a page (nothing executed), the explorers' pictures drawn from the models,
# into $(SITE); open $(SITE)/index.html, or serve it.  labkit/site/build.py says how.
SITE ?= build/site
PORT ?= 8000
site: $(STAMP)  ## the course as a static web site in $(SITE) (about a minute and a half on 2 cores)
	$(BIN)/python -m labkit.site --out $(SITE)

site-serve:  ## serve $(SITE) on http://127.0.0.1:$(PORT)/ (make site first)
	@test -f $(SITE)/index.html || { echo "no $(SITE)/index.html: run make site first"; exit 2; }
	@echo "the course: http://127.0.0.1:$(PORT)/ (Ctrl-C stops)"
	python3 -m http.server $(PORT) --bind 127.0.0.1 --directory $(SITE)

doctor: $(STAMP)
	$(BIN)/labkit doctor

grade: $(STAMP)
	$(BIN)/labkit grade

clean-venv:
	rm -rf $(VENV)
