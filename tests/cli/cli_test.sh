#!/usr/bin/env bash
# Command-line behaviour of `loom`: every subcommand's --help, and bad input
# (missing file, unsupported model, prompt longer than the context, invalid
# flag values) gives a clear message and a non-zero exit, never a crash.
# Usage: cli_test.sh LOOM_BINARY SOURCE_DIR
set -u
loom=$1
src=$2
model=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

# expect NAME EXPECTED_EXIT PATTERN -- command...
expect() {
  local name=$1 want_rc=$2 pattern=$3
  shift 4
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ge 128 ]; then
    echo "FAIL $name: crashed with signal $((rc - 128))"; fail=$((fail + 1)); return
  fi
  if [ "$want_rc" = nonzero ] && [ "$rc" -eq 0 ] || [ "$want_rc" != nonzero ] && [ "$rc" -ne "$want_rc" ]; then
    echo "FAIL $name: exit $rc, wanted $want_rc"; sed 's/^/    /' "$tmp/err" | head -5; fail=$((fail + 1)); return
  fi
  if ! grep -qiE -- "$pattern" "$tmp/out" "$tmp/err"; then
    echo "FAIL $name: output lacks /$pattern/"; sed 's/^/    /' "$tmp/err" | head -5; fail=$((fail + 1)); return
  fi
  pass=$((pass + 1))
}

for cmd in info tokenize generate chat bench; do
  expect "help $cmd" 0 "usage|options" -- "$loom" "$cmd" --help
done
expect "no command" nonzero "usage" -- "$loom"
expect "unknown command" 2 "unknown command 'frobnicate'" -- "$loom" frobnicate
expect "missing model file" 1 "no-such.gguf.*(cannot open|no such)" -- "$loom" info -m "$tmp/no-such.gguf"
expect "missing -m" 2 "model.*required" -- "$loom" generate -p hi
printf 'GGUF\x03\x00\x00\x00garbage' >"$tmp/bad.gguf"
expect "corrupt gguf" 1 "bad.gguf" -- "$loom" info -m "$tmp/bad.gguf"
head -c 1000 "$tiny" >"$tmp/trunc.gguf"
expect "truncated gguf" 1 "trunc.gguf" -- "$loom" info -m "$tmp/trunc.gguf"
mkdir -p "$tmp/folder"
echo '{"model_type": "gpt_neox", "hidden_size": 64}' >"$tmp/folder/config.json"
expect "unknown architecture" 1 "gpt_neox" -- "$loom" info -m "$tmp/folder"
expect "bad thread count" 2 "thread count must be >= 1 \\(got 0\\)" -- "$loom" generate -m "$tiny" -p hi -t 0
expect "negative thread count" 2 "thread count must be >= 1" -- "$loom" bench -m "$tiny" -p 4 -n 2 -r 1 -t -2
# More threads than CPUs are capped with a warning (a spinning pool with 1024 threads never finished).
expect "thread count capped" 0 "warning: -t 1024 asks for 1024 threads.*using [0-9]+ threads" -- \
  timeout 30 "$loom" generate -m "$tiny" -p hi -n 2 -t 1024
expect "negative temperature" 1 "temperature" -- "$loom" generate -m "$tiny" -p hi --temp -1
expect "top-p out of range" 1 "top_p" -- "$loom" generate -m "$tiny" -p hi --top-p 1.5
expect "non-numeric n" 2 "n-predict|could not be converted|invalid" -- "$loom" generate -m "$tiny" -p hi -n abc
expect "empty prompt" 1 "prompt is empty" -- "$loom" generate -m "$tiny" -p ""
expect "prompt file missing" 1 "nofile.txt" -- "$loom" generate -m "$tiny" -f "$tmp/nofile.txt"

# loom train: config keys are checked before anything is loaded.
expect "help train" 0 "usage|options" -- "$loom" train --help
printf 'model: %s\ndata:\n  train: %s\nsteps: 2\noutput_dir: %s\n' \
  "$tiny" "$src/tests/fixtures/train_data/text.jsonl" "$tmp/adapter" >"$tmp/train.yaml"
{ cat "$tmp/train.yaml"; echo 'batchsize: 2'; } >"$tmp/bad_train.yaml"
expect "train unknown key" 1 "bad_train.yaml:6:1: unknown key 'batchsize'" -- "$loom" train "$tmp/bad_train.yaml"
expect "train bad --set" 1 "unknown key 'optim.lrr'" -- "$loom" train "$tmp/train.yaml" --set optim.lrr=1
expect "train bad type" 1 "'steps'.*expected an integer" -- "$loom" train "$tmp/train.yaml" --set steps=many
expect "train tiny" 0 "adapter written to" -- "$loom" train "$tmp/train.yaml" --set data.seq_len=32 -t 1
expect "train threads capped" 0 "warning: threads 1000 asks for 1000 threads" -- \
  timeout 30 "$loom" train "$tmp/train.yaml" --set data.seq_len=32 --set output_dir="$tmp/adapter-t" -t 1000

