# Two commands do all the set-up: `make run` and `make test`. Both create .venv on
# first use (idempotent: a second run only re-checks it) and work on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# On a machine without CUDA the CPU build of torch is enough (tests run Triton kernels
# through its interpreter); TORCH_SPEC lets a GPU machine choose its own build.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0

.PHONY: run test setup clean

$(STAMP): pyproject.toml Makefile
	@echo "memfit: setting up $(VENV) (torch, triton, transformers and the rest: a minute or two on a fresh machine)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/memfit plan

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests

clean:
	rm -rf $(VENV) build *.egg-info
