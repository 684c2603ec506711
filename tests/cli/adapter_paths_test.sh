#!/usr/bin/env bash
# An adapter on some projections / some layers gives the same greedy output on
# all four paths: `loom generate --adapter`, `loom chat --adapter`, `loom serve
# --adapter NAME=DIR` (/v1/completions and /v1/chat/completions for model NAME,
# all requests sent at once so adapters share batches) and `loom merge` followed
# by `loom generate` / `loom chat` on the merged folder.
#
# Part 1, exact: the tiny f32 llama GGUF with the PEFT-made subset adapters of
#   tests/fixtures/adapter_subsets (PEFT's default [q_proj, v_proj], q only, v+up,
#   k+o+down, layers_to_transform [1] and 0); every path with its default f16 K/V.
# Part 2, exact: the default model as an f32 Hugging Face folder (the Q4_1 GGUF
#   merged with an all-zero adapter) with adapters `loom train` made here on
#   [q, v] and [k, o, down]; every path with f32 K/V (the CLI's and serve's f16
#   attention kernels differ in float order, a numeric change of its own, not an
#   adapter matter).
# Part 3, the quantized base itself (Q4_1 beside f32 adapted matrices): generate
#   and chat merge the adapter into f32 copies and run the rest on Q4_1, serve
#   adds B(Ax) per row to Q4_1 products; their attention kernels also differ in
#   float order. On this model activations are rounded to 8 bits before every
#   product, which turns such ulp differences into logit changes of up to ~0.9
#   (measured: +1 ulp on every attention-norm weight moves the Q4_1 model's logits
#   by 0.2-0.9, the f32 folder's by 5e-5; serve and generate differ by 0.4-0.9
#   on Q4_1 and 4e-5 on f32, without any adapter). So there the tokens must agree
#   up to the first difference, and that difference must be a near tie: the CLI's
#   token within $near_tie nats of serve's in serve's own top logprobs (the gap of
#   two logits moves by up to twice the logit change; seen: 0.01-0.42). `loom merge`
#   of the Q4_1 GGUF must write the very files part 2's merge of the f32 folder
#   wrote (so its merged outputs are part 2's, checked exactly).
#
# Outputs are compared token by token: the CLI's stdout bytes (generate/chat print
# each token's piece), the `bytes` of /v1/chat/completions logprobs (exact), and the
# tokens of /v1/completions logprobs (JSON strings: bytes that are no UTF-8 arrive as
# U+FFFD, so those tokens are matched as the decoded bytes). The response `text`
# fields leave special tokens out (as vLLM does), so the token lists are the ones
# compared. Every adapter must also change the base model's output (else the
# comparison would prove nothing).
#
# Usage: adapter_paths_test.sh LOOM_BINARY SOURCE_DIR
# Exit 0: all equal; 1: a difference or a failed command (both outputs printed);
# 77: part 1 passed but the default model is missing (scripts/fetch_model), so parts
# 2 and 3 did not run.
set -u
loom=$1
src=$2
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf
subsets=$src/tests/fixtures/adapter_subsets
smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
near_tie=1.0  # nats; see part 3 above
tmp=$(mktemp -d)
server_pid=
failures=0

stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
    server_pid=
  fi
}
trap 'stop_server; rm -rf "$tmp"' EXIT

die() { echo "FAIL: $*"; exit 1; }

# run_cli OUT_PREFIX -- command...: stdout to OUT_PREFIX.out, stderr to OUT_PREFIX.err.
run_cli() {
  local out=$1
  shift 2
  timeout 300 "$@" >"$out.out" 2>"$out.err"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: exit $rc: $*"
    sed 's/^/    /' "$out.err" | tail -5
    exit 1
  fi
}

# start_server LOG -- serve flags...: sets $port once /health answers (60 s at most).
# --lora-bits 32: the CLI paths keep the adapters' f32 values; serve's default bf16
# factors are a rounding of their own (ServingEngineTest.Bf16AdaptersServeTheirRoundedValues).
start_server() {
  local log=$1
  shift 2
  "$loom" serve --host 127.0.0.1 --port 0 --lora-bits 32 "$@" >"$log" 2>&1 &
  server_pid=$!
  port=
  for _ in $(seq 600); do
    kill -0 "$server_pid" 2>/dev/null || { sed 's/^/    /' "$log"; server_pid=; die "loom serve exited at start-up"; }
    port=$(grep -o 'on http://127.0.0.1:[0-9]*' "$log" | grep -o '[0-9]*$')
    if [ -n "$port" ] && curl -sf --max-time 2 "http://127.0.0.1:$port/health" >/dev/null; then return; fi
    sleep 0.1
  done
  sed 's/^/    /' "$log"
  die "loom serve did not answer /health within 60 s"
}

