#!/usr/bin/env bash
# Every benchmark figure of issue #2, one JSON each under results/ (greedy, same prompts,
# baselines measured in the same process). Slow on 2 CPU cores: about an hour in all.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/specserve-bench
mkdir -p results
# Losslessness in float32: 16 prompts x 128 tokens.
$B +method=ngram bench.num_prompts=16 bench.max_tokens=128 model.dtype=float32 \
   bench.output=results/bench-ngram-fp32.json
$B +method=draft_model draft=smollm2-135m bench.num_prompts=16 bench.max_tokens=128 model.dtype=float32 \
   bench.output=results/bench-draft-self-fp32.json
# Speed in bfloat16 at concurrency 1: 32 prompts x 128 tokens.
$B +method=ngram bench.num_prompts=32 bench.max_tokens=128 model.dtype=bfloat16 \
   bench.output=results/bench-ngram-bf16.json
# Batching: concurrency 8 against concurrency 1 (vanilla), same prompts.
$B bench.num_prompts=32 bench.max_tokens=128 model.dtype=bfloat16 bench.concurrency=8 \
   'bench.baselines=[specserve_vanilla]' bench.output=results/bench-vanilla-c8-bf16.json
# The target as its own draft in bfloat16 (fused CPU decoder for both): AL must be K+1.
$B +method=draft_model draft=smollm2-135m bench.num_prompts=16 bench.max_tokens=128 model.dtype=bfloat16 \
   bench.output=results/bench-draft-self-bf16.json
