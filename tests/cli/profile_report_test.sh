#!/usr/bin/env bash
# `loom profile report` and `advise` on the committed synthetic traces
# (tests/fixtures/profile, made by make_traces.py): the tables and their
# numbers, --top, --json that parses, the peak measured once into --peak-cache
# and then read back, the advice naming its settings, and bad input exiting
# non-zero with the path in the message.
# Usage: profile_report_test.sh LOOM_BINARY SOURCE_DIR
set -u
loom=$1
src=$2
fix=$src/tests/fixtures/profile
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }

# expect NAME EXPECTED_EXIT PATTERN -- command...   (PATTERN searched in stdout and stderr)
expect() {
  local name=$1 want_rc=$2 pattern=$3
  shift 4
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne "$want_rc" ]; then
    bad "$name: exit $rc, wanted $want_rc"; sed 's/^/    /' "$tmp/err" | head -5; return
  fi
  if ! grep -qE -- "$pattern" "$tmp/out" "$tmp/err"; then
    bad "$name: output lacks /$pattern/"; sed 's/^/    /' "$tmp/out" "$tmp/err" | head -20; return
  fi
  ok
}
has() {  # has NAME PATTERN: in the last command's stdout
  if grep -qE -- "$2" "$tmp/out"; then ok; else bad "$1: stdout lacks /$2/"; sed 's/^/    /' "$tmp/out" | head -40; fi
}
json_ok() {  # json_ok NAME PYTHON_ASSERTIONS (j is the last stdout, parsed)
  if python3 -m json.tool "$tmp/out" >/dev/null && python3 -c "import json,sys; j=json.load(open('$tmp/out')); $2"; then
    ok
  else
    bad "$1: --json output is not JSON or fails: $2"
  fi
}

train=$fix/train_small.json
serve=$fix/serve_small.json

# The report without a peak: header, the phase table (4 steps of 537.3 ms), op kinds, layers, classes.
expect "report" 0 "4 steps: 2.15 s, 537.3 ms a step \(recording 2.55 s\)" -- "$loom" profile report "$train" --no-peak
has "report phases" "^  backward +1.06 s +49.4% +4 +265.6 ms"
has "report optimizer" "^  optimizer +640.0 ms +29.8% +4 +160.0 ms"
has "report waiting" "^  waiting \(threads idle inside ops\) +295.5 ms +13.7%"
has "report outside" "outside the accounted time: data 300.0 ms \(1x\)"
has "report ops" "^  linear_backward_input +32 +1.06 s +49.3% +33.1 ms +212.0 ms"
has "report layers" "^  outside the layers +4 +639.2 ms +29.7%"
has "report layer rows" "^layers \(top 2 of 2\)"
has "report classes" "^  matmul q4_1 batch +416 +32 +441.7 ms +20.6% +60.0 "
has "report no peak" "no peak: --no-peak"
expect "report top" 0 "op kinds \(top 2 of 4\)" -- "$loom" profile report "$train" --no-peak --top 2
has "report top rest" "\(2 more\)"
expect "report top 1" 0 "layers \(top 1 of 2\)" -- "$loom" profile report "$train" --no-peak --top 1
has "report top layers" "^  \(1 more\) +[0-9]+ +[0-9.]+ ms +[0-9.]+%  \([0-9.]+ ms to [0-9.]+ ms each\)"

# --json: one object with the same numbers.
expect "report json" 0 "" -- "$loom" profile report "$train" --no-peak --json
json_ok "report json" "assert j['units'] == 4 and j['unit'] == 'step'; assert abs(j['total_us'] - 2149164) < 1e-3; \
assert [p['name'] for p in j['phases']][:2] == ['backward', 'optimizer']; assert len(j['ops']) == 4; \
assert j['matmuls'][0]['peak'] is None"

# The peak: measured once with the trace's 2 threads into --peak-cache, the path printed; then read back.
peak=$tmp/cache/peak.json
expect "peak measured" 0 "peak $peak \(measured in [0-9.]+ s, 2 threads\)" -- \
  "$loom" profile report "$train" --peak-cache "$peak" --json
json_ok "peak json" "c = j['matmuls'][0]; assert c['peak'] > 0 and c['fraction_of_peak'] > 0 and j['peak']['threads'] == 2"
python3 -m json.tool "$peak" >/dev/null && ok || bad "peak cache is not JSON"
expect "peak cached" 0 "peak $peak \(cached, 2 threads\)" -- "$loom" profile report "$train" --peak-cache "$peak"
has "peak column" "matmul q4_1 batch .*GFLOP/s +[0-9.]+%"
echo "not json" >"$peak"
expect "peak corrupt" 0 "note: $peak: not JSON.*measured again" -- "$loom" profile report "$train" --peak-cache "$peak"

# Advice on the training trace: the rules it was made to trip, each with its setting.
expect "advise" 0 "\[optimizer_time\] the optimizer is 29.8% of the step" -- \
  "$loom" profile advise "$train" --peak-cache "$peak"
has "advise grad_accum" "change: grad_accum: 4"
has "advise data" "change: data.cache_dir"
has "advise activations" "change: gradient_checkpointing: 1"
has "advise waiting" "\[thread_waiting\] the 2 pool threads waited 13.7%"
has "advise backward" "change: backward: bf16"
has "advise gain" "gain: "
expect "advise json" 0 "" -- "$loom" profile advise "$train" --no-peak --json
json_ok "advise json" "rules = {f['rule'] for f in j['findings']}; \
assert {'optimizer_time', 'data_loading', 'activation_memory', 'thread_waiting'} <= rules, rules; \
assert all(f['change'] for f in j['findings'])"

# Serving: prefill stalls and preemptions.
expect "advise serve" 0 "\[serve_prefill_stall\]" -- "$loom" profile advise "$serve" --no-peak
has "advise serve kv" "change: --kv-cache-memory 1.5x the current \(96 blocks instead of 64\)"
has "advise serve tokens" "change: --max-batch-tokens [0-9]+"
expect "report serve" 0 "40 top-level phases \(serve_step\)" -- "$loom" profile report "$serve" --no-peak

# Bad input: non-zero exit and the path in the message.
expect "missing" 1 "$tmp/none.json" -- "$loom" profile report "$tmp/none.json" --no-peak
expect "missing advise" 1 "trace file '$tmp/none.json' does not exist" -- "$loom" profile advise "$tmp/none.json"
echo '{"traceEvents": [{"name": "step", "cat": "phase", "ph": "X", "ts": 0}]}' >"$tmp/nodur.json"
expect "no dur" 1 "$tmp/nodur.json: traceEvents\[0\] \(\"step\"\): no \"dur\"" -- \
  "$loom" profile report "$tmp/nodur.json" --no-peak
echo '{"traceEvents": ' >"$tmp/bad.json"
expect "not json" 1 "$tmp/bad.json: not JSON" -- "$loom" profile advise "$tmp/bad.json" --no-peak
expect "no subcommand" 2 "" -- "$loom" profile
expect "both peak flags" 2 "excludes" -- "$loom" profile report "$train" --no-peak --peak-cache "$peak"

echo "profile_report: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
