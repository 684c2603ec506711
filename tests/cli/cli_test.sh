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

for cmd in info tokenize generate chat bench perplexity imatrix quantize export export-lora prune; do
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
expect "negative temperature" 2 "--temp: must be >= 0" -- "$loom" generate -m "$tiny" -p hi --temp -1
expect "top-p out of range" 2 "--top-p: must be in \\(0, 1\\] \\(got 1.5\\)" -- "$loom" generate -m "$tiny" -p hi --top-p 1.5
expect "non-numeric n" 2 "n-predict|could not be converted|invalid" -- "$loom" generate -m "$tiny" -p hi -n abc
expect "empty prompt" 1 "prompt is empty" -- "$loom" generate -m "$tiny" -p ""
expect "chat empty prompt" 1 "-p: the prompt is empty" -- "$loom" chat -m "$tiny" -p "" </dev/null
# Edges found by a probe: infinite values and seeds past 64 bits are flag errors; an empty trace, a bench of
# nothing, a folder without tokenizer.json for info; a chat template whose markers are no tokens warns; a
# vocabulary padded past its tokenizer never samples a padded id (it stopped generation with an error).
expect "generate inf temperature" 2 "--temp: must be >= 0 and finite \\(got inf\\)" -- "$loom" generate -m "$tiny" -p hi --temp inf
expect "generate seed past 64 bits" 2 "--seed: must be at most 9223372036854775807" -- "$loom" generate -m "$tiny" -p hi -s 18446744073709551615
echo '{"traceEvents":[]}' >"$tmp/empty-trace.json"
expect "profile of an empty trace" 1 "no loom phase events" -- "$loom" profile report "$tmp/empty-trace.json"
expect "bench of nothing" 1 "-p 0 and -n 0: nothing to measure" -- "$loom" bench -m "$tiny" -p 0 -n 0
expect "info folder without tokenizer" 0 "tokenizer: +none" -- "$loom" info -m "$src/tests/fixtures/model/tiny-llama"
expect "chat template markers not tokens" 0 "warning: --chat-template llama3: '<\\|start_header_id\\|>' is no token" -- "$loom" chat -m "$tiny" --chat-template llama3 -p hi -n 2
expect "padded vocabulary folder" 0 "written" -- python3 "$src/scripts/fixtures/make_padded_vocab_folder.py" "$tmp/padded" "$src/tests/fixtures/model/tiny-llama"
expect "padded ids never sampled" 0 "generation: 40 tokens" -- "$loom" generate -m "$tmp/padded" -p "the cat" -n 40 --temp 5 --top-k 0 --top-p 1 --min-p 0 -s 1
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

# Numeric flags out of range: exit 2 naming the flag (before anything is loaded).
expect "generate top-k negative" 2 "--top-k: must be >= 0 \\(got -3\\)" -- "$loom" generate -m "$tiny" -p hi --top-k -3
expect "chat top-k negative" 2 "--top-k: must be >= 0" -- "$loom" chat -m "$tiny" -p hi --top-k -1
expect "generate n below -1" 2 "--n-predict: must be >= -1" -- "$loom" generate -m "$tiny" -p hi -n -2
expect "generate negative ctx" 2 "--ctx-size: must be >= 0" -- "$loom" generate -m "$tiny" -p hi -c -1
expect "generate seed below -1" 2 "--seed: must be >= -1" -- "$loom" generate -m "$tiny" -p hi -s -7
expect "generate zero repeat penalty" 2 "--repeat-penalty: must be > 0" -- "$loom" generate -m "$tiny" -p hi --repeat-penalty 0
expect "generate repeat-last-n" 2 "--repeat-last-n: must be >= -1" -- "$loom" generate -m "$tiny" -p hi --repeat-last-n -5
expect "chat min-p" 2 "--min-p: must be in \\[0, 1\\]" -- "$loom" chat -m "$tiny" -p hi --min-p 2
expect "chat presence penalty" 2 "--presence-penalty: must be in \\[-2, 2\\]" -- "$loom" chat -m "$tiny" -p hi --presence-penalty 3
expect "generate nan temperature" 2 "--temp: must be >= 0 \\(got nan\\)" -- "$loom" generate -m "$tiny" -p hi --temp nan
expect "info negative ctx" 2 "--ctx-size: must be >= 0 \\(got -5\\)" -- "$loom" info -m "$tiny" -c -5
expect "info ctx beyond model" 1 "--ctx-size 100000 exceeds the model's context length 256" -- "$loom" info -m "$tiny" -c 100000
expect "bench zero reps" 2 "--repetitions" -- "$loom" bench -m "$tiny" -r 0
expect "bench depth beyond model" 1 "-d 250 plus max\(-p 4, -n 8\) is 258 positions, past the model's context length 256" -- \
  "$loom" bench -m "$tiny" -p 4 -n 8 -d 250 -r 1
