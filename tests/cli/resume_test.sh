#!/usr/bin/env bash
# `loom train` killed and resumed gives the run that was never stopped
# (docs/training.md "Checkpoints and resume"), on the tiny model:
#  1. SIGKILL at random moments (LOOM_FAILPOINTS crash@checkpoint_write too,
#     when this build has that site), `--resume` until it exits 0: the same
#     per-step losses (metrics_file) and the same adapter bytes as an
#     uninterrupted run, at 1 and at 2 threads;
#  2. SIGTERM: exit 75 after a checkpoint of the last finished step; the resumed
#     run again matches;
#  3. a second signal: exit at once with 128 + N.
# Usage: resume_test.sh LOOM_BINARY SOURCE_DIR
set -u
loom=$1
src=$2
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
RANDOM=${RESUME_TEST_SEED:-$$}
echo "random seed: $RANDOM (set RESUME_TEST_SEED to repeat)"

python3 - "$tmp/train.jsonl" <<'EOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(37):
        f.write(json.dumps({"text": f"line {i}: the {'quick' if i % 3 else 'slow'} fox jumps over dog {i * 7}"}) + "\n")
EOF

# config NAME THREADS STEPS: a LoRA run with dropout, accumulation, a warm-up
# cosine schedule and partial last batches (37 rows, batch 4).
config() {
  cat >"$tmp/$1.yaml" <<EOF
model: $tiny
data: {train: $tmp/train.jsonl, seq_len: 32, pack: false, eval_fraction: 0.1}
lora: {r: 4, dropout: 0.1}
optim: {lr: 3.0e-3, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 5}
batch_size: 4
grad_accum: 2
steps: $3
eval_interval: 7
checkpoint_interval: 3
keep_checkpoints: 2
seed: 11
threads: $2
log_interval: 1000
output_dir: $tmp/$1
metrics_file: $tmp/$1.metrics.jsonl
EOF
}

# The metrics lines without their timing fields.
losses() {
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    for k in ("step_seconds", "elapsed_seconds", "tokens_per_s"):
        j.pop(k, None)
    print(json.dumps(j, sort_keys=True))' "$1"
}

same_run() {  # NAME REF RUN
  if ! diff <(losses "$tmp/$2.metrics.jsonl") <(losses "$tmp/$3.metrics.jsonl") >"$tmp/diff"; then
    bad "$1: metrics differ from the uninterrupted run"; head -5 "$tmp/diff"; return
  fi
  if ! cmp -s "$tmp/$2/adapter_model.safetensors" "$tmp/$3/adapter_model.safetensors" ||
    ! cmp -s "$tmp/$2/adapter_config.json" "$tmp/$3/adapter_config.json"; then
    bad "$1: adapter bytes differ"; return
  fi
  ok
}

failpoint_site=0
grep -q '"checkpoint_write"' "$src/src/core/failpoints.h" 2>/dev/null && failpoint_site=1

# Runs NAME with --resume, SIGKILLed after random delays, until it exits 0.
kill_until_done() {
  local name=$1 tries=0 kills=0 crashes=0 rc
  while [ $tries -lt 40 ]; do
    tries=$((tries + 1))
    # Each step sleeps 15 ms (results do not depend on timing), so the random kills land inside
    # the run however fast the machine is; every third start dies inside a checkpoint write
    # (after its files, before the rename).
    local fp="sleep_ms=15@step"
    if [ $failpoint_site = 1 ] && [ $((tries % 3)) = 2 ]; then fp="$fp,crash@checkpoint_write"; fi
    LOOM_FAILPOINTS=$fp "$loom" train "$tmp/$name.yaml" --resume >>"$tmp/$name.log" 2>&1 &
    local pid=$!
    local delay_ms=$((50 + RANDOM % 400 + tries * 20))
    sleep "$(printf '0.%03d' $((delay_ms > 999 ? 999 : delay_ms)))"
    local killed=0
    kill -KILL $pid 2>/dev/null && killed=1 && kills=$((kills + 1))
    wait $pid 2>/dev/null
    rc=$?
    [ -n "$fp" ] && [ $killed = 0 ] && [ $rc = 137 ] && crashes=$((crashes + 1))
    if [ $rc = 0 ]; then
      echo "$name: done after $tries starts, $kills SIGKILLs ($crashes inside a checkpoint write)"
      return 0
    fi
    if [ $rc != 137 ]; then
      bad "$name: exit $rc (not a kill)"; tail -5 "$tmp/$name.log"; return 1
    fi
  done
  bad "$name: not done after $tries starts"
  return 1
}

