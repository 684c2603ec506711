#!/usr/bin/env bash
# --profile on train, generate, bench and serve (docs/profiling.md, "The trace"):
# each writes Chrome Trace Event JSON whose events are the phases and the
# backend's ops (layer, shape, dtype, FLOPs for the products, the pool's busy
# time), with otherData.loom; `loom profile report` reads what train wrote. The
# server's POST /profile/start and /profile/stop need the API key, refuse a
# second start or a stop without start with 409, and the stop answers with the
# trace. Usage: profile_collect_test.sh LOOM SOURCE_DIR
set -u
loom=$1
src=$2
tmp=$(mktemp -d)
server_pid=""
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
model=$src/tests/fixtures/model/tiny-llama.q4_1.gguf

# check_trace NAME FILE PYTHON-ASSERTIONS: the file is JSON; `ev` its complete events, `meta` otherData.loom
check_trace() {
  if python3 - "$2" "$3" <<'PY'; then ok; else bad "$1: $2"; fi
import json, sys
d = json.load(open(sys.argv[1]))
ev = [e for e in d["traceEvents"] if e["ph"] == "X"]
meta = d["otherData"]["loom"]
phases = {e["name"] for e in ev if e["cat"] == "phase"}
ops = [e for e in ev if e["cat"] == "op"]
for e in ev:
    assert e["dur"] >= 0 and e["ts"] >= 0, e
for e in ops:
    a = e["args"]
    assert a["threads"] >= 1 and 0 <= a["busy_us"] <= a["threads"] * e["dur"] + 1, e
    if e["name"] in ("matmul", "linear_backward_input"):
        assert a["flops"] == 2 * a["T"] * a["N"] * a["K"] and a["dtype"], e
try:
    exec(sys.argv[2])
except AssertionError:
    print("phases:", sorted(phases), file=sys.stderr)
    raise
PY
}

# --- train: phases of every step, ops in every layer with their phase
cat >"$tmp/train.yaml" <<YAML
model: $model
data:
  train: $src/tests/fixtures/train_data/text.jsonl
  eval: $src/tests/fixtures/train_data/eval.jsonl
  seq_len: 32
lora:
  r: 8
batch_size: 2
steps: 3
eval_interval: 0
output_dir: $tmp/adapter
threads: 2
YAML
if "$loom" train "$tmp/train.yaml" --profile "$tmp/train.json" >"$tmp/train.out" 2>&1; then ok; else bad "train --profile"; tail -5 "$tmp/train.out"; fi
grep -q "profile: [0-9]* events" "$tmp/train.out" && ok || bad "train: no 'profile:' line"
check_trace train "$tmp/train.json" '
assert {"setup", "data", "step", "forward", "backward", "optimizer", "eval"} <= phases
assert sum(e["name"] == "step" for e in ev) == 3
layers = {e["args"].get("layer") for e in ops if e["args"].get("phase") == "backward"}
assert {0, 1} <= layers, layers
assert any(e["name"] == "adamw" and e["args"]["phase"] == "optimizer" for e in ops)
assert any(e["name"] == "linear_backward_weight" for e in ops)
assert meta["command"] == "train" and meta["threads"] == 2 and meta["model"]["type"] == "q4_1"
assert meta["config"]["lora.r"] == "8" and meta["memory"]["total"] > 0 and meta["isa"]
'
if "$loom" profile report "$tmp/train.json" --no-peak >"$tmp/report.out" 2>&1; then ok; else bad "report on the train trace"; tail -5 "$tmp/report.out"; fi
grep -q "3 steps" "$tmp/report.out" && ok || { bad "report: no '3 steps'"; head -5 "$tmp/report.out"; }
if "$loom" profile advise "$tmp/train.json" --json >"$tmp/advise.json" 2>/dev/null &&
  python3 -m json.tool "$tmp/advise.json" >/dev/null; then ok; else bad "advise --json on the train trace"; fi

# --- generate and bench: prefill and decode
if "$loom" generate -m "$model" -p "one two three four" -n 4 -t 2 --profile "$tmp/gen.json" >"$tmp/gen.out" 2>&1; then
  ok
else
  bad "generate --profile"; tail -3 "$tmp/gen.out"
fi
check_trace generate "$tmp/gen.json" '
assert "prefill" in phases and sum(e["name"] == "decode" for e in ev) >= 3
assert meta["command"] == "generate"
assert any(e["name"] == "matmul" and e["args"]["phase"] == "decode" and e["args"]["T"] == 1 for e in ops)
'
if "$loom" bench -m "$model" -p 16 -n 4 -r 2 -t 1 --profile "$tmp/bench.json" >"$tmp/bench.out" 2>&1; then ok; else bad "bench --profile"; tail -3 "$tmp/bench.out"; fi
check_trace bench "$tmp/bench.json" '
assert sum(e["name"] == "prefill" for e in ev) == 2 and sum(e["name"] == "decode" for e in ev) == 8  # not the warm-up
assert meta["command"] == "bench" and meta["bench"]["repetitions"] == 2
'

# --- serve: the endpoints
port=$((20000 + RANDOM % 20000))
echo "secret" >"$tmp/key"
"$loom" serve -m "$model" --port $port -t 1 --api-key-file "$tmp/key" >"$tmp/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do curl -s "localhost:$port/health" >/dev/null 2>&1 && break; sleep 0.1; done
auth=(-H "Authorization: Bearer secret")
post() { curl -s -o "$tmp/body" -w "%{http_code}" -X POST -d '' "$@"; }
[ "$(post "localhost:$port/profile/start")" = 401 ] && ok || bad "start without the key: not 401"
[ "$(post "${auth[@]}" "localhost:$port/profile/stop")" = 409 ] && ok || bad "stop before start: not 409"
[ "$(post "${auth[@]}" "localhost:$port/profile/start")" = 200 ] && ok || bad "start: not 200"
[ "$(post "${auth[@]}" "localhost:$port/profile/start")" = 409 ] && ok || bad "second start: not 409"
curl -s "${auth[@]}" "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"one two","max_tokens":3,"ignore_eos":true}' >"$tmp/completion.json"
grep -q '"choices"' "$tmp/completion.json" && ok || bad "completion during the recording"
[ "$(post "${auth[@]}" "localhost:$port/profile/stop")" = 200 ] && ok || bad "stop: not 200"
cp "$tmp/body" "$tmp/serve.json"
check_trace serve "$tmp/serve.json" '
steps = [e for e in ev if e["name"] == "serve_step"]
assert len(steps) >= 3
assert sum(s["args"]["prefill_tokens"] for s in steps) >= 2 and sum(s["args"]["decode_rows"] for s in steps) >= 2
assert steps[0]["args"]["kv_blocks_total"] > 0 and "waiting" in steps[0]["args"]
assert {"forward", "sample"} <= phases
assert any(e["args"].get("phase") == "forward" for e in ops)
assert meta["command"] == "serve" and meta["serve"]["max_seqs"] >= 1
'
kill "$server_pid" 2>/dev/null
wait "$server_pid" 2>/dev/null
server_pid=""

echo "profile_collect: $pass passed, $fail failed"
[ "$fail" = 0 ]