expect "bench at depth" 0 "tg8 @ d200" -- "$loom" bench -m "$tiny" -p 4 -n 8 -d 200 -r 1 --no-bandwidth
expect "bench kv f32" 0 '"kv_cache_dtype": "f32"' -- "$loom" bench -m "$tiny" -p 4 -n 4 -r 1 --no-bandwidth --json --kv-cache-dtype f32
expect "bench kv default f16" 0 '"kv_cache_dtype": "f16"' -- "$loom" bench -m "$tiny" -p 4 -n 4 -r 1 --no-bandwidth --json
expect "generate bad kv dtype" 2 "--kv-cache-dtype: q8_0 not in \\{f16,f32\\}" -- "$loom" generate -m "$tiny" -p hi --kv-cache-dtype q8_0
expect "info kv f32" 0 "KV cache \\(f32\\) +0.12 MiB" -- "$loom" info -m "$tiny" --kv-cache-dtype f32
expect "info kv f16" 0 "KV cache \\(f16\\) +0.06 MiB" -- "$loom" info -m "$tiny"
expect "merge zero threads" 2 "thread count must be >= 1" -- "$loom" merge -m "$tiny" --adapter "$tmp/adapter" -o "$tmp/m0" -t 0

# Directories where files belong, and files where folders belong.
expect "tokenize file is a dir" 1 "is a directory, not a file" -- "$loom" tokenize -m "$tiny" --file "$tmp"
expect "generate spec-ngram out of range" 2 "--spec-ngram: must be in \\[0, 64\\] \\(got 65\\)" -- "$loom" generate -m "$tiny" -p hi --spec-ngram 65
expect "generate spec-ngram min above max" 1 "--spec-ngram-min 4 and --spec-ngram-max 3" -- "$loom" generate -m "$tiny" -p hi --spec-ngram 2 --spec-ngram-min 4
expect "generate prompt file is a dir" 1 "is a directory, not a file" -- "$loom" generate -m "$tiny" -f "$tmp"
mkdir -p "$tmp/config-dir"
expect "train config is a dir" 1 "config-dir: is a directory, not a file" -- "$loom" train "$tmp/config-dir"
expect "train data is a dir" 1 "config-dir: is a directory, not a file" -- "$loom" train "$tmp/train.yaml" --set data.train="$tmp/config-dir" --set data.seq_len=32 --set output_dir="$tmp/a-dd"

# loom train checks everything it writes before training (the model path here does not even exist).
echo x >"$tmp/a-file"
expect "train output_dir is a file" 1 "output_dir '.*a-file': exists and is not a folder" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/none.gguf" --set output_dir="$tmp/a-file"
# An output that cannot be created or written is an I/O error: exit 3 (docs/training.md, "Signals and exit codes").
expect "train output_dir not creatable" 3 "output_dir '.*a-file/out/adapter': cannot create its parent folder" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/none.gguf" --set output_dir="$tmp/a-file/out/adapter"
expect "train cache_dir is a file" 3 "data.cache_dir '.*a-file': exists and is not a folder" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/none.gguf" --set data.cache_dir="$tmp/a-file" --set output_dir="$tmp/a-c1"
expect "train cache_dir not creatable" 3 "data.cache_dir '.*a-file/c': cannot create the folder" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/none.gguf" --set data.cache_dir="$tmp/a-file/c" --set output_dir="$tmp/a-c2"
if ! touch /sys/kernel/.loom-probe 2>/dev/null; then  # a folder even root cannot write in
  expect "train cache_dir not writable" 3 "data.cache_dir '/sys/kernel': cannot write files" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/none.gguf" --set data.cache_dir=/sys/kernel --set output_dir="$tmp/a-c3"
