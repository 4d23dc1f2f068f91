#!/usr/bin/env bash
# perf_analyzer and genai-perf sweeps from NVIDIA's SDK container, against a server already running on this host
# (`make serve`, or tritonserver in the NGC container). perf_analyzer is not installable from PyPI on these
# machines, so this needs a Docker engine:
#
#   loadtests/run_perf_analyzer.sh                       # concurrency 1 8 32, results in build/perf/
#   CONCURRENCY="4 16" RELEASE=24.10 GRPC_URL=localhost:8001 loadtests/run_perf_analyzer.sh
#
# `ensemble` is decoupled, so perf_analyzer must stream over gRPC (--async --streaming -i grpc); its latency is
# then the time to the first response. genai-perf (0.0.7 in the 24.10 SDK) adds those flags itself and reports
# TTFT, inter-token latency and output tokens/s, counting tokens with the model's own tokenizer (mounted read-only).
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASE=${RELEASE:-24.10}
GRPC_URL=${GRPC_URL:-localhost:8001}
CONCURRENCY=${CONCURRENCY:-1 8 32}
MODEL_DIR=${MODEL_DIR:-build/model}
OUT=build/perf
IMAGE=nvcr.io/nvidia/tritonserver:${RELEASE}-py3-sdk

.venv/bin/python -m loadtests.perf_inputs --output "$OUT"
run() { docker run --rm --net host -v "$PWD/$OUT:/perf" -v "$PWD/$MODEL_DIR:/tokenizer:ro" "$IMAGE" "$@"; }

for c in $CONCURRENCY; do
  run perf_analyzer -m ensemble -i grpc -u "$GRPC_URL" --async --streaming \
    --input-data /perf/perf_analyzer_data.json --concurrency-range "$c" --measurement-interval 10000 \
    -f "/perf/perf_analyzer_c$c.csv" --profile-export-file "/perf/perf_analyzer_c$c.json"
  run genai-perf profile -m ensemble --service-kind triton --backend tensorrtllm --streaming \
    --input-file /perf/genai_perf_prompts.jsonl --concurrency "$c" --output-tokens-mean 64 \
    --tokenizer /tokenizer --url "$GRPC_URL" --artifact-dir "/perf/genai-perf-c$c"
done
echo "results in $OUT/"
