#!/usr/bin/env bash
# The cost of structured outputs (issue 20): one `sluice serve`, c32 runs of the serve
# workload (64 streamed /v1/completions, ~210-token prompts, 128 output tokens) with every
# request free and with every request constrained by a JSON schema (a list of at least 20
# customer records: integers and numbers with ranges, a string pattern, enums, bounded
# strings, a nested array; its shortest document is longer than 128 tokens, so every
# request runs to max_tokens in both), alternating ROUNDS times in one sitting. After each
# constrained run, the server's grammar counters (/metrics): rows masked, seconds filling
# masks beside the forward pass, seconds the steps waited for them, compiles.
#
#   ROUNDS=3 bash benchmarks/structured.sh [extra serve flags]
#   .venv/bin/python benchmarks/structured_table.py      # the table for docs/benchmarks.md
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
if [ -z "${STRUCTURED_LOCKED:-}" ]; then
    exec env STRUCTURED_LOCKED=1 flock /tmp/cpu.lock bash "$SELF" "$@"
fi
PORT=${PORT:-8131}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-benchmarks/results/structured}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
SCHEMA='{"type": "array", "minItems": 20, "maxItems": 40, "items": {"type": "object", "properties": {
  "id": {"type": "integer", "minimum": 0, "maximum": 100000},
  "name": {"type": "string", "maxLength": 24},
  "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,8}\\.(com|org)$"},
  "active": {"type": "boolean"},
  "score": {"type": "number", "minimum": 0, "maximum": 100},
  "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "vip", "churn", "trial"]}}},
  "required": ["id", "name", "email", "active", "score", "tags"], "additionalProperties": false}}'
EXTRA=$(python3 -c 'import json, sys; print(json.dumps({"structured_outputs": {"json": json.loads(sys.argv[1])}}))' "$SCHEMA")

. benchmarks/sluice_server.sh
start_server "$OUT/server.log" "$@"
bench() {  # NAME SEED [bench flags]: fresh prompts per run (a seed of its own), so that no
    # run finds an earlier run's prompts in the prefix cache
    local name=$1 seed=$2; shift 2
    .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency 32 --requests 64 \
        --input-len 210 --output-len 128 --seed "$seed" --json "$OUT/$name.json" "$@" > /dev/null
}
for r in $(seq 1 "$ROUNDS"); do
    # Alternate the order round by round (ABBA...), so a drift of the machine hits both.
    if [ $((r % 2)) -eq 1 ]; then order="free json"; else order="json free"; fi
    for cfg in $order; do
        if [ "$cfg" = free ]; then
            bench "free_r$r" $((100 + r))
        else
            bench "json_r$r" $((200 + r)) --extra-body "$EXTRA"
            curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sluice_grammar_[a-z_]+_total' > "$OUT/json_r$r.metrics"
        fi
        echo "[structured] round $r: $cfg done" >&2
    done
done
stop_server
