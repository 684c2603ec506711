#!/usr/bin/env bash
# Fault handling of `loom train` end to end, through LOOM_FAILPOINTS: a bad
# spec is refused (exit 1, naming the variable and the entry); a skipped
# non-finite step lets the run finish (exit 0, a warning naming the tensor);
# divergence stops with exit 4; an internal error exits 70 and an I/O error 3,
# each told once, as an error record (text, and JSON with --log-format json)
# with the step; crash is a SIGKILL (137). Usage: train_faults_test.sh LOOM SOURCE_DIR
set -u
loom=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }

printf 'model: %s\ndata:\n  train: %s\n  seq_len: 32\nsteps: 4\nbatch_size: 2\noutput_dir: %s\nthreads: 1\n' \
  "$src/tests/fixtures/model/tiny-llama.f32.gguf" "$src/tests/fixtures/train_data/text.jsonl" "$tmp/out" \
  >"$tmp/run.yaml"

# run NAME FAILPOINTS EXPECTED_EXIT PATTERN [loom train flags...]
run() {
  local name=$1 spec=$2 want=$3 pattern=$4
  shift 4
  local rc
  { # (the braces keep bash's "Killed" note of the crash case off the test's output)
    LOOM_FAILPOINTS=$spec "$loom" train "$tmp/run.yaml" --set output_dir="$tmp/out-$name" "$@" \
      >"$tmp/$name.out" 2>"$tmp/$name.err"
    rc=$?
  } 2>/dev/null
  if [ "$rc" != "$want" ]; then
    bad "$name: exit $rc, wanted $want"; sed 's/^/    /' "$tmp/$name.err" | tail -5; return 1
  fi
  if ! grep -qE -- "$pattern" "$tmp/$name.err"; then
    bad "$name: stderr lacks /$pattern/"; sed 's/^/    /' "$tmp/$name.err" | tail -5; return 1
  fi
  ok
}

run bad_spec 'nan_grad@step=2,crash@nowhere' 1 "LOOM_FAILPOINTS: failpoint 'crash@nowhere': unknown site 'nowhere'"
if grep -q "model:" "$tmp/bad_spec.err"; then bad "bad_spec: the model was loaded first"; else ok; fi
run bad_action 'nan_gard@step=2' 1 "unknown action 'nan_gard'"

run skipped 'nan_grad@step=2' 0 "adapter written to"
grep -qE "warning: step 2: non-finite gradient \(nan in layers\.[0-9]+\.[a-z_]+\.[a-z_]+_proj\.lora_[AB], arena element [0-9]+\); step not applied" \
  "$tmp/skipped.err" && ok || { bad "skipped: no warning naming the tensor"; tail -5 "$tmp/skipped.err"; }
grep -q "trained 4 steps" "$tmp/skipped.err" && ok || bad "skipped: the run did not make its 4 steps"

run diverged 'nan_grad@step=2..' 4 "training diverged at step 2: 2 steps in a row" \
  --set on_divergence=stop --set max_bad_steps=2
grep -q "on_divergence: stop" "$tmp/diverged.err" && ok || bad "diverged: the reason is not named"

run internal 'throw@step=3' 70 "error: training failed during step 3: failpoint 'throw@step=3' fired at step 3"
# Told once: the trainer's record, not a second line from the app.
n=$(grep -c "failpoint 'throw@step=3'" "$tmp/internal.err")
[ "$n" = 1 ] && ok || bad "internal: the error is printed $n times"
grep -q "no checkpoint to resume from" "$tmp/internal.err" && ok || bad "internal: says nothing about resuming"

run io 'io_error@step=2' 3 "injected I/O error at step 2"
run io_checkpoint 'io_error@step=3' 3 "resume from .*step-00000002 with: loom train .*run.yaml --resume" \
  --set checkpoint_interval=2

# --log-format json: stderr is JSON lines only, the last one the error record.
run json 'throw@step=2' 70 '"error":\{[^}]*"type":"internal"' --log-format json
python3 - "$tmp/json.err" <<'EOF' && ok || bad "json: stderr is not JSON lines ending in the error record"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
last = lines[-1]
assert last["log.level"] == "error" and last["event"]["action"] == "error", last
assert last["loom"]["step"] == 2 and last["loom"]["exit_code"] == 70, last
EOF

run crash 'crash@step=2' 137 "model:"
[ -e "$tmp/out-crash/adapter_config.json" ] && bad "crash: an adapter was written" || ok

echo "train_faults: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
