# The served run that benchmarks/serve_ab.sh and benchmarks/event_loop_ab.sh alternate
# (sourced: it reads their PORT, OUT, FLAGS, CONCURRENCY, REQUESTS and BENCH_EXTRA). One
# run starts `sluice serve FLAGS` with the env assignments given, drives it with `sluice
# bench serve` (~210-token prompts, 128 output tokens), stops it, and prints output tok/s,
# TTFT and TPOT p50 and the API server process's own CPU seconds over the measured run.
run() {  # NAME, then env assignments for the server
  local name=$1; shift
  env "$@" HF_HUB_OFFLINE=1 .venv/bin/python -c \
      "import sys; from sluice.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" \
      serve --port "$PORT" "${FLAGS[@]}" > "$OUT/$name.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  local cpu0; cpu0=$(awk '{print $14 + $15}' "/proc/$server/stat")
  .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
      --input-len 210 --output-len 128 ${BENCH_EXTRA:+--extra-body "$BENCH_EXTRA"} --json "$OUT/$name.json" > /dev/null
  local cpu1; cpu1=$(awk '{print $14 + $15}' "/proc/$server/stat")
  kill -TERM "$server"; wait "$server" || true
  .venv/bin/python -c "import json, os, sys; r = json.load(open(sys.argv[1]))['runs'][0]; \
cpu = (int(sys.argv[4]) - int(sys.argv[3])) / os.sysconf('SC_CLK_TCK'); \
print(sys.argv[2], f\"{r['output_tok_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, TPOT p50 {1e3 * r['tpot_p50_s']:.2f} ms, server CPU {cpu:.2f} s\")" \
      "$OUT/$name.json" "$name" "$cpu0" "$cpu1"
}
