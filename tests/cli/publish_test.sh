#!/usr/bin/env bash
# `loom train --publish`: train, then serve without a restart (docs/training.md
# "Publishing to a server", docs/serving.md "Replacing an adapter").
#
# On the default model, a `loom serve` with --adapter-dir and an API key:
#  1. a 2-step run with --publish (default name: the output folder's) and
#     --publish-every-checkpoint (checkpoint_interval 1): three publish records
#     (two checkpoints, the final), /v1/models lists it with the final folder;
#     a greedy request on it differs from the base model's and equals what the
#     server gives for the same folder loaded fresh under another name;
#  2. a second run, published under --publish-name v2;
#  3. the swap: a long greedy stream on v1 while load_inplace puts v2's folder
#     under the name v1: the stream's text is v1's (computed before), a request
#     after the swap gets v2's, /v1/models shows the new folder;
#  4. errors: a URL without a scheme and a bad port (exit 1 at once, nothing
#     trained), method: full (exit 1 at once), a wrong key (the server's 401 at
#     start, exit 1), a server that is down (a warning at start, then exit 69
#     with the adapter saved and an error record naming the URL), a folder the
#     server refuses (outside --adapter-dir: exit 69 with the server's message).
#
# Usage: publish_test.sh LOOM_BINARY SOURCE_DIR. Exit 0: all good; 1: a failure;
# 77: the default model is missing (scripts/fetch_model).
set -u
loom=$1
src=$2
smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$smol" ] || { echo "SKIPPED: $smol is missing (run scripts/fetch_model)"; exit 77; }
tmp=$(mktemp -d)
server_pid=
trap '[ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*"; exit 1; }

mkdir -p "$tmp/adapters" "$tmp/elsewhere"
echo "sekrit-key" >"$tmp/key"
echo "wrong-key" >"$tmp/wrong"
"$loom" serve -m "$smol" --host 127.0.0.1 --port 0 -t 1 --adapter-dir "$tmp/adapters" --api-key-file "$tmp/key" \
  --max-model-len 512 >"$tmp/serve.log" 2>&1 &
server_pid=$!
port=
for _ in $(seq 600); do
  kill -0 "$server_pid" 2>/dev/null || { cat "$tmp/serve.log"; die "loom serve exited at start-up"; }
  port=$(grep -o 'on http://127.0.0.1:[0-9]*' "$tmp/serve.log" | grep -o '[0-9]*$')
  [ -n "$port" ] && curl -sf --max-time 2 "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.1
done
[ -n "$port" ] || die "loom serve did not start"
url=http://127.0.0.1:$port

# train OUT_DIR RC LR [flags...]: two steps of the main job; RC is the exit status expected.
train() {
  local out=$1 want=$2 lr=$3
  shift 3
  timeout 300 "$loom" train "$src/configs/main_job.yaml" --set model="$smol" \
    --set data.train="$src/data/main_job/train.jsonl" --set data.eval= --set eval_interval=0 --set steps=2 \
    --set schedule.kind=constant --set schedule.warmup_steps=0 --set optim.lr="$lr" \
    --set output_dir="$out" --set log_file="$out.log.jsonl" -t 2 "$@" >"$out.stdout" 2>"$out.stderr"
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    sed 's/^/    /' "$out.stderr" | tail -8
    die "loom train $* exited $rc, expected $want"
  fi
}

cat >"$tmp/client.py" <<'PY'
# Requests to the server: complete MODEL PROMPT N (greedy text), models, load NAME PATH [inplace],
# swap MODEL PROMPT N NAME PATH (a stream on MODEL; after its first tokens, load_inplace NAME PATH; prints
# the stream's whole text; fails when the stream had ended before the swap).
import json, sys, urllib.request, urllib.error
url, key, cmd, *args = sys.argv[1:]
H = {"Content-Type": "application/json", "Authorization": "Bearer " + key}

def post(path, body, stream=False):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=H)
    return urllib.request.urlopen(req, timeout=300)