fi
expect "train output_dir holds the data" 1 "output_dir .*fixtures' holds the model" -- "$loom" train "$tmp/train.yaml" --set output_dir="$src/tests/fixtures"
mkdir -p "$tmp/notes" && echo keep >"$tmp/notes/my-notes.txt"
expect "train refuses a foreign folder" 1 "notes': a non-empty folder.*--overwrite" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/none.gguf" --set output_dir="$tmp/notes"
expect "train --overwrite replaces it" 0 "adapter written to" -- "$loom" train "$tmp/train.yaml" --set data.seq_len=32 --set output_dir="$tmp/notes" --overwrite -t 1
expect "train replaced the whole folder" 0 "^gone$" -- sh -c "test -e '$tmp/notes/my-notes.txt' || echo gone"
expect "train rewrites its own output" 0 "adapter written to" -- "$loom" train "$tmp/train.yaml" --set data.seq_len=32 -t 1
expect "train eval_interval without eval" 1 "'eval_interval': there is no eval split" -- "$loom" train "$tmp/train.yaml" --set eval_interval=5
expect "train output_dtype with lora warns" 0 "warning: .*'output_dtype' applies to method: full only" -- "$loom" train "$tmp/train.yaml" --set data.seq_len=32 --set output_dtype=bf16 --set output_dir="$tmp/a-dtype" -t 1
expect "train help names full fine-tuning" 0 "method: full" -- "$loom" train --help

# loom merge: foreign output folders are refused (before the merge), --overwrite replaces them.
mkdir -p "$tmp/mnotes" && echo keep >"$tmp/mnotes/my-notes.txt"
expect "merge refuses a foreign folder" 1 "-o '.*mnotes': a non-empty folder.*--overwrite" -- "$loom" merge -m "$tiny" --adapter "$tmp/adapter" -o "$tmp/mnotes"
expect "merge --overwrite" 0 "wrote" -- "$loom" merge -m "$tiny" --adapter "$tmp/adapter" -o "$tmp/mnotes" --overwrite
expect "merge into its adapter" 1 "holds the --adapter input" -- "$loom" merge -m "$tiny" --adapter "$tmp/adapter" -o "$tmp/adapter"
expect "merge over its own output" 0 "wrote" -- "$loom" merge -m "$tiny" --adapter "$tmp/adapter" -o "$tmp/mnotes"

# Adapters whose weights are not finite are refused, naming the file and tensor.
mkdir -p "$tmp/huge"
cp "$tmp/adapter/adapter_model.safetensors" "$tmp/huge/"
sed 's/"lora_alpha": [0-9.e+]*/"lora_alpha": 1e308/' "$tmp/adapter/adapter_config.json" >"$tmp/huge/adapter_config.json"
expect "generate huge lora_alpha" 1 "adapter .*huge: tensor '.*lora_A.weight': the merged weight .* is not finite" -- "$loom" generate -m "$tiny" --adapter "$tmp/huge" -p hi -n 2
expect "chat huge lora_alpha" 1 "adapter .*huge: tensor '.*lora_A.weight': the merged weight .* is not finite" -- "$loom" chat -m "$tiny" --chat-template chatml --adapter "$tmp/huge" -p hi -n 2
expect "merge huge lora_alpha" 1 "huge: tensor .* is not finite" -- "$loom" merge -m "$tiny" --adapter "$tmp/huge" -o "$tmp/m-huge"
expect "merge huge wrote nothing" 0 "^absent$" -- sh -c "test -e '$tmp/m-huge' || echo absent"

# loom chat keeps the session when the context is full (a pipe, a 64-token context).
long=$(printf 'word %.0s' $(seq 1 100))
expect "chat context full keeps the session" 0 "context holds 64.*Type /reset" -- \
  sh -c "printf '%s\n/reset\nhi\n/exit\n' '$long' | '$loom' chat -m '$tiny' --chat-template chatml -c 64 -n 4 --temp 0 -t 1 | tee '$tmp/chat.out'"
# four prompts: the long message, /reset, hi (answered), /exit
expect "chat reads on after the full context" 0 "^4$" -- sh -c "grep -c '^> ' '$tmp/chat.out'"

