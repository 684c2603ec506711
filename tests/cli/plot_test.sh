#!/usr/bin/env bash
# `loom plot` on real metrics files: two tiny-model training runs (their eval
# records carry token accuracy) overlaid into an SVG (it parses as XML and has
# one stroked path per curve in each run's colour) and a PNG (signature, size);
# bad input gives a clear message and exit 1 (file), 2 (flags) or 3 (I/O).
# Usage: plot_test.sh LOOM_BINARY SOURCE_DIR [KEEP_DIR: the pictures are copied there]
set -u
loom=$1
src=$2
keep=${3:-}
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }

# expect NAME EXPECTED_EXIT PATTERN -- command...
expect() {
  local name=$1 want_rc=$2 pattern=$3
  shift 4
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne "$want_rc" ]; then
    bad "$name: exit $rc, wanted $want_rc"; sed 's/^/    /' "$tmp/err" | head -5; return
  fi
  if ! grep -qE -- "$pattern" "$tmp/out" "$tmp/err"; then
    bad "$name: output lacks /$pattern/"; sed 's/^/    /' "$tmp/out" "$tmp/err" | head -5; return
  fi
  ok
}

# Two short runs (different learning rates) with evaluations at 0, 4, 8 and the end.
for run in a b; do
  lr=$([ $run = a ] && echo 5e-3 || echo 2e-2)
  printf 'model: %s\ndata:\n  train: %s\n  eval: %s\n  seq_len: 32\nlora:\n  r: 4\noptim:\n  lr: %s\n' \
    "$tiny" "$src/tests/fixtures/train_data/text.jsonl" "$src/tests/fixtures/train_data/eval.jsonl" "$lr" >"$tmp/$run.yaml"
  printf 'steps: 10\neval_interval: 4\neval_at_start: true\nbatch_size: 2\nmetrics_file: %s\noutput_dir: %s\n' \
    "$tmp/run-$run.jsonl" "$tmp/adapter-$run" >>"$tmp/$run.yaml"
  expect "train $run" 0 "eval at step 0: loss [0-9.]+ \\(ppl [0-9.]+\\), token accuracy [0-9.]+%" -- \
    "$loom" train "$tmp/$run.yaml" -t 1
done
n_eval=$(grep -c '"eval_accuracy":[0-9.]' "$tmp/run-a.jsonl")
[ "$n_eval" = 4 ] && ok || bad "run-a.jsonl has $n_eval eval records with eval_accuracy, wanted 4"

expect "plot svg" 0 "wrote .*curves.svg: 2 runs, steps 0..10" -- \
  "$loom" plot "$tmp/run-a.jsonl" "$tmp/run-b.jsonl" -o "$tmp/curves.svg" --label "lr 5e-3" --label "lr 2e-2"
expect "plot png" 0 "wrote .*curves.png: 2 runs" -- \
  "$loom" plot "$tmp/run-a.jsonl" "$tmp/run-b.jsonl" -o "$tmp/curves.png" --title "tiny model"
if [ -n "$keep" ]; then mkdir -p "$keep" && cp "$tmp/curves.svg" "$tmp/curves.png" "$keep/"; fi

# The SVG: well-formed XML; per run colour, one stroked path for each of its 5 curves (train loss,
# eval loss, eval accuracy, lr, grad norm) plus its legend swatch.
if python3 - "$tmp/curves.svg" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag.endswith('svg'), root.tag
want = {(12.2, 46.7, 70.6): 'run 0', (100.0, 49.8, 5.5): 'run 1'}  # curves_plot.cpp run_colour(0), (1)
count = {k: 0 for k in want}
for el in root.iter():
    m = re.search(r'stroke:rgb\(([0-9.]+)%,([0-9.]+)%,([0-9.]+)%\)', el.get('style', ''))
    if not el.tag.endswith('path') or not m:
        continue
    rgb = tuple(float(x) for x in m.groups())
    for k in want:
        if all(abs(a - b) < 0.15 for a, b in zip(rgb, k)):
            count[k] += 1
bad = {want[k]: n for k, n in count.items() if n != 6}
if bad:
    print('stroked paths per run (wanted 6):', bad)
    sys.exit(1)
EOF
then ok; else bad "svg: not XML or not 6 stroked paths per run"; fi

# The PNG: signature, IHDR 1200 x 820, and a real picture (tens of KB, not a blank page).
if python3 - "$tmp/curves.png" <<'EOF'
import struct, sys
b = open(sys.argv[1], 'rb').read()
assert b[:8] == b'\x89PNG\r\n\x1a\n', 'signature'
assert b[12:16] == b'IHDR', 'IHDR'
w, h = struct.unpack('>II', b[16:24])
assert (w, h) == (1200, 820), (w, h)
assert len(b) > 20000, len(b)
EOF
then ok; else bad "png: wrong signature, size or bytes"; fi

# Bad input.
: >"$tmp/empty.jsonl"
printf '{"step":1,"loss":2}\n{"step":2,"loss":\n' >"$tmp/broken.jsonl"
printf '{"step":1,"note":"x"}\n' >"$tmp/none.jsonl"
expect "help" 0 "Usage|OPTIONS|Options" -- "$loom" plot --help
expect "missing file" 1 "nope.jsonl' does not exist" -- "$loom" plot "$tmp/nope.jsonl" -o "$tmp/x.svg"
expect "empty file" 1 "empty.jsonl' is empty" -- "$loom" plot "$tmp/empty.jsonl" -o "$tmp/x.svg"
expect "bad line" 1 "broken.jsonl:2: not JSON" -- "$loom" plot "$tmp/broken.jsonl" -o "$tmp/x.svg"
expect "no plottable record" 1 "none.jsonl' has no step or eval record" -- "$loom" plot "$tmp/none.jsonl" -o "$tmp/x.svg"
expect "unknown extension" 2 "must end in .svg or .png" -- "$loom" plot "$tmp/run-a.jsonl" -o "$tmp/x.pdf"
expect "no output" 2 "output.*required" -- "$loom" plot "$tmp/run-a.jsonl"
expect "no input" 2 "metrics.*required" -- "$loom" plot -o "$tmp/x.svg"
expect "labels miscounted" 2 "--label given 1 times for 2 metrics files" -- \
  "$loom" plot "$tmp/run-a.jsonl" "$tmp/run-b.jsonl" --label one -o "$tmp/x.svg"
cp "$tmp/run-a.jsonl" "$tmp/same.svg"
expect "output is an input" 2 "is the metrics file" -- "$loom" plot "$tmp/same.svg" -o "$tmp/same.svg"
expect "unwritable output" 3 "x.svg" -- "$loom" plot "$tmp/run-a.jsonl" -o "$tmp/empty.jsonl/x.svg"
[ ! -e "$tmp/x.svg" ] && ok || bad "a failed plot left $tmp/x.svg"

echo "plot_test: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
