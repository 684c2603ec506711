#!/usr/bin/env bash
# `mpirun -np 2 loom serve --tp 2` (tensor parallel: each rank 1/2 of the heads and MLP channels)
# against one `loom serve` of the same model, f32 weights and f32 KV cache: for prompts sent one by one
# and 6 at once (continuous batching: several sequences in a step), the same greedy text and every
# token's logprob within 1e-5. Then --tp refused without mpirun, an adapter refused, a clean stop.
# Exit 77 (skipped) without mpirun; under CI=true that is a failure.
# Usage: serve_tp_test.sh LOOM_BINARY SOURCE_DIR
set -u
loom=$1
src=$2
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf
if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpirun not found (Debian: openmpi-bin; scripts/setup installs it)"
  [[ "${CI:-}" == "true" ]] && exit 1
  exit 77
fi
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 1
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }

# A free port: bind 0 and read it back.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_ready() {  # PORT LOG
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "server on port $1 did not start:"; tail -5 "$2"; return 1
}

p1=$(free_port)
"$loom" serve -m "$tiny" --port "$p1" -t 1 --kv-cache-dtype f32 >"$tmp/one.log" 2>&1 &
pids+=($!)
p2=$(free_port)
mpirun --allow-run-as-root --oversubscribe -np 2 "$loom" serve -m "$tiny" --port "$p2" -t 1 --kv-cache-dtype f32 \
  --tp 2 >"$tmp/tp.log" 2>&1 &
tp_pid=$!
pids+=($tp_pid)
wait_ready "$p1" "$tmp/one.log" && wait_ready "$p2" "$tmp/tp.log" || { bad "servers did not start"; exit 1; }

python3 - "$p1" "$p2" <<'EOF' && ok || bad "tensor-parallel completions differ from one process's"
import json, sys, threading, urllib.request
one, tp = sys.argv[1], sys.argv[2]
prompts = ["the quick fox", "line 7: the slow", "a", "jumps over the lazy dog and then", "0123456789", "hello world"]
def complete(port, prompt):
    body = json.dumps({"model": "tiny-llama.f32.gguf", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    c = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]
def all_at_once(port):
    out = [None] * len(prompts)
    def go(i):
        out[i] = complete(port, prompts[i])
    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in ts: t.start()
    for t in ts: t.join()
    return out
worst, bad = 0.0, 0
for mode, a, b in [("one by one", [complete(one, p) for p in prompts], [complete(tp, p) for p in prompts]),
                   ("6 at once", all_at_once(one), all_at_once(tp))]:
    for (ta, la), (tb, lb), p in zip(a, b, prompts):
        if ta != tb or len(la) != len(lb):
            print(f"{mode}: {p!r}: text {ta!r} vs {tb!r}")
            bad += 1
            continue
        worst = max([worst] + [abs(x - y) for x, y in zip(la, lb)])
print(f"  {2 * len(prompts)} completions of 16 tokens: same text; largest logprob difference {worst:.2e} (tolerance 1e-5)")
sys.exit(0 if bad == 0 and worst <= 1e-5 else 1)
EOF

# A clean stop: SIGTERM to mpirun stops every rank.
kill -TERM "$tp_pid"
for _ in $(seq 1 100); do kill -0 "$tp_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$tp_pid" 2>/dev/null; then bad "--tp server still running 10 s after SIGTERM"; else ok; fi

if ! "$loom" serve -m "$tiny" --port 0 --tp 2 >"$tmp/nompi.log" 2>&1 && grep -q "mpirun -np 2" "$tmp/nompi.log"; then
  ok
else
  bad "--tp without mpirun is not refused"; tail -3 "$tmp/nompi.log"
fi
mkdir -p "$tmp/adapter"
if ! timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 "$loom" serve -m "$tiny" --port 0 --tp 2 \
  --adapter a="$tmp/adapter" >"$tmp/adapter.log" 2>&1 && grep -q "not built yet" "$tmp/adapter.log"; then
  ok
else
  bad "--adapter with --tp is not refused"; tail -3 "$tmp/adapter.log"
fi

echo "$pass passed, $fail failed"
[[ $fail == 0 ]]