# loom serve: bad flags and files fail before binding, with the flag or file named.
expect "help serve" 0 "usage|options" -- "$loom" serve --help
expect "serve missing -m" 2 "model.*required" -- "$loom" serve
expect "serve bad chat template" 2 "--chat-template: jinja not in" -- timeout 20 "$loom" serve -m "$tiny" --chat-template jinja --port 0
expect "serve spec-ngram negative" 2 "--spec-ngram: must be in \\[0, 64\\]" -- "$loom" serve -m "$tiny" --spec-ngram -1
expect "serve spec-max-batch negative" 2 "--spec-max-batch" -- "$loom" serve -m "$tiny" --spec-max-batch -1
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
  expect "greedy generate, f32 KV" 0 "Paris" -- "$loom" generate -m "$model" -p "The capital of France is" -n 8 --temp 0 -t 2 --kv-cache-dtype f32
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
expect "serve lora bits 12" 2 "lora-bits" -- timeout 20 "$loom" serve -m "$tiny" --lora-bits 12 --port 0
expect "serve zero header timeout" 2 "http-header-timeout" -- timeout 20 "$loom" serve -m "$tiny" --http-header-timeout 0 --port 0

# Compression and export (docs/quantization.md): bad flags and inputs are refused by name; outputs are
# written whole (nothing is left behind by a refused run).
ppltext=$src/tests/fixtures/perplexity/text.txt
expect "quantize bad type" 1 "--type Q4_K_X: not a file type" -- "$loom" quantize -m "$tiny" -o "$tmp/q.gguf" --type Q4_K_X
expect "quantize wrote nothing" 0 "^absent$" -- sh -c "test -e '$tmp/q.gguf' || echo absent"
battery_f16=$src/tests/fixtures/gguf_battery/tiny.F16.gguf
expect "quantize iq2 needs an imatrix" 1 "tensor 'blk.0.attn_k.weight' would become iq2_xxs, which needs an importance matrix" -- "$loom" quantize -m "$battery_f16" -o "$tmp/q.gguf" --type IQ2_XXS
expect "quantize iq2 wrote nothing" 0 "^absent$" -- sh -c "test -e '$tmp/q.gguf' || echo absent"
expect "quantize bad override" 1 "--tensor-type attn_v: expected PATTERN=TYPE" -- "$loom" quantize -m "$tiny" -o "$tmp/q.gguf" --tensor-type attn_v
expect "quantize bad override type" 1 "--tensor-type q9_9: not a tensor type" -- "$loom" quantize -m "$tiny" -o "$tmp/q.gguf" --tensor-type attn_v=q9_9
expect "quantize requantize refused" 1 "already q4_1.*--allow-requantize" -- "$loom" quantize -m "$src/tests/fixtures/model/tiny-llama.q4_1.gguf" -o "$tmp/q.gguf" --type Q8_0
expect "quantize missing imatrix" 1 "no-such.dat" -- "$loom" quantize -m "$tiny" -o "$tmp/q.gguf" --imatrix "$tmp/no-such.dat"
expect "quantize to Q8_0" 0 "wrote" -- "$loom" quantize -m "$tiny" -o "$tmp/q.gguf" --type Q8_0 -t 2
expect "quantized file runs" 0 "" -- "$loom" generate -m "$tmp/q.gguf" -p hi -n 2
expect "quantize unwritable output" 3 "cannot" -- "$loom" quantize -m "$tiny" -o /proc/no/q.gguf --type Q8_0
mkdir -p "$tmp/afolder"  # an output that is a folder is refused before the work, not at the final rename
expect "quantize output is a folder" 3 "-o '.*afolder': a folder; give a file path" -- "$loom" quantize -m "$tiny" -o "$tmp/afolder" --type Q8_0
expect "perplexity json is a folder" 3 "--json '.*afolder': a folder" -- "$loom" perplexity -m "$tiny" -f "$ppltext" -c 64 --chunks 2 --json "$tmp/afolder"
expect "perplexity needs a text" 1 "-f FILE" -- "$loom" perplexity -m "$tiny"
printf 'a short text' >"$tmp/short.txt"
expect "perplexity short text" 1 "tokenizes to .* tokens.*needs at least" -- "$loom" perplexity -m "$tiny" -f "$tmp/short.txt" -c 64
expect "perplexity chunk beyond context" 1 "longer than the model's context" -- "$loom" perplexity -m "$tiny" -f "$ppltext" -c 1024
expect "perplexity kl without base" 1 "--kl-divergence needs --kl-divergence-base" -- "$loom" perplexity -m "$tiny" --kl-divergence
expect "perplexity bad base file" 1 "not a log-prob file" -- "$loom" perplexity -m "$tiny" --kl-divergence --kl-divergence-base "$ppltext"
expect "perplexity runs" 0 "Final estimate: PPL = " -- "$loom" perplexity -m "$tiny" -f "$ppltext" -c 64 --chunks 3
expect "imatrix writes" 0 "entries over 2 chunks" -- "$loom" imatrix -m "$tiny" -f "$ppltext" -c 64 --chunks 2 -o "$tmp/im.gguf"
expect "imatrix zero chunks" 2 "--chunks: expected -1 \(all\) or a count from 1 \(got 0\)" -- "$loom" imatrix -m "$tiny" -f "$ppltext" -c 64 --chunks 0 -o "$tmp/im0.gguf"
expect "perplexity zero chunks" 2 "--chunks: expected -1 \(all\) or a count from 1 \(got 0\)" -- "$loom" perplexity -m "$tiny" -f "$ppltext" -c 64 --chunks 0
# An imatrix of 0 chunks (every count zero, as an older loom wrote one) would quantize as none: refused.
expect "empty imatrix made" 0 "written" -- python3 -c "import struct, sys; n = b'blk.0.attn_q.weight'; open(sys.argv[1], 'wb').write(struct.pack('<ii', 1, len(n)) + n + struct.pack('<ii', 0, 64) + bytes(256) + struct.pack('<i', 0)); print('written')" "$tmp/im0.dat"
expect "quantize refuses an empty imatrix" 1 "im0.dat: the importance matrix holds no data" -- "$loom" quantize -m "$tiny" -o "$tmp/qi.gguf" --type Q4_0 --imatrix "$tmp/im0.dat"
expect "quantize with imatrix" 0 "14 importance matrix entries" -- "$loom" quantize -m "$tiny" -o "$tmp/qi.gguf" --type Q4_0 --imatrix "$tmp/im.gguf"
cp -r "$tmp/adapter" "$tmp/adapter-nobase"
sed -i 's|"base_model_name_or_path": *"[^"]*"|"base_model_name_or_path": "/nonexistent/base"|' "$tmp/adapter-nobase/adapter_config.json"
expect "export-lora needs a base" 1 "'/nonexistent/base' is not a file or folder here; give the base model with -m" -- "$loom" export-lora --adapter "$tmp/adapter-nobase" -o "$tmp/l.gguf"
expect "export-lora writes" 0 "LoRA pairs" -- "$loom" export-lora --adapter "$tmp/adapter" -m "$tiny" -o "$tmp/l.gguf"
# A llama.cpp GGUF LoRA file works wherever a PEFT folder does, with the same tokens; as a model it is named.
expect "gguf lora generates as its peft folder" 0 "^same$" -- sh -c "'$loom' generate -m '$tiny' --adapter '$tmp/adapter' -p hi -n 8 --temp 0 >'$tmp/g1' 2>/dev/null && '$loom' generate -m '$tiny' --adapter '$tmp/l.gguf' -p hi -n 8 --temp 0 >'$tmp/g2' 2>/dev/null && cmp -s '$tmp/g1' '$tmp/g2' && echo same"
expect "gguf lora as a model" 1 "l.gguf: a LoRA adapter .* --adapter" -- "$loom" info -m "$tmp/l.gguf"
expect "gguf lora to export-lora" 1 "a PEFT adapter is a folder" -- "$loom" export-lora --adapter "$tmp/l.gguf" -m "$tiny" -o "$tmp/l2.gguf"
expect "export merged" 0 "wrote" -- "$loom" export -m "$tiny" --adapter "$tmp/adapter" -o "$tmp/merged.gguf"
expect "export hf folder without tokenizer" 1 "no tokenizer.json" -- "$loom" export -m "$src/tests/fixtures/model/tiny-llama" -o "$tmp/x.gguf"
# INT8 / INT4 / SmoothQuant / AWQ compressed-tensors folders.
expect "quantize bad method" 1 "--method int3: expected gguf, int8, int4, awq or smoothquant" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method int3
expect "quantize bad scheme" 1 "--scheme maybe: expected sym or asym" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method int8 --scheme maybe
expect "quantize bad alpha" 1 "--alpha lots: expected a number in \[0, 1\] or auto" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method smoothquant --alpha lots --calib "$ppltext"
expect "smoothquant needs calibration" 1 "--method smoothquant needs calibration text: give --calib FILE" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method smoothquant
expect "int4 group that fits nothing" 1 "no group size of 32 to 128 divides the input widths 64, 64 and 176" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method int4
expect "int8 folder" 0 "wrote .*compressed-tensors" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method int8
expect "int8 folder runs" 0 "" -- "$loom" generate -m "$tmp/ct" -p hi -n 2
expect "int8 folder as a LoRA base" 0 "adapter written to" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/ct" \
  --set data.seq_len=32 --set output_dir="$tmp/adapter-ct" -t 1