cat >"$tmp/check.py" <<'PY'
# Sends each adapter's completion and chat request at once (so different adapters
# share batches), then compares every path's tokens. Prints both sides of a difference.
# MODE: "exact" (all four paths, merged runs included) or a near-tie bound in nats
# (CLI against serve only; see the script's header).
import json, re, sys, threading, urllib.request
from functools import lru_cache

port, out, n, gen_prompt, chat_prompt, base_name, mode = sys.argv[1:8]
n = int(n)
names = sys.argv[8:]
exact = mode == "exact"
tol = None if exact else float(mode)

def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)

results, errors = {}, []
def ask(key, path, body):
    try:
        results[key] = post(path, body)
    except Exception as e:  # an HTTP error is a failure of that path
        detail = e.read().decode(errors="replace") if hasattr(e, "read") else ""
        errors.append(f"{key}: {e} {detail}")

jobs = []
for name in names:
    model = base_name if name == "base" else name
    jobs.append(((name, "completion"), "/v1/completions",
                 {"model": model, "prompt": gen_prompt, "max_tokens": n, "temperature": 0, "logprobs": 5}))
    jobs.append(((name, "chat"), "/v1/chat/completions",
                 {"model": model, "messages": [{"role": "user", "content": chat_prompt}], "max_tokens": n,
                  "temperature": 0, "logprobs": True, "top_logprobs": 5}))
threads = [threading.Thread(target=ask, args=j) for j in jobs]
for t in threads: t.start()
for t in threads: t.join()
if errors:
    print("FAIL: requests failed:\n  " + "\n  ".join(errors))
    sys.exit(1)

def cli(name, path):
    """(stdout bytes without the final newline, token count, finish reason) of one CLI run."""
    data = open(f"{out}/{name}.{path}.out", "rb").read()
    assert data.endswith(b"\n"), f"{name}.{path}: stdout does not end in a newline"
    err = open(f"{out}/{name}.{path}.err", encoding="utf-8", errors="replace").read()
    m = re.search(r"generation: (\d+) tokens in .*\((\w+)\)", err)
    assert m, f"{name}.{path}: no 'generation: N tokens' line on stderr:\n{err}"
    return data[:-1], int(m.group(1)), m.group(2)

def piece_len(data, p, tok):
    """Bytes of `data` at p that token text `tok` stands for (U+FFFD: bytes that are no UTF-8), or None."""
    if isinstance(tok, bytes):
        return len(tok) if data.startswith(tok, p) else None
    if "\ufffd" not in tok:
        b = tok.encode()
        return len(b) if data.startswith(b, p) else None
    return next((k for k in range(1, min(64, len(data) - p) + 1) if data[p:p + k].decode("utf-8", "replace") == tok),
                None)

def as_piece(tok):
    """A legacy logprobs token: its text, or the bytes of OpenAI's "bytes:\\xe6\\x97" spelling of a token
    that is a piece of a character."""
    if tok.startswith("bytes:") and re.fullmatch(r"(\\x[0-9a-f]{2})+", tok[6:]):
        return bytes.fromhex(tok[6:].replace("\\x", ""))
    return tok

def splits_into(data, toks):
    """Whether the bytes split into len(toks) pieces, piece i being toks[i]."""
    @lru_cache(None)
    def ok(i, p):
        if i == len(toks):
            return p == len(data)
        if isinstance(toks[i], bytes) or "\ufffd" not in toks[i]:
            k = piece_len(data, p, toks[i])
            return k is not None and ok(i + 1, p + k)
        return any(data[p:p + k].decode("utf-8", "replace") == toks[i] and ok(i + 1, p + k)
                   for k in range(1, min(64, len(data) - p) + 1))
    return ok(0, 0)

def near_tie(data, toks, tops, finish, cli_finish):
    """Agreement up to the first difference, which must be a near tie in serve's logprobs.
    Returns (ok, tokens agreed, description of the difference)."""
    p = 0
    for i, t in enumerate(toks):
        last_eos = finish == "stop" and i == len(toks) - 1
        k = None if last_eos else piece_len(data, p, t)
        if k is not None:
            p += k
            continue
        if last_eos and p == len(data):
            return True, i, "none"
        serve_lp = tops[i][t]
        # The CLI's token here: its next bytes, or the end of text when it stopped.
        cands = [(s, lp) for s, lp in tops[i].items() if s != t and
                 ((p == len(data) and cli_finish == "stop" and re.fullmatch(rb"<\|.*\|>|</s>", s if isinstance(s, bytes) else s.encode()))
                  or (p < len(data) and piece_len(data, p, s)))]
        gap = min((serve_lp - lp for _, lp in cands), default=float("inf"))
        return gap <= tol, i, f"at token {i}: serve {t!r} {serve_lp:.4f}, CLI {cands!r}, gap {gap:.4f} nats"
    return p == len(data), len(toks), "none" if p == len(data) else "the CLI's text is longer"

