# difflm: the two set-up commands are `make install` then `make train` (or `make test`).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
RUN_DIR ?= outputs/tiny-shakespeare

.PHONY: install train generate test test-fast clean

install:            ## install difflm (editable) with its test dependencies into the active environment
	$(PIP) install -e '.[dev]'

train:              ## train model=tiny on the embedded tinyshakespeare corpus (CPU: a few minutes), then sample
	difflm-train model=tiny train.max_steps=300 train.eval_every=100 train.save_every=100 \
	  optim.lr=1e-3 schedule.warmup_steps=30 run.dir=$(RUN_DIR)

generate:           ## continue a prompt with the run trained by `make train`
	difflm-generate run.dir=$(RUN_DIR) prompt="ROMEO:" gen.length=64 gen.steps=64 gen.block_length=32

test:               ## the whole test suite (CPU)
	$(PYTHON) -m pytest tests -q --durations=20

test-fast:          ## everything but the end-to-end CLI runs
	$(PYTHON) -m pytest tests -q --ignore=tests/test_end_to_end.py

clean:
	rm -rf outputs multirun .pytest_cache