expect "int8 folder perplexity" 0 "Final estimate" -- "$loom" perplexity -m "$tmp/ct" -f "$ppltext" -c 64 --chunks 2
expect "int8 folder bench" 0 "" -- "$loom" bench -m "$tmp/ct" -p 16 -n 4 -r 1
expect "calibration chunk of 0 tokens" 2 "--calib-ctx: Value 0 not in range 16" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method smoothquant --calib "$ppltext" --calib-ctx 0
expect "no calibration chunks" 2 "--calib-chunks: Value 0 not in range 1" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method wanda --calib "$ppltext" --calib-chunks 0
expect "percentile out of range" 1 "--percentile 200: expected a value in \(50, 100\]" -- "$loom" quantize -m "$tiny" -o "$tmp/ct" --method int8 --range percentile --percentile 200
expect "int8 folder over a file" 1 "not a folder|is a file|cannot" -- "$loom" quantize -m "$tiny" -o "$tmp/q.gguf" --method int8

# loom prune: unstructured (magnitude, Wanda, N:M) and structured (heads, channels, layers) to GGUF or a folder.
expect "prune nothing asked" 1 "nothing to prune" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf"
expect "prune bad method" 1 "--method sparsegpt2: expected magnitude or wanda" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method sparsegpt2
expect "prune bad sparsity" 1 "--sparsity 1: expected a fraction in \[0, 1\)" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --sparsity 1
expect "prune negative sparsity" 1 "--sparsity -0.1: expected a fraction in \[0, 1\)" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --sparsity -0.1
expect "prune nan sparsity" 1 "--sparsity nan: expected a fraction" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --sparsity nan
expect "prune bad pattern" 1 "--pattern 2-4: expected N:M" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --pattern 2-4
expect "prune pattern that does not divide" 1 "--pattern 2:5: .* not a multiple of 5" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --pattern 2:5
expect "prune sparsity and pattern" 1 "not both" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --pattern 2:4 --sparsity 0.5
expect "wanda needs calibration" 1 "--method wanda needs calibration text: give --calib FILE" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method wanda
expect "structured needs calibration" 1 "structured pruning .* needs calibration text" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --channels 0.25
expect "prune too many layers" 1 "--layers 2: the model has 2 layers" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --layers 2 --calib "$ppltext" --calib-ctx 32
expect "prune bad type" 1 "--type Q9: not a file type" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --type Q9
expect "prune wrote nothing" 0 "^absent$" -- sh -c "test -e '$tmp/p.gguf' || echo absent"
expect "magnitude 2:4 to gguf" 0 "50.0% of them zero" -- "$loom" prune -m "$tiny" -o "$tmp/p.gguf" --method magnitude --pattern 2:4
expect "pruned gguf runs" 0 "" -- "$loom" generate -m "$tmp/p.gguf" -p hi -n 2
expect "pruned gguf says so" 0 "magnitude 2:4" -- "$loom" info -m "$tmp/p.gguf"
expect "wanda to folder" 0 "wrote .*Hugging Face folder" -- "$loom" prune -m "$tiny" -o "$tmp/pf" --method wanda --sparsity 0.5 --calib "$ppltext" --calib-ctx 32 --dtype f32
expect "pruned folder says so" 0 "wanda 50% per row" -- cat "$tmp/pf/config.json"
expect "structured to gguf" 0 "heads 4 -> 2.*MLP channels 176 -> 128.*removed layers" -- sh -c "'$loom' prune -m '$tiny' -o '$tmp/ps.gguf' --heads 0.25 --channels 0.25 --layers 1 --calib '$ppltext' --calib-ctx 32 2>&1 | tr '\n' ' '"
expect "structured gguf runs" 0 "Final estimate" -- "$loom" perplexity -m "$tmp/ps.gguf" -f "$ppltext" -c 32 --chunks 2
expect "full fine-tuning keeps the zeros" 0 "sparsity_mask: [0-9]+ zero weights .* stay zero" -- "$loom" train "$tmp/train.yaml" --set model="$tmp/pf" \
  --set method=full --set data.seq_len=32 --set steps=2 --set output_dir="$tmp/pf-ft" -t 1