failed = 0
def differ(name, what, a_label, a, b_label, b):
    global failed
    failed += 1
    print(f"FAIL {name}: {what}\n    {a_label}: {a!r}\n    {b_label}: {b!r}")

for name in names:
    before = failed
    gen, gen_n, gen_fin = cli(name, "generate")
    chat, chat_n, chat_fin = cli(name, "chat")
    comp = results[(name, "completion")]["choices"][0]
    ctoks = [as_piece(t) for t in comp["logprobs"]["tokens"]]
    ch = results[(name, "chat")]["choices"][0]
    pieces = [bytes(t["bytes"]) for t in ch["logprobs"]["content"]]
    if exact:
        toks = ctoks[:-1] if comp["finish_reason"] == "stop" else ctoks  # serve lists the end-of-text token it
        if len(toks) != gen_n or not splits_into(gen, tuple(toks)):  # stopped at (as vLLM); the CLI prints none
            differ(name, "generate vs /v1/completions tokens", f"generate ({gen_n} tokens)", gen,
                   f"serve ({len(toks)} tokens)", toks)
        if comp["finish_reason"] != gen_fin:
            differ(name, "finish reason", "generate", gen_fin, "/v1/completions", comp["finish_reason"])
        ps = pieces[:-1] if ch["finish_reason"] == "stop" else pieces
        if len(ps) != chat_n or b"".join(ps) != chat:
            differ(name, "chat vs /v1/chat/completions tokens", f"chat ({chat_n} tokens)", chat,
                   f"serve ({len(ps)} tokens)", ps)
        if ch["finish_reason"] != chat_fin:
            differ(name, "finish reason", "chat", chat_fin, "/v1/chat/completions", ch["finish_reason"])
        summary = f"generate {gen_n} tokens, chat {chat_n} tokens; all paths equal"
    else:
        notes = []
        for what, data, fin, toks, tops, serve_fin in (
                ("generate", gen, gen_fin, ctoks, comp["logprobs"]["top_logprobs"], comp["finish_reason"]),
                ("chat", chat, chat_fin, pieces,
                 [{bytes(a["bytes"]): a["logprob"] for a in t["top_logprobs"]} | {bytes(t["bytes"]): t["logprob"]}
                  for t in ch["logprobs"]["content"]], ch["finish_reason"])):
            ok, agreed, where = near_tie(data, tuple(toks), tops, serve_fin, fin)
            if not ok:
                differ(name, f"{what} vs serve differ by more than a near tie of {tol} nats: {where}",
                       what, data, "serve", toks)
            notes.append(f"{what} = serve for {agreed} tokens, then {where}")
        summary = "; ".join(notes)
    if name != "base":
        if exact:
            for path, mine in (("generate", gen), ("chat", chat)):
                merged = cli(name, "merged_" + path)[0]
                if merged != mine:
                    differ(name, f"{path} --adapter vs {path} on the merged folder", "--adapter", mine, "merged",
                           merged)
        base_c = results[("base", "completion")]["choices"][0]["logprobs"]["tokens"]
        base_ch = [t["bytes"] for t in results[("base", "chat")]["choices"][0]["logprobs"]["content"]]
        if gen == cli("base", "generate")[0] and chat == cli("base", "chat")[0]:
            differ(name, "the adapter does not change the CLI output (the check would prove nothing)",
                   "base generate", cli("base", "generate")[0], "adapter generate", gen)
        if ctoks == base_c and [t["bytes"] for t in ch["logprobs"]["content"]] == base_ch:
            differ(name, "the adapter does not change serve's output", "base", base_c, "adapter", ctoks)
    if failed == before:
        print(f"ok {name}: {summary}")
sys.exit(1 if failed else 0)
PY

