#!/usr/bin/env bash
# Five minutes on one GPU that settle what the CPU tests cannot (see docs/benchmarks/README.md).
#
#   bash scripts/gpu_smoke.sh                              # with the project's .venv (make venv)
#   source .device/setup.sh; bash scripts/gpu_smoke.sh     # on the offline device machine
#   GPU_SMOKE_DRY=1 bash scripts/gpu_smoke.sh              # (or --dry-run) every check on the CPU, tiny
#
# scripts/gpu_smoke.py runs each check in its own process and writes ONE JSON, $OUT/smoke.json
# (dry run: smoke-dry.json), with a summary table beside it (smoke.md):
#   long_prefill  an 8000-token prompt (multi-chunk prefill, alone) greedy in fp32 on CUDA == the CPU's fp32;
#   draft_graphs  draft_model (SmolLM2 drafting for itself): engine.cuda_graphs=auto == off
#                 (output tokens and acceptance counts);
#   startup       engine.max_num_seqs=256 with K=16: start-up, one full batch, the memory budget
#                 against torch.cuda.max_memory_allocated;
#   and the Triton kernels' start-up self-check where the engine exposes it.
# Knobs: OUT (default results/gpu), SMOL (model path; default the embedded SmolLM2), extra
# arguments go to gpu_smoke.py (e.g. --checks long_prefill --prompt-tokens 4000).
# Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
MODEL=${SMOL:-embedded:smollm2-135m-instruct}
name=smoke
if [ "${GPU_SMOKE_DRY:-0}" = 1 ] || [[ " $* " == *" --dry-run "* ]]; then name=smoke-dry; set -- --dry-run "$@"; fi
echo "[gpu_smoke $(date +%H:%M:%S)] $name -> $OUT/$name.json (log $OUT/$name.log)"
$PY scripts/gpu_smoke.py --model "$MODEL" --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