expect "qat lora" 0 "QAT int4 per row, symmetric on W \+ s B A" -- "$loom" train "$tmp/train.yaml" --set qat.bits=4 --set qat.group_size=0 \
  --set data.seq_len=32 --set steps=2 --set output_dir="$tmp/qat" -t 1
expect "qat as a later stage" 0 "qat: from step 2, the forward multiplies the weights as int8 asym" -- "$loom" train "$tmp/train.yaml" --set qat.bits=8 --set qat.scheme=asym \
  --set qat.group_size=0 --set qat.start_step=1 --set data.seq_len=32 --set steps=2 --set output_dir="$tmp/qat-late" -t 1
expect "qat group that fits nothing" 1 "qat.group_size 128: no multiple of 32" -- "$loom" train "$tmp/train.yaml" --set qat.bits=4 \
  --set data.seq_len=32 --set steps=2 --set output_dir="$tmp/qat2" -t 1
expect "qat with quantize_base" 1 "does not go with quantize_base" -- "$loom" train "$tmp/train.yaml" --set qat.bits=8 \
  --set quantize_base=q8_0 --set output_dir="$tmp/qat3" -t 1

# --device: a name that is no device is a flag error; a device this build has no backend for is refused by name.
expect "device not a name" 2 "--device: must be cpu, cuda, cuda:N, npu or npu:N, not 'gpu'" -- \
  "$loom" generate -m "$tiny" -p hi --device gpu