# check_model LABEL MODEL N GEN_PROMPT CHAT_PROMPT "CHAT_FLAGS" "KV_FLAGS" MODE NAME=DIR...
# KV_FLAGS (the KV cache's element type) go to generate, chat and serve alike.
# MODE exact: every path, merged folders kept as $tmp/LABEL/NAME-merged. MODE MERGED_LABEL:
# near ties allowed (CLI vs serve), and `loom merge` must write $tmp/MERGED_LABEL/NAME-merged's files.
check_model() {
  local label=$1 model=$2 n=$3 gen_prompt=$4 chat_prompt=$5 chat_flags=$6 kv_flags=$7 mode=$8
  shift 8
  local out=$tmp/$label names=(base) serve_adapters=() spec name dir f
  mkdir -p "$out"
  local common=(-n "$n" --temp 0 -t 2)
  # shellcheck disable=SC2206  # kv_flags is a flag list
  common+=($kv_flags)
  # shellcheck disable=SC2086  # chat_flags and kv_flags are flag lists
  run_cli "$out/base.generate" -- "$loom" generate -m "$model" -p "$gen_prompt" "${common[@]}"
  run_cli "$out/base.chat" -- "$loom" chat -m "$model" $chat_flags -p "$chat_prompt" "${common[@]}"
  for spec in "$@"; do
    name=${spec%%=*}
    dir=${spec#*=}
    names+=("$name")
    serve_adapters+=(--adapter "$spec")
    run_cli "$out/$name.generate" -- "$loom" generate -m "$model" --adapter "$dir" -p "$gen_prompt" "${common[@]}"
    run_cli "$out/$name.chat" -- "$loom" chat -m "$model" --adapter "$dir" $chat_flags -p "$chat_prompt" "${common[@]}"
    run_cli "$out/$name.merge" -- "$loom" merge -m "$model" --adapter "$dir" -o "$out/$name-merged" -t 2
    if [ "$mode" = exact ]; then
      run_cli "$out/$name.merged_generate" -- "$loom" generate -m "$out/$name-merged" -p "$gen_prompt" "${common[@]}"
      run_cli "$out/$name.merged_chat" -- "$loom" chat -m "$out/$name-merged" $chat_flags -p "$chat_prompt" "${common[@]}"
    else
      for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
        cmp -s "$out/$name-merged/$f" "$tmp/$mode/$name-merged/$f" ||
          { echo "FAIL $label $name: loom merge wrote a $f unlike $mode's"; failures=$((failures + 1)); }
      done
      rm -rf "$out/$name-merged"
    fi
  done
  start_server "$out/serve.log" -- -m "$model" $chat_flags $kv_flags -t 2 "${serve_adapters[@]}"
  echo "== $label: serve on port $port"
  local how=exact
  [ "$mode" = exact ] || how=$near_tie
  timeout 600 python3 "$tmp/check.py" "$port" "$out" "$n" "$gen_prompt" "$chat_prompt" "$(basename "$model")" \
    "$how" "${names[@]}" || failures=$((failures + 1))
  stop_server
}

[ -f "$tiny" ] || die "$tiny is missing"
tiny_adapters=()
for a in peft_default q_only v_up k_o_down layer1_q_gate layer0_mlp; do
  [ -f "$subsets/$a/adapter_config.json" ] || die "$subsets/$a is missing"
  tiny_adapters+=("$a=$subsets/$a")
done
check_model tiny "$tiny" 16 "Hello world" "Hello world" "--chat-template chatml" "" exact "${tiny_adapters[@]}"

if [ ! -f "$smol" ]; then
  [ "$failures" -eq 0 ] || exit 1
  echo "SKIPPED parts 2 and 3: $smol is missing (run scripts/fetch_model); part 1 (tiny model) passed"
  exit 77
fi
# Short runs with a constant, large learning rate so that two steps move the output
# (NAME:TARGETS:LR; these rates leave answers of several tokens).
for spec in qv:[q,v]:5e-3 kod:[k,o,down]:1e-2; do
  IFS=: read -r name targets lr <<<"$spec"
  run_cli "$tmp/train-$name" -- "$loom" train "$src/configs/main_job.yaml" --set model="$smol" \
    --set data.train="$src/data/main_job/train.jsonl" --set data.eval= --set eval_interval=0 \
    --set steps=2 --set schedule.kind=constant --set schedule.warmup_steps=0 --set optim.lr="$lr" \
    --set lora.target_modules="$targets" --set output_dir="$tmp/smol-$name" -t 2
done
# The f32 folder of the default model: its merge with an adapter whose B matrices are zero.
cp -r "$tmp/smol-qv" "$tmp/zero"
python3 - "$tmp/zero/adapter_model.safetensors" <<'PY' || die "could not zero the adapter"
import json, struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", b[:8])[0]
for name, t in json.loads(b[8:8 + n]).items():
    if "lora_B" in name:
        s, e = t["data_offsets"]
        b[8 + n + s:8 + n + e] = bytes(e - s)
open(sys.argv[1], "wb").write(b)
PY
run_cli "$tmp/f32base" -- "$loom" merge -m "$smol" --adapter "$tmp/zero" -o "$tmp/smollm2-f32-model" -t 2
check_model smollm2-f32 "$tmp/smollm2-f32-model" 24 "The capital of France is" "What is 12 + 7?" "" \
  "--kv-cache-dtype f32" exact "qv=$tmp/smol-qv" "kod=$tmp/smol-kod"
check_model smollm2-q4_1 "$smol" 24 "The capital of France is" "What is 12 + 7?" "" \
  "--kv-cache-dtype f32" smollm2-f32 "qv=$tmp/smol-qv" "kod=$tmp/smol-kod"

[ "$failures" -eq 0 ] || { echo "FAIL: $failures check(s) differ between paths"; exit 1; }
echo "PASS: every adapter gives the same output through generate, chat, serve and merge"
