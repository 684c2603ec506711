#!/usr/bin/env bash
# `loom train CONFIG --check` on the tiny model (docs/profiling.md, "Advice
# before training"): exit 0 with the memory estimate, tokens per step, the
# truncated samples and a warning naming each key on stdout, and nothing
# written (no output_dir, cache, metrics or log file); the run itself then
# prints the same data line and warnings at its start; a bad config, model or
# memory limit, or an output it could not write, exits non-zero naming the
# cause; data.skip_bad_lines names each skipped line; --log-format json gives ECS
# lines; under mpirun rank 0 alone prints. Usage: train_check_test.sh LOOM SOURCE_DIR
set -u
loom=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
# has NAME FILE PATTERN: FILE holds a line matching the extended regex PATTERN
has() {
  if grep -qE -- "$3" "$2"; then ok; else bad "$1: $(basename "$2") lacks /$3/"; sed 's/^/    /' "$2" | tail -12; fi
}

# lora.r 4 and optim.lr 1e-2 warn; data.seq_len 12 cuts the two long samples of text.jsonl (2 of 3).
cat >"$tmp/run.yaml" <<EOF
model: $src/tests/fixtures/model/tiny-llama.f32.gguf
data:
  train: $src/tests/fixtures/train_data/text.jsonl
  seq_len: 12
  cache_dir: $tmp/cache
lora:
  r: 4
optim:
  lr: 1e-2
batch_size: 2
grad_accum: 2
steps: 2
output_dir: $tmp/out/adapter
metrics_file: $tmp/metrics.jsonl
log_file: $tmp/logs/run.jsonl
threads: 1
EOF

"$loom" train "$tmp/run.yaml" --check >"$tmp/check.out" 2>"$tmp/check.err"
rc=$?
[ "$rc" = 0 ] && ok || { bad "check: exit $rc, wanted 0"; tail -5 "$tmp/check.err"; }
has check "$tmp/check.out" "^memory: needs about [0-9.]+ (MiB|GiB): weights "
has check "$tmp/check.out" "^tokens per step: 4 rows \(2 x 2\) x 12 = 48 slots; the data fills [0-9.]+% of them \(packed rows\): about [0-9]+ tokens a step, [0-9]+ of them trained"
has check "$tmp/check.out" "^train data: .*text.jsonl: 3 samples from 4 lines \(1 blank, 0 skipped as bad, 2 truncated, 0 dropped"
has check "$tmp/check.out" "^warning: .*run.yaml: lora.r 4 is below 8: .*start at lora.r: 8"
has check "$tmp/check.out" "^warning: .*run.yaml: optim.lr 0.01 is above 1e-3 .*try optim.lr: 2e-4"
has check "$tmp/check.out" "^warning: .*run.yaml: data.seq_len 12 cuts 2 of the 3 samples read \(67%"
has check "$tmp/check.out" "^check: .*run.yaml can start \(2 steps\); 3 warnings about the settings; nothing was written"
[ -s "$tmp/check.err" ] && { bad "check: stderr is not empty"; head -3 "$tmp/check.err"; } || ok
for p in out cache metrics.jsonl logs; do
  [ -e "$tmp/$p" ] && bad "check: $p was written" || ok
done

# A run prints the same data line and warnings at its start (stderr), once.
"$loom" train "$tmp/run.yaml" >"$tmp/run.out" 2>"$tmp/run.err"
rc=$?
[ "$rc" = 0 ] && ok || { bad "run: exit $rc, wanted 0"; tail -5 "$tmp/run.err"; }
grep '^train data:' "$tmp/check.out" >"$tmp/check.data"
grep '^train data:' "$tmp/run.err" >"$tmp/run.data"
cmp -s "$tmp/check.data" "$tmp/run.data" && ok || bad "run: its data line differs from the check's"
grep '^warning: .*run.yaml: ' "$tmp/check.out" >"$tmp/check.warn"
grep '^warning: .*run.yaml: ' "$tmp/run.err" >"$tmp/run.warn"
cmp -s "$tmp/check.warn" "$tmp/run.warn" && ok || { bad "run: its warnings differ from the check's"; diff "$tmp/check.warn" "$tmp/run.warn"; }
has run "$tmp/logs/run.jsonl" '"action":"config".*"advice":\{"key":"lora.r","value":4'

# --check does not touch an existing output: a foreign folder is refused as the run would refuse it.
mkdir -p "$tmp/foreign" && echo mine >"$tmp/foreign/notes.txt"
"$loom" train "$tmp/run.yaml" --check --set output_dir="$tmp/foreign" >"$tmp/foreign.out" 2>"$tmp/foreign.err"
rc=$?
[ "$rc" = 1 ] && ok || bad "foreign output_dir: exit $rc, wanted 1"
has foreign "$tmp/foreign.err" "output_dir '.*foreign': a non-empty folder .*--overwrite"
[ -f "$tmp/foreign/notes.txt" ] && ok || bad "foreign output_dir: notes.txt is gone"

