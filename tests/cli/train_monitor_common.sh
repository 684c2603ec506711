# Shared by the `loom train --metrics-port` tests (train_metrics_test.sh,
# train_prometheus_test.sh, train_live_page_test.sh); sourced, not run.
# Sets: loom, src, tiny, tmp (removed at exit, with every process started by
# start_training / start_bg killed). Exit 77 = skipped (ctest SKIP_RETURN_CODE),
# never under CI=true, where a missing tool is a failure.
loom=$1
src=$2
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf
tmp=$(mktemp -d)
bg_pids=()
cleanup() {
  local p
  for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${bg_pids[@]}"; do wait "$p" 2>/dev/null; done
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"
}
trap cleanup EXIT

die() { echo "FAIL: $*"; exit 1; }

# require_tool NAME WHY: missing -> FAIL under CI=true, else SKIP (exit 77) with the reason.
require_tool() {
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "${CI:-}" = true ]; then die "$1 is not installed ($2; scripts/setup --test-deps installs it)"; fi
  echo "SKIP: $1 is not installed ($2; scripts/setup --test-deps installs it)"
  exit 77
}

# A TCP port nothing listens on now (the kernel's choice; released at once).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# fetch URL [OUT]: GET with a 5 s limit; body to OUT (default stdout); non-zero on any failure.
fetch() {
  if command -v curl >/dev/null 2>&1; then
    curl -sf --max-time 5 -o "${2:-/dev/stdout}" "$1"
  else
    python3 - "$1" "${2:-/dev/stdout}" <<'EOF'
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as r, open(sys.argv[2], "wb") as f:
    f.write(r.read())
EOF
  fi
}

# train_config STEPS [EXTRA_YAML]: a tiny-model LoRA config at $tmp/train.yaml (eval every 5 steps).
train_config() {
  cat >"$tmp/train.yaml" <<EOF
model: $tiny
data:
  train: $src/tests/fixtures/train_data/text.jsonl
  eval: $src/tests/fixtures/train_data/eval.jsonl
  seq_len: 48
lora:
  r: 4
optim:
  lr: 1.0e-2
batch_size: 2
steps: $1
eval_interval: 5
log_interval: 50
output_dir: $tmp/out
overwrite: true
threads: 1
${2:-}
EOF
}

# start_training PORT ARGS...: loom train in the background, stderr to $tmp/train.err; sets train_pid.
start_training() {
  local port=$1
  shift
  "$loom" train "$tmp/train.yaml" --metrics-port "$port" "$@" >"$tmp/train.out" 2>"$tmp/train.err" &
  train_pid=$!
  bg_pids+=("$train_pid")
}

# wait_for SECONDS CMD...: retries CMD every 0.1 s until it succeeds; non-zero after SECONDS.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.1
  done
}

# The value of an unlabelled sample in a /metrics text file.
sample() { awk -v n="$2" '$1 == n { print $2 }' "$1"; }

# metric_at_least URL NAME MIN: the sample NAME at URL is >= MIN.
metric_at_least() {
  fetch "$1" "$tmp/probe.txt" || return 1
  awk -v n="$2" -v m="$3" '$1 == n && $2 + 0 >= m + 0 { ok = 1 } END { exit !ok }' "$tmp/probe.txt"
}

# finish_training: waits (60 s at most) for the trainer; it must exit 0.
finish_training() {
  local i
  for i in $(seq 600); do kill -0 "$train_pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$train_pid" 2>/dev/null && die "loom train still running after 60 s"
  wait "$train_pid"
  local rc=$?
  [ $rc -eq 0 ] || { sed 's/^/    /' "$tmp/train.err" | tail -20; die "loom train exited $rc"; }
}
