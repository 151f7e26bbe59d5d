# Two commands: `make train` (set up + the main job) and `make test` (set up + the tests).
.PHONY: setup train test test-fast lint bench evaluate serve

setup: .venv/.setup-done
.venv/.setup-done: pyproject.toml scripts/setup.sh
	./scripts/setup.sh
	touch $@

train: setup
	.venv/bin/python scripts/train.py

test: setup lint
	.venv/bin/python -m pytest -q tests

# Unit and property tests only: no vLLM, no Ray, no training runs, no whole-sweep config checks;
# on the CPUs there are (pytest-xdist), a few minutes on 2 cores.
test-fast: setup
	.venv/bin/python -m pytest -q -n auto -m "not live and not slow" tests

lint: setup
	.venv/bin/ruff check batchpilot envs policies serving evaluation scripts tests

bench: setup
	.venv/bin/python scripts/bench.py target=sim
	.venv/bin/python scripts/bench.py target=env
	.venv/bin/python scripts/bench.py target=policy

evaluate: setup
	.venv/bin/python scripts/evaluate.py