expect "device cuda not built" 1 "device cuda:0: this loom was built without CUDA" -- \
  "$loom" generate -m "$tiny" -p hi --device cuda
expect "device npu not built" 1 "device npu:1: this loom was built without an NPU backend" -- \
  "$loom" bench -m "$tiny" -p 4 -n 2 -r 1 --device npu:1
expect "device chat cuda" 1 "built without CUDA" -- "$loom" chat -m "$tiny" --device cuda:1 -p hi
expect "device serve cuda" 1 "built without CUDA" -- timeout 20 "$loom" serve -m "$tiny" --device cuda --port 0
expect "device train cuda" 1 "built without CUDA" -- "$loom" train "$tmp/train.yaml" --device cuda
expect "device train yaml" 1 "'device'.*'tpu' is not a device" -- "$loom" train "$tmp/train.yaml" --set device=tpu
expect "device cpu explicit" 0 "" -- "$loom" generate -m "$tiny" -p hi -n 2 --device cpu

# bench --json: the decode floor's inputs. The default model is tied (the
# embedding is the output projection), so every weight byte is read per token.
if "$loom" bench -m "$model" -p 8 -n 4 -r 1 -t 1 --json >"$tmp/bench.json" 2>"$tmp/bench.err" &&
  python3 - "$tmp/bench.json" <<'PY'
import json, sys
o = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert 95_000_000 < o["weight_bytes_per_token"] < 98_000_000, o  # SmolLM2 Q4_1: 92.1 MiB of weights
assert o["read_gbps"] > 0.1 and 0 < o["tg_floor_fraction"] < 2, o
assert 0.1 < o["read_gbps_median"] <= o["read_gbps"], o  # the median pass never beats the best
assert o["tg_floor_fraction"] <= o["tg_floor_fraction_median"] < 4, o
assert len(o["pp_samples_tokens_per_s"]) == 1 and len(o["tg_samples_tokens_per_s"]) == 1, o
PY
then pass=$((pass + 1)); else echo "FAIL bench --json floor fields"; cat "$tmp/bench.err" | tail -3; fail=$((fail + 1)); fi
expect "bench --no-bandwidth" 0 '"read_gbps": 0.000' -- "$loom" bench -m "$tiny" -p 4 -n 2 -r 1 --json --no-bandwidth

echo "cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
