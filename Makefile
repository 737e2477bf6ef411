# Quick start: `make demo` (the main job) and `make test`. Each sets up its own virtualenv.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a CUDA machine override, e.g. `make TORCH_SPEC=torch test`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test bench clean venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,hf]"
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nitrobrew demo

bench: $(STAMP)
	$(VENV)/bin/nitrobrew bench

# Triton kernels run under the interpreter on CPU; -n 2 uses both cores of the CI machine.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