# loom serve: bad flags and files fail before binding, with the flag or file named.
expect "help serve" 0 "usage|options" -- "$loom" serve --help
expect "serve missing -m" 2 "model.*required" -- "$loom" serve
expect "serve bad adapter spec" 1 "--adapter 'nodir': expected NAME=DIR" -- "$loom" serve -m "$tiny" --adapter nodir
expect "serve missing adapter" 1 "adapter 'a'.*missing-adapter" -- "$loom" serve -m "$tiny" --adapter a="$tmp/missing-adapter" --port 0
expect "serve bad kv size" 1 "kv-cache-memory '12X'" -- "$loom" serve -m "$tiny" --kv-cache-memory 12X
expect "serve kv too small" 1 "fewer than one sequence" -- "$loom" serve -m "$tiny" --kv-cache-memory 1K --port 0
expect "serve context too long" 1 "max-model-len 100000 exceeds" -- "$loom" serve -m "$tiny" --max-model-len 100000
expect "serve bad adapter dir" 1 "adapter-dir.*not a directory" -- "$loom" serve -m "$tiny" --adapter-dir "$tmp/nope" --port 0
expect "serve key file missing" 1 "api-key-file" -- "$loom" serve -m "$tiny" --api-key-file "$tmp/nokey" --port 0

if [ -f "$model" ]; then
  expect "info smollm2" 0 "architecture: +llama" -- "$loom" info -m "$model"
  expect "tokenize ids" 0 '^\[504, 3575, 282, 4649, 314\]$' -- "$loom" tokenize -m "$model" --text "The capital of France is" --ids
  expect "greedy generate" 0 "Paris" -- "$loom" generate -m "$model" -p "The capital of France is" -n 8 --temp 0 -t 2
  expect "generation speed on stderr" 0 "generation: 8 tokens.*tokens/s" -- "$loom" generate -m "$model" -p "Hello" -n 8 --temp 0 --seed 1 -t 2
  python_prompt=$(printf 'word %.0s' $(seq 1 300))
  expect "prompt longer than context" 1 "longer than the context size 64" -- "$loom" generate -m "$model" -p "$python_prompt" -c 64
  expect "ctx larger than model" 1 "exceeds the model's context length" -- "$loom" generate -m "$model" -p hi -c 100000
  expect "one-shot chat" 0 "." -- "$loom" chat -m "$model" -p "Say hello." -n 16 --temp 0 -t 2
  expect "chat stdin" 0 "." -- sh -c "printf 'What is 2+2?\n/exit\n' | '$loom' chat -m '$model' -n 16 --temp 0 -t 2"
else
  echo "note: $model missing (scripts/fetch_model); model-level CLI checks not run"
fi

# loom serve robustness flags (issue 8). `timeout`: a server that wrongly starts must not hang the test.
expect "serve empty api key" 1 "--api-key is empty" -- timeout 20 "$loom" serve -m "$tiny" --api-key "" --port 0
expect "serve blank api key" 1 "--api-key is empty" -- timeout 20 "$loom" serve -m "$tiny" --api-key "  " --port 0
expect "serve empty api key file" 1 "--api-key-file is empty" -- timeout 20 "$loom" serve -m "$tiny" --api-key-file "" --port 0
printf '\n' >"$tmp/emptykey"
expect "serve api key file blank" 1 "first line is empty" -- timeout 20 "$loom" serve -m "$tiny" --api-key-file "$tmp/emptykey" --port 0
expect "serve zero connections" 2 "max-connections" -- timeout 20 "$loom" serve -m "$tiny" --max-connections 0 --port 0
expect "serve zero header timeout" 2 "http-header-timeout" -- timeout 20 "$loom" serve -m "$tiny" --http-header-timeout 0 --port 0

echo "cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
