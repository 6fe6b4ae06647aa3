#!/usr/bin/env bash
# The loopback load run on the embedded default with +method=ngram.
#
# Phase 1: offline greedy references for specserve-loadgen's prompts (same
# config, dtype and max_tokens as the server, same prompt token ids, one
# request at a time); a server on free loopback ports; 32 clients for 60 s,
# 10% cancelling, 5% bad input (malformed and out-of-range fields, a gzip label
# on a plain body, an 8 KB model name, a 1 MB request id of control characters,
# bytes that are not protobuf, a grammar over the size budget), 5% hostile but
# valid requests that must complete (a U+FFFD stream forced by logit_bias,
# control tokens in chat content, json_schema with n=2, seeded sampling), every
# completed answer compared with its reference; /metrics scraped at the end
# (KV usage must be 0).
# Phase 2: a fresh server under 16 clients for 30 s, SIGTERM mid-way: the
# server must exit 0 within drain timeout + margin and no accepted request
# may end without a finish_reason (loadgen --expect-shutdown).
#
# Usage: bash scripts/load_run.sh            (bf16, the default dtype)
#        DTYPE=float32 bash scripts/load_run.sh
# Knobs (env): DTYPE CLIENTS DURATION_S CANCEL_FRACTION BAD_FRACTION HOSTILE_FRACTION MAX_TOKENS
#              SIG_CLIENTS SIG_DURATION_S SIGTERM_AFTER_S DRAIN_TIMEOUT_S OUT
#              SERVE_ARGS (default "+method=ngram": the server's and the references' overrides)
#              TRANSCRIBE_FRACTION AUDIO_DIR (speech models: transcriptions mixed in), e.g.
#   SERVE_ARGS="model=smollm2-135m-speech +method=ctc" DTYPE=float32 TRANSCRIBE_FRACTION=0.2 \
#       AUDIO_DIR=tests/fixtures/speech bash scripts/load_run.sh
# Outputs under $OUT (default results/): load-ngram[-DTYPE].json, load-sigterm[-DTYPE].json,
# load-metrics[-DTYPE].json, load-reference[-DTYPE].json (+ -ids.json), server logs.
# Exit code: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
DTYPE=${DTYPE:-bfloat16}
CLIENTS=${CLIENTS:-32}
DURATION_S=${DURATION_S:-60}
CANCEL_FRACTION=${CANCEL_FRACTION:-0.1}
BAD_FRACTION=${BAD_FRACTION:-0.05}
HOSTILE_FRACTION=${HOSTILE_FRACTION:-0.05}
MAX_TOKENS=${MAX_TOKENS:-32}
SERVE_ARGS=${SERVE_ARGS:-+method=ngram}
TRANSCRIBE_FRACTION=${TRANSCRIBE_FRACTION:-0}
AUDIO_DIR=${AUDIO_DIR:-}
export SERVE_ARGS
SIG_CLIENTS=${SIG_CLIENTS:-16}
SIG_DURATION_S=${SIG_DURATION_S:-30}
SIGTERM_AFTER_S=${SIGTERM_AFTER_S:-12}
DRAIN_TIMEOUT_S=${DRAIN_TIMEOUT_S:-30}
MARGIN_S=15
OUT=${OUT:-results}
SUFFIX=""
[ "$DTYPE" != "bfloat16" ] && SUFFIX="-$DTYPE"
mkdir -p "$OUT"
REF="$OUT/load-reference$SUFFIX.json"
unset SPECSERVE_API_KEY  # the run talks to its own server without a key

SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
    fi
}
trap cleanup EXIT

log() { echo "[load_run $(date +%H:%M:%S)] $*"; }

