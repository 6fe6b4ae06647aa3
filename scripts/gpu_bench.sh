#!/usr/bin/env bash
# Issue #10's GPU figures (and #11's, #23's) in one go, on a CUDA machine (see docs/benchmarks/README.md).
#
#   bash scripts/gpu_bench.sh                 # with the project's .venv (make venv)
#   source .device/setup.sh; bash scripts/gpu_bench.sh   # on the offline device machine
#
# Runs specserve-bench (one process per line, same ShareGPT prompts, greedy) for:
#   SmolLM2 bf16 vanilla + ngram at c1 (with transformers baselines), c16 and c64;
#   fp32 ngram losslessness (greedy_match vs plain decoding and transformers);
#   draft_model (SmolLM2 drafting for itself) bf16 c1;
#   eagle3 (the shipped head; its K draft steps replay CUDA graphs) bf16 c1, K=4 (issue #11: >= 2x vanilla);
#   eagle3 bf16 c1 with the adaptive default (chains) and with draft trees (topk 4, 8 verified
#   nodes, depth 5), each against vanilla in the same run (issue #23);
#   a seeded random 1.2B Llama (hidden 2048, 16 layers, 32/8 heads, SmolLM2 vocabulary) vanilla c1.
# Each writes JSON under $OUT (default results/gpu/) with a per-step breakdown (wall vs
# device time, kernels per step) of a decode and a verification step; then a summary table
# (summary.md) checks the issue's targets.  Knobs: OUT, PROMPTS, MAX_TOKENS, SKIP_1B=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
PROMPTS=${PROMPTS:-32}
MAX_TOKENS=${MAX_TOKENS:-128}
mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
MODEL=${SMOL:-embedded:smollm2-135m-instruct}
log() { echo "[gpu_bench $(date +%H:%M:%S)] $*"; }
bench() {  # $1 output name, rest: overrides
    local name=$1; shift
    log "$name: $*"
    $PY -c 'import sys; from specserve.cli import bench_main; sys.exit(bench_main())' \
        "model.path=$MODEL" engine.device=cuda "bench.num_prompts=$PROMPTS" "bench.max_tokens=$MAX_TOKENS" \
        "bench.output=$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || { log "$name FAILED"; tail -20 "$OUT/$name.log"; }
}

bench smol-ngram-bf16-c1 +method=ngram model.dtype=bfloat16
bench smol-ngram-bf16-c16 +method=ngram model.dtype=bfloat16 bench.concurrency=16 'bench.baselines=[specserve_vanilla]'
bench smol-ngram-bf16-c64 +method=ngram model.dtype=bfloat16 bench.concurrency=64 engine.max_num_seqs=64 \
    bench.num_prompts=128 'bench.baselines=[specserve_vanilla]'
bench smol-ngram-fp32-c1 +method=ngram model.dtype=float32
bench smol-draft-bf16-c1 +method=draft_model "draft.path=$MODEL" model.dtype=bfloat16 method.num_speculative_tokens=4
bench smol-eagle3-bf16-c1 +method=eagle3 draft=smollm2-135m-eagle3 model.dtype=bfloat16 method.num_speculative_tokens=4 engine.speculation=fixed
bench smol-eagle3-chain-auto-bf16-c1 +method=eagle3 draft=smollm2-135m-eagle3 model.dtype=bfloat16 \
    'bench.baselines=[specserve_vanilla]'
bench smol-eagle3-tree-n8-bf16-c1 +method=eagle3 draft=smollm2-135m-eagle3 model.dtype=bfloat16 \
    method.tree.topk=4 method.tree.num_draft_tokens=8 method.tree.depth=5 'bench.baselines=[specserve_vanilla]'
if [ "${SKIP_1B:-0}" != 1 ]; then
    L1B=${L1B:-/tmp/specserve-llama-1.2b}
    [ -f "$L1B/model.safetensors" ] || $PY scripts/make_random_llama.py --out "$L1B" --tokenizer "$MODEL"
    MODEL_SAVED=$MODEL; MODEL=$L1B
    bench llama1b-vanilla-bf16-c1 model.name=llama-1.2b-random model.dtype=bfloat16 'bench.baselines=[hf]'
    MODEL=$MODEL_SAVED
fi
$PY scripts/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