def completion(model, prompt, n, stream=False):
    return {"model": model, "prompt": prompt, "max_tokens": int(n), "temperature": 0, "ignore_eos": True,
            "stream": stream}

if cmd == "complete":
    with post("/v1/completions", completion(*args)) as r:
        print(json.load(r)["choices"][0]["text"], end="")
elif cmd == "models":
    req = urllib.request.Request(url + "/v1/models", headers=H)
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps({m["id"]: m["root"] for m in json.load(r)["data"]}))
elif cmd == "load":
    body = {"lora_name": args[0], "lora_path": args[1]}
    if len(args) > 2: body["load_inplace"] = True
    with post("/v1/load_lora_adapter", body) as r:
        print(r.read().decode())
elif cmd == "swap":
    model, prompt, n, name, path = args
    text, pieces, swapped_at = "", 0, None
    with post("/v1/completions", completion(model, prompt, n, stream=True)) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                sys.exit("stream error: " + json.dumps(chunk))
            text += chunk["choices"][0]["text"]
            pieces += 1
            if pieces == 5:
                with post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True}) as s:
                    reply = s.read().decode()
                    if "replaced" not in reply:
                        sys.exit("load_inplace answered: " + reply)
                swapped_at = pieces
    if swapped_at is None or pieces - swapped_at < 20:
        sys.exit(f"the stream ended too soon after the swap ({pieces} pieces, swap after {swapped_at})")
    print(text, end="")
PY
client() { python3 "$tmp/client.py" "$url" sekrit-key "$@"; }

prompt="What is 12 + 30?"
# The base model's served name is the file name.
base=$(client complete SmolLM2-135M-Instruct.Q4_1.gguf "$prompt" 24) || die "base request failed"

# 1. Publish the final adapter and every checkpoint's, under the output folder's name.
train "$tmp/adapters/v1" 0 5e-3 --set checkpoint_interval=1 --publish "$url/v1/" --api-key-file "$tmp/key" \
  --publish-every-checkpoint
python3 - "$tmp/adapters/v1.log.jsonl" "$tmp/adapters/v1" <<'PY' || die "publish records of run v1"
import json, os, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
pubs = [r for r in recs if r["event"]["action"] == "publish"]
assert len(pubs) == 3, f"{len(pubs)} publish records: {[p['message'] for p in pubs]}"
assert all(p["log.level"] == "info" for p in pubs), [p["message"] for p in pubs]
assert [p["loom"]["publish"]["final"] for p in pubs] == [False, False, True]
assert pubs[0]["loom"]["publish"]["path"] == os.path.join(sys.argv[2], "checkpoints", "latest-adapter")
assert pubs[2]["loom"]["publish"]["path"] == sys.argv[2], pubs[2]
assert all(p["loom"]["publish"]["name"] == "v1" for p in pubs)
PY
[ -f "$tmp/adapters/v1/checkpoints/latest-adapter/adapter_model.safetensors" ] || die "no latest-adapter folder"
models=$(client models) || die "/v1/models"
python3 -c 'import json,sys; m=json.loads(sys.argv[1]); assert m.get("v1") == sys.argv[2], m' "$models" \
  "$(realpath "$tmp/adapters/v1")" || die "/v1/models does not list v1 at its final folder: $models"
v1=$(client complete v1 "$prompt" 24) || die "request on v1 failed"
[ "$v1" != "$base" ] || die "the published adapter does not change the output: '$v1'"
client load fresh1 "$tmp/adapters/v1" >/dev/null || die "fresh load of v1's folder"
fresh1=$(client complete fresh1 "$prompt" 24) || die "request on fresh1"
[ "$v1" = "$fresh1" ] || die "published v1 gives '$v1', the same folder loaded fresh '$fresh1'"
echo "ok: published v1 (3 publishes), its output differs from the base model's and equals a fresh load"

# 2. A second adapter, published under its own name.
train "$tmp/adapters/run2" 0 1e-2 --set seed=7 --set lora.target_modules=[k,o,down] --publish "$url" \
  --publish-name v2 --api-key-file "$tmp/key"