for threads in 1 2; do
  config "ref$threads" $threads 40
  if ! "$loom" train "$tmp/ref$threads.yaml" >"$tmp/ref$threads.log" 2>&1; then
    bad "reference run at $threads threads"; tail -5 "$tmp/ref$threads.log"; continue
  fi
  config "kill$threads" $threads 40
  kill_until_done "kill$threads" && same_run "SIGKILL + resume, $threads threads" "ref$threads" "kill$threads"
  grep -q "resumed from" "$tmp/kill$threads.log" || bad "kill$threads: never resumed from a checkpoint"
done

# The CPU kernels give the same bits at 1 and 2 threads (docs: a resume at another thread count is exact).
if [ -f "$tmp/ref1/adapter_model.safetensors" ] && [ -f "$tmp/ref2/adapter_model.safetensors" ]; then
  same_run "1 thread vs 2 threads" ref1 ref2
fi

# SIGTERM: the current step ends, a checkpoint is written, exit 75; --resume completes it.
config term 2 40
wait_steps() {  # FILE N: until FILE has N step lines (or 30 s)
  for _ in $(seq 300); do
    [ -f "$1" ] && [ "$(grep -c '"loss"' "$1")" -ge "$2" ] && return 0
    sleep 0.1
  done
  return 1
}
LOOM_FAILPOINTS=sleep_ms=40@step "$loom" train "$tmp/term.yaml" --set threads=2 >"$tmp/term.log" 2>&1 &
pid=$!
wait_steps "$tmp/term.metrics.jsonl" 4
kill -TERM $pid
wait $pid
rc=$?
if [ $rc = 75 ]; then ok; else bad "SIGTERM: exit $rc, wanted 75"; tail -3 "$tmp/term.log"; fi
last=$(grep -c '"loss"' "$tmp/term.metrics.jsonl")
ck=$(printf '%s/term/checkpoints/step-%08d' "$tmp" "$last")
if [ -f "$ck/manifest.json" ] && grep -q "stopped by SIGTERM after step $last" "$tmp/term.log"; then ok; else
  bad "SIGTERM: no checkpoint $ck or no stop record"; tail -3 "$tmp/term.log"
fi
# The hint repeats the --set overrides and names the checkpoint (without them another run could resume).
grep -q "continue with loom train $tmp/term.yaml --set threads=2 --resume $ck" "$tmp/term.log" && ok ||
  { bad "SIGTERM: the resume hint lacks the overrides or the checkpoint"; grep "continue with" "$tmp/term.log"; }
# A checkpoint past the run's steps is refused (it resumed and "trained" past them before).
"$loom" train "$tmp/term.yaml" --set steps=1 --resume "$ck" >"$tmp/past.log" 2>&1
rc=$?
grep -q "the checkpoint is at step $last, past this run's 1 steps" "$tmp/past.log" && [ $rc = 1 ] && ok ||
  { bad "resume past steps: exit $rc"; tail -2 "$tmp/past.log"; }
if "$loom" train "$tmp/term.yaml" --set threads=2 --resume "$ck" >>"$tmp/term.log" 2>&1; then
  same_run "SIGTERM + --resume PATH" ref2 term
else
  bad "resume after SIGTERM"; tail -3 "$tmp/term.log"
fi

# A second signal while the first is being handled: exit at once, 128 + N.
config twice 2 400
LOOM_FAILPOINTS=sleep_ms=40@step "$loom" train "$tmp/twice.yaml" >"$tmp/twice.log" 2>&1 &
pid=$!
wait_steps "$tmp/twice.metrics.jsonl" 4  # step-00000003 exists
kill -USR1 $pid
kill -INT $pid
wait $pid
rc=$?
if [ $rc = 130 ] || [ $rc = 138 ]; then ok; else bad "second signal: exit $rc, wanted 130 (SIGINT) or 138 (SIGUSR1)"; fi

# Without --resume, a second run into the same output_dir is refused (its checkpoints).
"$loom" train "$tmp/twice.yaml" >"$tmp/again.log" 2>&1
rc=$?
if [ $rc = 1 ] && grep -q -- "--resume" "$tmp/again.log" && grep -q -- "--overwrite" "$tmp/again.log"; then ok; else
  bad "rerun without --resume: exit $rc"; tail -3 "$tmp/again.log"
fi

echo "resume_test: $pass passed, $fail failed"
[ $fail = 0 ]
