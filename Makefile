# One command to run the daemon, one to test it. Both build .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-vllm lint typecheck imports unit venv redis ibverbs buildtools clean

# The engine modules setup.py compiles with mypyc: a change to one rebuilds them.
COMPILED := $(foreach m,block block_queue pool frequency adaptive,kvd/engine/$(m).py)

$(STAMP): pyproject.toml setup.py client/kvd_client/wire/_keys.c $(COMPILED) | buildtools
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: any other version downloads several GB.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

## run: the daemon in the foreground with the embedded default (an shm pool); ARGS="--config config/kvd.toml"
run: $(STAMP)
	$(BIN)/kvd $(ARGS)

## test: lint, type checks, import rules, then the whole test suite (no GPU needed)
test: lint typecheck imports unit

lint: $(STAMP)
	$(BIN)/ruff check kvd client tests bench examples
	$(BIN)/ruff format --check kvd client tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy

imports: $(STAMP)
	$(BIN)/lint-imports

unit: $(STAMP) redis ibverbs
	$(BIN)/pytest -q $(PYTEST_ARGS)

## buildtools: a C compiler, OpenSSL's and Python's headers for setup.py's extensions (the block hasher, the mypyc-compiled engine); apt where missing
buildtools:
	{ command -v cc >/dev/null && test -f /usr/include/openssl/sha.h; } || \
		{ apt-get update -qq && apt-get install -y -qq gcc libssl-dev; }
	$(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' || \
		{ apt-get update -qq && apt-get install -y -qq python3-dev; }

## redis: the redis-server the remote tier's tests start (on a free loopback port); no PyPI wheel ships it, so apt where missing
redis:
	command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }

## ibverbs: libibverbs.so.1, which Mooncake's native library links even over TCP; apt where missing
ibverbs:
	ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { apt-get update -qq && apt-get install -y -qq libibverbs1; }

## test-vllm: tests/vllm in the vLLM venv (scripts/vllm-env.sh: built once into a cache outside the clone, ~2-5 min; reused in well under a second)
test-vllm:
	venv=$$(scripts/vllm-env.sh | tail -n 1) && \
	"$$venv/bin/python" -m pytest -q --import-mode=importlib tests/vllm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
