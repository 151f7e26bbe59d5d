# Two commands: `make train` (set up + the main job) and `make test` (set up + the tests).
.PHONY: setup train test bench evaluate serve

setup: .venv/.setup-done
.venv/.setup-done: pyproject.toml scripts/setup.sh
	./scripts/setup.sh
	touch $@

train: setup
	.venv/bin/python scripts/train.py

test: setup
	.venv/bin/python -m pytest -q tests

bench: setup
	.venv/bin/python scripts/bench.py target=sim
	.venv/bin/python scripts/bench.py target=env
	.venv/bin/python scripts/bench.py target=policy

evaluate: setup
	.venv/bin/python scripts/evaluate.py
