# Switchyard developer targets. CI calls `make ci` unchanged; a newcomer needs `make up` and `make test`.
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip
PORT ?= 8000

.PHONY: install up test test-embedded test-services lint bench bench-stream ci migrations-check

$(PY):
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

# torch first, pinned to the CPU wheel, so the project's `torch>=2.6` is already satisfied.
install: $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

# Install, migrate, create the demo tenant/key/node/model, and run every process in the foreground
# under supervisord (deploy/supervisord.conf): one that dies is restarted alone.
up: install
	PORT=$(PORT) bash scripts/up.sh

# The whole suite against PostgreSQL + Redis when reachable (DATABASE_URL/REDIS_URL, else the
# local defaults), then the embedded default (SQLite, no Redis).
test: install
	bash scripts/test.sh $(ARGS)

# Style, the import layers (pyproject's import-linter contracts) and the type check.
lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports
	.venv/bin/mypy

migrations-check: install
	$(PY) manage.py makemigrations --check --dry-run

bench: install
	bash bench/run.sh

bench-stream: install
	.venv/bin/python bench/stream_bench.py

ci: lint migrations-check test
