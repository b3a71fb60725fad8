# difflm: the set-up commands are `make install` then `make train`; `make install-dev` then `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
RUN_DIR ?= outputs/tiny-shakespeare

.PHONY: install install-dev train generate test test-fast clean

install:            ## install difflm (editable) with what running it needs into the active environment
	$(PIP) install -e .

install-dev:        ## install difflm (editable) with the tools the tests use (pytest, lm-eval, matplotlib, ...)
	$(PIP) install -e '.[dev]'

train:              ## train model=tiny on the embedded tinyshakespeare corpus (CPU: a few minutes), then sample
	difflm-train model=tiny train.max_steps=300 train.eval_every=100 train.save_every=100 \
	  optim.lr=1e-3 schedule.warmup_steps=30 run.dir=$(RUN_DIR)

generate:           ## continue a prompt with the run trained by `make train`
	difflm-generate run.dir=$(RUN_DIR) prompt="ROMEO:" gen.length=64 gen.steps=64 gen.block_length=32

# pytest-xdist: one worker per logical CPU (TEST_WORKERS=0: no workers, one process); a file's tests stay on one worker,
# so a module's shared fixture (a trained run, a torchrun launch) is built once; files are handed out in the order
# tests/conftest.py sorts them (the longest first), not by test count.
TEST_WORKERS ?= logical
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test:               ## the whole test suite (CPU), on every core
	$(PYTHON) -m pytest tests -q $(PYTEST_PARALLEL) --durations=20

test-fast:          ## the unit tests: no end-to-end CLI runs and no multi-process launches marked slow
	$(PYTHON) -m pytest tests -q $(PYTEST_PARALLEL) -m "not slow" --ignore=tests/test_end_to_end.py

clean:              ## remove the outputs of make train and of the README's examples
	rm -rf outputs multirun runs sweeps hf .pytest_cache