# Bad config, model, memory: non-zero, naming the key or the file, nothing written.
rm -rf "$tmp/out" "$tmp/cache" "$tmp/metrics.jsonl" "$tmp/logs"
# expect NAME EXIT PATTERN [loom train flags...]
expect() {
  local name=$1 want=$2 pattern=$3
  shift 3
  "$loom" train "$tmp/run.yaml" --check "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
  local rc=$?
  [ "$rc" = "$want" ] && ok || bad "$name: exit $rc, wanted $want"
  has "$name" "$tmp/$name.err" "$pattern"
}
expect bad_rank 1 "'lora.r'" --set lora.r=0
expect unknown_key 1 "unknown key 'optim.lrr'" --set optim.lrr=1e-4
expect no_model 1 "none.gguf" --set model="$tmp/none.gguf"
expect memory_limit 1 "more than the limit of 1.0 MiB \(memory_limit\)" --set memory_limit=1MiB
mkdir -p "$tmp/mfolder"
expect metrics_folder 3 "metrics_file '.*mfolder' is a folder" --set metrics_file="$tmp/mfolder"
# access() says yes to root in /proc, where nothing can be created: the check tries.
if [ -e /proc/self/status ]; then
  expect proc_output 3 "output_dir '/proc/loom-check/out': cannot create anything in /proc" --set output_dir=/proc/loom-check/out
  expect proc_cache 3 "data.cache_dir '/proc/loom-cache': cannot create anything in /proc" --set data.cache_dir=/proc/loom-cache
fi
for p in out cache metrics.jsonl logs; do
  [ -e "$tmp/$p" ] && bad "bad configs: $p was written" || ok
done

# A named chat template whose markers are no tokens of the model, and epochs whose one step reads the data
# many times over, are warned about.
"$loom" train "$tmp/run.yaml" --check --set data.chat_template=llama3 --set steps=null --set epochs=1 \
  --set batch_size=4 --set grad_accum=8 --set data.cache_dir="$tmp/advcache" >"$tmp/adv.out" 2>"$tmp/adv.err"
rc=$?
[ "$rc" = 0 ] && ok || { bad "advice: exit $rc, wanted 0"; tail -3 "$tmp/adv.err"; }
has advice "$tmp/adv.out" "^warning: .*data.chat_template llama3: '<\|start_header_id\|>' is no token of this model"
has advice "$tmp/adv.out" "^warning: .*epochs 1: a step reads 32 rows \(1 x 8 x 4: ranks x grad_accum x batch_size\)"

# data.skip_bad_lines: each skipped line is named with its reason (the first few).
{ head -1 "$src/tests/fixtures/train_data/text.jsonl"; echo '{bad'; echo 42; } >"$tmp/mixbad.jsonl"
"$loom" train "$tmp/run.yaml" --check --set data.train="$tmp/mixbad.jsonl" --set data.skip_bad_lines=true \
  --set data.cache_dir="$tmp/skipcache" >"$tmp/skip.out" 2>"$tmp/skip.err"
rc=$?
[ "$rc" = 0 ] && ok || { bad "skip_bad_lines: exit $rc, wanted 0"; tail -3 "$tmp/skip.err"; }
has skip "$tmp/skip.out" "2 skipped as bad"
has skip "$tmp/skip.out" "^warning: skipped: .*mixbad.jsonl:2: invalid JSON"
has skip "$tmp/skip.out" "^warning: skipped: .*mixbad.jsonl:3: each line must be a JSON object"

# --log-format json: stdout is ECS JSON lines; the warnings carry their key.
"$loom" train "$tmp/run.yaml" --check --log-format json >"$tmp/json.out" 2>"$tmp/json.err"
rc=$?
[ "$rc" = 0 ] && ok || bad "json: exit $rc, wanted 0"
python3 - "$tmp/json.out" <<'EOF' && ok || bad "json: stdout is not ECS lines with the advice keys"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = [l["loom"]["advice"]["key"] for l in lines if "advice" in l.get("loom", {})]
assert keys == ["lora.r", "optim.lr", "data.seq_len"], keys
tokens = [l["loom"]["tokens_per_step"] for l in lines if "tokens_per_step" in l.get("loom", {})]
assert tokens and tokens[0]["slots"] == 48 and tokens[0]["rows"] == 4, tokens
assert lines[-1]["event"]["action"] == "check" and lines[-1]["loom"]["check"]["warnings"] == 3, lines[-1]
EOF

# --log-format json: an error (here --check's, a missing data file) is an ECS JSON line too, never text.
"$loom" train "$tmp/run.yaml" --check --log-format json --set data.train="$tmp/none.jsonl" >"$tmp/jerr.out" 2>"$tmp/jerr.err"
rc=$?
[ "$rc" = 1 ] && ok || bad "json error: exit $rc, wanted 1"
python3 - "$tmp/jerr.err" <<'EOF2' && ok || { bad "json error: stderr is not ECS lines"; cat "$tmp/jerr.err"; }
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert lines and lines[-1]["log.level"] == "error" and "none.jsonl" in lines[-1]["error"]["message"], lines
EOF2

# Under mpirun (when there is one) every rank loads its part and rank 0 alone prints.
if command -v mpirun >/dev/null 2>&1; then
  mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 "$loom" train "$tmp/run.yaml" --check \
    >"$tmp/mpi.out" 2>"$tmp/mpi.err"
  rc=$?
  [ "$rc" = 0 ] && ok || { bad "mpirun: exit $rc, wanted 0"; tail -5 "$tmp/mpi.err"; }
  [ "$(grep -c '^check: ' "$tmp/mpi.out")" = 1 ] && ok || bad "mpirun: not exactly one check line"
  [ "$(grep -c 'lora.r 4 is below 8' "$tmp/mpi.out")" = 1 ] && ok || bad "mpirun: the warning is not printed once"
  has mpirun "$tmp/mpi.out" "^tokens per step: 8 rows \(2 ranks x 2 x 2\) x 12 = 96 slots"
  for p in out cache metrics.jsonl logs; do
    [ -e "$tmp/$p" ] && bad "mpirun: $p was written" || ok
  done
fi

echo "train_check: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