start_server() {  # $1 grpc port, $2 http port, $3 log file
    # shellcheck disable=SC2086  # SERVE_ARGS: several overrides
    .venv/bin/specserve $SERVE_ARGS "model.dtype=$DTYPE" server.host=127.0.0.1 \
        "server.grpc_port=$1" "server.http_port=$2" "server.drain_timeout_s=$DRAIN_TIMEOUT_S" >"$3" 2>&1 &
    SERVER_PID=$!
    log "server pid $SERVER_PID (gRPC $1, HTTP $2), log $3"
    if ! $PY scripts/load_run.py wait-health "http://127.0.0.1:$2" --timeout-s 300 --pid "$SERVER_PID"; then
        tail -20 "$3"
        exit 1
    fi
    log "server healthy"
}

FAIL=0

# The references and both servers must run the same code: note it (others may edit the tree).
$PY scripts/load_run.py fingerprint --save "$OUT/load-source$SUFFIX.json"

# ---------------------------------------------------------------- phase 1
log "offline references (dtype $DTYPE, max_tokens $MAX_TOKENS)"
$PY scripts/load_run.py reference --dtype "$DTYPE" --max-tokens "$MAX_TOKENS" --out "$REF" || exit 1

read -r GRPC1 HTTP1 GRPC2 HTTP2 < <($PY scripts/load_run.py ports 4)
start_server "$GRPC1" "$HTTP1" "$OUT/load-server$SUFFIX.log"

log "load: $CLIENTS clients, ${DURATION_S}s, cancel $CANCEL_FRACTION, bad $BAD_FRACTION, max_tokens $MAX_TOKENS"
.venv/bin/specserve-loadgen --grpc-target "127.0.0.1:$GRPC1" --http-url "http://127.0.0.1:$HTTP1" \
    --clients "$CLIENTS" --duration-s "$DURATION_S" --cancel-fraction "$CANCEL_FRACTION" \
    --bad-fraction "$BAD_FRACTION" --hostile-fraction "$HOSTILE_FRACTION" --bad-grammar \
    --transcribe-fraction "$TRANSCRIBE_FRACTION" ${AUDIO_DIR:+--audio-dir "$AUDIO_DIR"} \
    --max-tokens "$MAX_TOKENS" --temperature 0 --reference "$REF" \
    --output "$OUT/load-ngram$SUFFIX.json" >/dev/null
LOAD_RC=$?
log "loadgen exit code $LOAD_RC"
[ $LOAD_RC -ne 0 ] && FAIL=1

log "metrics at the end"
$PY scripts/load_run.py metrics "http://127.0.0.1:$HTTP1" --out "$OUT/load-metrics$SUFFIX.json" || FAIL=1

if [ "$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['mismatches']['count'])" "$OUT/load-ngram$SUFFIX.json")" != "0" ]; then
    log "mismatches: top-2 logit gaps where the answers diverge"
    $PY scripts/load_run.py ties --report "$OUT/load-ngram$SUFFIX.json" --ids "${REF%.json}-ids.json" \
        --dtype "$DTYPE" --out "$OUT/load-ties$SUFFIX.json"
fi

log "stopping the phase-1 server (SIGTERM, idle)"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
log "phase-1 server exit code $?"
SERVER_PID=""

# ---------------------------------------------------------------- phase 2: SIGTERM under load
start_server "$GRPC2" "$HTTP2" "$OUT/load-server-sigterm$SUFFIX.log"
log "load: $SIG_CLIENTS clients, ${SIG_DURATION_S}s; SIGTERM after ${SIGTERM_AFTER_S}s"
.venv/bin/specserve-loadgen --grpc-target "127.0.0.1:$GRPC2" --http-url "http://127.0.0.1:$HTTP2" \
    --clients "$SIG_CLIENTS" --duration-s "$SIG_DURATION_S" --cancel-fraction "$CANCEL_FRACTION" \
    --bad-fraction "$BAD_FRACTION" --hostile-fraction "$HOSTILE_FRACTION" --bad-grammar \
    --transcribe-fraction "$TRANSCRIBE_FRACTION" ${AUDIO_DIR:+--audio-dir "$AUDIO_DIR"} \
    --max-tokens "$MAX_TOKENS" --temperature 0 --reference "$REF" \
    --expect-shutdown --output "$OUT/load-sigterm-loadgen$SUFFIX.json" >/dev/null &
