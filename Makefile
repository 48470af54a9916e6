# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast lint test-soak test-all bench install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstalls only when pyproject.toml changes (fast when already installed).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@# Debian's redis-server, for the GCS fault-tolerance test and bench (skipped without it).
	-@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q redis-server >/dev/null 2>&1; }; }; } || \
	  echo "redis-server not installed (apt-get install redis-server): tests/test_head_loss.py is skipped"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ray-elastic demo $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ray_elastic tests bench examples
	$(VENV)/bin/ruff format --check ray_elastic tests bench examples
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -ra $(ARGS)

# The pure and fake-backend tests (no cluster, no processes started): the inner loop, under a minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m 'not cluster and not soak and not bench' $(ARGS)

test-soak: $(STAMP)
	$(PY) -m pytest -q -ra -m soak $(ARGS)

# Everything: the default suite, the soaks and the benchmarks' end-to-end runs.
test-all: $(STAMP)
	$(PY) -m pytest -q -ra -o addopts="" $(ARGS)

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/recovery.py
	$(PY) bench/checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info
