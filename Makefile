# dsexp — every target does its own set-up on a fresh machine (CPU: torch 2.13.0 CPU build, no CUDA download).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.dsexp-installed
SWEEP   ?= tp=1,2 load=eager
PLAN    ?= model=internlm2_20b_shapes tp=1,2,4 load=eager,meta trim=none,all gpu=h100_80gb generate.prompt_tokens=2048
UI_PORT ?= 5000
BENCH   ?=
SERVER_PORT ?= 5001
SLURM_DIR ?= /tmp/dsexp-slurm
SLURM_NODES ?= 1
NAME    ?=
ARGS    ?=
# USE_VENV=0: run with the machine's python3 (a GPU machine without network, scripts/gpu/env.sh sourced), no install
USE_VENV ?= 1
ifeq ($(USE_VENV),0)
RUN  := python3
NEED :=
else
RUN  := $(BIN)/python
NEED := install
endif
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: help install sweep plan test lint test-all test-slurm ui server bench bench-slurm benchmark campaign reports findings clean \
	slurm-up slurm-down

help:  ## list the targets, then dsexp's entry points with an example each
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "Entry points (.venv/bin/python -m ...; each takes --help):"
	@echo "  dsexp -m tp=1,2 load=eager,meta               a sweep of your settings (the app; make sweep)"
	@echo "  dsexp.plan -m model=internlm2_20b_shapes tp=1,2,4 gpu=h100_80gb"
	@echo "                                                 the plan: memory per rank from the config alone (make plan)"
	@echo "  dsexp -m budget.gpus=2 budget.gpu_gib=24 model=internlm2_20b_shapes tp=1,2 trim=none,all"
	@echo "                                                 a budget search: the largest batch that fits"
	@echo "  dsexp.report multirun/<date>/<time>            the report, rebuilt from a sweep's results"
	@echo "  dsexp.campaign --list                          the campaigns that remake every GPU result (make campaign)"

install: $(STAMP)  ## create .venv with the CPU torch, deepspeed and dsexp (editable)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install -q -e '.[test,cluster]'
	@# optimum-quanto compiles its CPU kernels into its own package folder on first use (about 35 s on two cores):
	@# built here once, not inside the first quant.kv job's generate (or the first test that makes a quanto cache)
	$(BIN)/python -c 'from optimum.quanto.library.extensions.cpp import ext; ext.lib'
	touch $(STAMP)

sweep: install  ## the main job: a CPU sweep on the tiny model into multirun/ and ./mlflow.db (SWEEP="..." to change)
	$(BIN)/python -m dsexp -m $(SWEEP)

plan: install  ## predict every configuration from the config alone, no GPU (PLAN="..." overrides, -m implied)
	$(BIN)/python -m dsexp.plan -m $(PLAN)

test: install lint  ## lint, then the test suite (CPU; slow, GPU, SLURM and package-index tests are skipped; two workers, a file each)
	$(BIN)/python -m pytest -n 2 --dist loadfile

lint: install  ## ruff check + ruff format --check
	$(BIN)/ruff check src tests scripts benchmarks examples
	$(BIN)/ruff format --check src tests scripts benchmarks examples

test-all: install  ## also the slow and package-index tests (headless Chromium UI check, fault matrix, cluster launcher)
	$(BIN)/python -m pytest -m 'not gpu'

test-slurm: install  ## the tests on a real local SLURM cluster (root; .ci/install-slurm.sh installs slurm-wlm, munge)
	$(BIN)/python -m pytest -m slurm

bench: $(NEED)  ## dsexp's own speed on this machine -> results/<machine>/bench.{json,md} (BENCH="--only overhead"), then bench-slurm
	$(RUN) benchmarks/run.py $(BENCH)
	$(RUN) benchmarks/slurm.py

bench-slurm: $(NEED)  ## SLURM's submit-to-start time per dsexp job on a throwaway local cluster -> results/<machine>/slurm_bench.{json,md}
	$(RUN) benchmarks/slurm.py

benchmark: $(NEED)  ## one benchmark of benchmarks/: NAME=packing ARGS="--jobs 4" (NAME= lists them)
	@if [ -z "$(NAME)" ]; then ls benchmarks/*.py | sed 's#benchmarks/##; s#\.py$$##' | grep -vx common; else $(RUN) benchmarks/$(NAME).py $(ARGS); fi

campaign: $(NEED)  ## remake a results folder: NAME=shared [ARGS="--dry-run" or "--only autotp2"] (NAME= lists them)
	$(RUN) -m dsexp.campaign $(if $(NAME),$(NAME),--list) $(ARGS)

reports: $(NEED)  ## check every committed report under results/ against what the code writes today (ARGS=--rewrite: write those that differ again)
	$(RUN) -m dsexp.report --check results $(ARGS)

findings: $(NEED)  ## rebuild docs/FINDINGS.md from docs/FINDINGS.in.md and the committed results
	$(RUN) scripts/make_findings.py

ui: install  ## MLflow UI on http://127.0.0.1:$(UI_PORT) for ./mlflow.db
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $(UI_PORT)

server: install  ## MLflow tracking server on http://127.0.0.1:$(SERVER_PORT) (sqlite + artifacts in mlserver/)
	mkdir -p mlserver/artifacts
	$(BIN)/mlflow server --backend-store-uri sqlite:///$(CURDIR)/mlserver/mlflow.db \
		--artifacts-destination $(CURDIR)/mlserver/artifacts --serve-artifacts \
		--host 127.0.0.1 --port $(SERVER_PORT) --workers 1

clean:  ## remove sweep outputs and the local MLflow store (not the model cache)
	rm -rf multirun outputs mlflow.db mlartifacts mlruns

slurm-up:  ## a throwaway local SLURM cluster in /tmp/dsexp-slurm (root; installs slurm-wlm, munge): eval "$(make -s slurm-up)"
	.ci/install-slurm.sh
	$(PY) tests/helpers/slurm_cluster.py start --dir $(SLURM_DIR) --nodes $(SLURM_NODES)

slurm-down:  ## stop it: exactly the daemons slurm-up started; removes its folder
	$(PY) tests/helpers/slurm_cluster.py stop --dir $(SLURM_DIR)