LG_PID=$!
sleep "$SIGTERM_AFTER_S"
log "SIGTERM -> $SERVER_PID"
T0=$(date +%s.%N)
kill -TERM "$SERVER_PID"
LIMIT=$((DRAIN_TIMEOUT_S + MARGIN_S))
while kill -0 "$SERVER_PID" 2>/dev/null; do
    if awk -v a="$(date +%s.%N)" -v b="$T0" -v l="$LIMIT" 'BEGIN { exit !(a - b > l) }'; then
        log "server still running ${LIMIT}s after SIGTERM: killing it"
        kill -KILL "$SERVER_PID"
        break
    fi
    sleep 0.1
done
wait "$SERVER_PID"
SERVER_RC=$?
EXIT_S=$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN { printf "%.2f", a - b }')
SERVER_PID=""
log "server exit code $SERVER_RC, ${EXIT_S}s after SIGTERM"
wait "$LG_PID"
log "loadgen exit code $?"
$PY scripts/load_run.py sigterm --report "$OUT/load-sigterm-loadgen$SUFFIX.json" --server-rc "$SERVER_RC" \
    --exit-s "$EXIT_S" --sigterm-after-s "$SIGTERM_AFTER_S" --drain-timeout-s "$DRAIN_TIMEOUT_S" \
    --margin-s "$MARGIN_S" --out "$OUT/load-sigterm$SUFFIX.json" || FAIL=1

if CHANGED=$($PY scripts/load_run.py fingerprint --compare "$OUT/load-source$SUFFIX.json"); then
    log "specserve/*.py unchanged during the run"
else
    log "WARNING: specserve/*.py changed during the run (the servers may not run the references' code): $CHANGED"
    FAIL=1
fi

# ---------------------------------------------------------------- figures
$PY - "$OUT/load-ngram$SUFFIX.json" "$OUT/load-sigterm$SUFFIX.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
s = json.load(open(sys.argv[2]))
f = lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms"
print("== load (phase 1) ==")
print(f"requests: {r['requests']}  accepted {r['accepted']}  lost {r['lost']['count']}")
print(f"requests/s {r['requests_per_s']:.2f}  tokens/s {r['tokens_per_s']:.1f}  completion tokens {r['completion_tokens']}")
print(f"TTFT p50 {f(r['ttft_s']['p50'])} p99 {f(r['ttft_s']['p99'])}; ITL p50 {f(r['itl_s']['p50'])} p99 {f(r['itl_s']['p99'])}; "
      f"TPOT p50 {f(r['tpot_s']['p50'])} p99 {f(r['tpot_s']['p99'])}")
print(f"errors expected {r['errors']['expected']}  unexpected {r['errors']['unexpected']}")
print(f"mismatches {r['mismatches']['count']} of {r['mismatches']['checked']} checked; after_run {r['after_run']}")
l = s["loadgen"]
print("== SIGTERM (phase 2) ==")
print(f"server exit code {s['server_exit_code']}, exited {s['server_exit_s_after_sigterm']} s after SIGTERM "
      f"(sent at {s['sigterm_after_s']} s; drain timeout {s['drain_timeout_s']} s)")
print(f"requests: {l['requests']}  accepted {l['accepted']}  finish_reasons {l['finish_reasons']}  lost {l['lost']['count']}")
print(f"errors expected {l['errors']['expected']}  unexpected {l['errors']['unexpected']}")
print(f"mismatches {l['mismatches']['count']} of {l['mismatches']['checked']} checked")
print(f"checks {s['checks']}")
EOF
log "done: $([ $FAIL -eq 0 ] && echo PASS || echo FAIL)"
exit $FAIL