v2=$(client complete v2 "$prompt" 24) || die "request on v2"
[ "$v2" != "$v1" ] || die "v1 and v2 give the same output; the swap test would prove nothing"

# 3. The swap while a stream runs on v1.
long_v1=$(client complete v1 "$prompt" 200) || die "long request on v1"
long_v2=$(client complete v2 "$prompt" 200) || die "long request on v2"
[ "$long_v1" != "$long_v2" ] || die "v1 and v2 agree on 200 tokens"
streamed=$(client swap v1 "$prompt" 200 v1 "$tmp/adapters/run2") || die "the swap stream failed"
[ "$streamed" = "$long_v1" ] || die "the stream running during the swap changed: got '$streamed', want '$long_v1'"
after=$(client complete v1 "$prompt" 200) || die "request after the swap"
[ "$after" = "$long_v2" ] || die "a request after the swap got '$after', want v2's '$long_v2'"
models=$(client models)
python3 -c 'import json,sys; m=json.loads(sys.argv[1]); assert m.get("v1") == sys.argv[2], m' "$models" \
  "$(realpath "$tmp/adapters/run2")" || die "/v1/models after the swap: $models"
echo "ok: a stream on v1 kept v1 through the swap; the next request got v2"

# 4. Errors.
start=$(date +%s)
train "$tmp/adapters/bad1" 1 5e-3 --publish "127.0.0.1:$port"
grep -q "http://HOST:PORT" "$tmp/adapters/bad1.stderr" || die "no clear message for a URL without scheme"
train "$tmp/adapters/bad2" 1 5e-3 --publish "http://127.0.0.1:99999"
grep -q "99999" "$tmp/adapters/bad2.stderr" || die "no clear message for a bad port"
train "$tmp/adapters/full" 1 5e-3 --set method=full --publish "$url"
grep -q "LoRA adapters only" "$tmp/adapters/full.stderr" || die "method: full with --publish: $(cat "$tmp/adapters/full.stderr")"
train "$tmp/adapters/badkey" 1 5e-3 --publish "$url" --api-key-file "$tmp/wrong"
grep -q "401" "$tmp/adapters/badkey.stderr" || die "a wrong key does not report the 401: $(cat "$tmp/adapters/badkey.stderr")"
[ $(( $(date +%s) - start )) -lt 30 ] || die "the start-up checks took $(( $(date +%s) - start )) s"
[ ! -e "$tmp/adapters/badkey/adapter_model.safetensors" ] || die "a run refused at start wrote an adapter"
echo "ok: bad URL, bad port, method: full and a wrong key fail at start"

dead=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
train "$tmp/adapters/down" 69 5e-3 --publish "http://127.0.0.1:$dead"
grep -q "cannot be reached now" "$tmp/adapters/down.stderr" || die "no start-up warning for a server that is down"
[ -f "$tmp/adapters/down/adapter_model.safetensors" ] || die "the adapter was not kept when the publish failed"
python3 - "$tmp/adapters/down.log.jsonl" "$dead" <<'PY' || die "error record of the failed publish"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
err = [r for r in recs if r["event"]["action"] == "publish"]
assert len(err) == 1 and err[0]["log.level"] == "error", err
assert f"127.0.0.1:{sys.argv[2]}" in err[0]["message"] and "saved at" in err[0]["message"], err[0]["message"]
assert err[0]["error"]["type"] == "publish_failed"
PY
train "$tmp/elsewhere/out" 69 5e-3 --publish "$url" --api-key-file "$tmp/key"
grep -q "not inside an allowed adapter folder" "$tmp/elsewhere/out.stderr" \
  || die "the server's refusal is not reported: $(tail -3 "$tmp/elsewhere/out.stderr")"
[ -f "$tmp/elsewhere/out/adapter_model.safetensors" ] || die "the adapter was not kept when the server refused it"
echo "ok: a server that is down or refuses: exit 69, adapter kept, the reason logged"
echo "PASS"
