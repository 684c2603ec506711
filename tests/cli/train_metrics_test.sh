#!/usr/bin/env bash
# `loom train --metrics-port`: a port in use is refused (exit 1, naming the key)
# before the model loads; during a tiny-model run /metrics is served in the text
# format 0.0.4 and `promtool check metrics` finds no problem; the values are the
# run's; /curves.json holds every step and evaluation; / is the self-contained
# live page; anything else is 404; the dashboard's queries parse. A second run
# shows what the other parts report: a skipped NaN step (failpoint), checkpoints,
# memory arenas / RSS / limit, the eval token accuracy.
# Usage: train_metrics_test.sh LOOM_BINARY SOURCE_DIR   (exit 77: skipped, promtool missing, not under CI=true)
set -u
. "$(dirname "$0")/train_monitor_common.sh"
require_tool promtool "the Prometheus text-format linter, Debian package prometheus"

# 1. A port in use (held by another listener), given as the metrics_port key: exit 1 before the model loads.
python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True); time.sleep(60)' >"$tmp/held_port" &
bg_pids+=($!)
wait_for 10 test -s "$tmp/held_port" || die "could not hold a port"
held=$(cat "$tmp/held_port")
train_config 5 "metrics_port: $held"
"$loom" train "$tmp/train.yaml" >"$tmp/busy.out" 2>"$tmp/busy.err"
rc=$?
[ $rc -eq 1 ] || die "port in use: exit $rc, wanted 1 ($(cat "$tmp/busy.err"))"
grep -q "metrics_port (--metrics-port) $held: cannot listen on 127.0.0.1:$held (the port is in use" "$tmp/busy.err" ||
  die "port in use: unclear message: $(cat "$tmp/busy.err")"
if grep -qE "model:|train data" "$tmp/busy.err"; then die "port in use: the model or data was loaded first"; fi
echo "ok: a port in use is refused before the model loads: $(cat "$tmp/busy.err")"

# 2. A run of 60 steps (eval every 5), served on a free port given by --metrics-port; the server stays
#    3 s after the run so the final values can be read.
port=$(free_port)
url="http://127.0.0.1:$port"
train_config 60
start_training "$port" --metrics-linger 3
wait_for 20 fetch "$url/metrics" || die "/metrics not served: $(cat "$tmp/train.err")"
done_json() { fetch "$url/curves.json" | python3 -c 'import json, sys; sys.exit(0 if json.load(sys.stdin)["done"] else 1)'; }
wait_for 60 done_json || die "the run never reported done: $(tail -5 "$tmp/train.err")"
fetch "$url/metrics" "$tmp/metrics.txt" || die "/metrics after the run"
fetch "$url/curves.json" "$tmp/curves.json" || die "/curves.json after the run"
fetch "$url/" "$tmp/page.html" || die "/ after the run"
curl -s --max-time 5 -D "$tmp/headers" -o /dev/null "$url/metrics" || die "/metrics headers"
status_missing=$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "$url/no-such-page")
finish_training
grep -q "metrics: Prometheus at $url/metrics, live curves at $url/" "$tmp/train.err" ||
  die "the start record does not say where the metrics are served"

# The linter: exit 0 and nothing to say.
promtool check metrics <"$tmp/metrics.txt" >"$tmp/promtool.out" 2>&1
rc=$?
[ $rc -eq 0 ] && [ ! -s "$tmp/promtool.out" ] || { cat "$tmp/promtool.out"; die "promtool check metrics: exit $rc"; }
echo "ok: promtool check metrics: no problems ($(grep -c '^# TYPE' "$tmp/metrics.txt") families)"

grep -qi '^Content-Type: text/plain; version=0.0.4' "$tmp/headers" || die "Content-Type: $(grep -i content-type "$tmp/headers")"
[ "$status_missing" = 404 ] || die "/no-such-page answered $status_missing, wanted 404"

want() {  # want NAME VALUE: the sample's value, as awk compares numbers
  local got
  got=$(sample "$tmp/metrics.txt" "$1")
  awk -v a="$got" -v b="$2" 'BEGIN { exit !(a != "" && a + 0 == b + 0) }' || die "$1 is '$got', wanted $2"
}
want loom_train_step 60
want loom_train_total_steps 60
want loom_train_progress_ratio 1
want loom_train_eta_seconds 0
want loom_train_step_seconds_count 60
want loom_train_skipped_steps_total 0
grep -q '^loom_train_info{model="tiny-llama.f32.gguf",method="lora"} 1$' "$tmp/metrics.txt" || die "loom_train_info"
python3 - "$tmp/metrics.txt" "$tmp/curves.json" <<'EOF' || die "values"
import json, math, sys
m = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    k, v = line.rsplit(" ", 1)
    m[k] = float(v)
c = json.load(open(sys.argv[2]))
assert m["loom_train_tokens_total"] == 60 * 2 * 48, m["loom_train_tokens_total"]  # rows x seq_len
assert m["loom_train_target_tokens_total"] > 0
assert m["loom_train_tokens_per_second"] > 0
assert math.isfinite(m["loom_train_eval_loss"]) and m["loom_train_eval_loss"] == c["eval"]["loss"][-1]
assert math.isfinite(m["loom_train_loss"]) and m["loom_train_loss"] == c["train"]["loss"][-1]
assert m["loom_train_learning_rate"] == c["train"]["lr"][-1]
assert m["loom_train_grad_norm"] == c["train"]["grad_norm"][-1]
assert m["loom_train_start_time_seconds"] > 1.6e9
assert c["train"]["step"] == list(range(1, 61)), c["train"]["step"]
assert c["eval"]["step"] == list(range(5, 61, 5)), c["eval"]["step"]
assert all(isinstance(v, float) and v > 0 for v in c["train"]["loss"])
assert c["done"] and c["step"] == 60 and c["total_steps"] == 60 and c["progress"] == 1
print("ok: values: step 60, loss %.4f, eval loss %.4f, %d tokens" %
      (m["loom_train_loss"], m["loom_train_eval_loss"], m["loom_train_tokens_total"]))
EOF

# The page: the four charts, fed from curves.json, and nothing loaded from elsewhere.
for s in 'id="c-loss"' 'id="c-acc"' 'id="c-lr"' 'id="c-gn"' 'fetch("curves.json"'; do
  grep -qF "$s" "$tmp/page.html" || die "the page lacks $s"
done
if grep -qiE '(src|href)=|@import|url\(' "$tmp/page.html"; then die "the page loads something: $(grep -iE '(src|href)=|@import|url\(' "$tmp/page.html")"; fi
echo "ok: /, /curves.json and /metrics served; 404 elsewhere"

# The Grafana dashboard's queries are valid PromQL: promtool checks them as recording rules (that they
# name exported series is TrainMetrics.GrafanaDashboardQueriesExportedSeries).
python3 - "$src/deploy/grafana/loom-train.json" >"$tmp/dashboard_rules.yml" <<'EOF' || die "dashboard JSON"
import json, sys
def exprs(j):
    if isinstance(j, dict):
        for k, v in j.items():
            if k == "expr" and isinstance(v, str):
                yield v
            else:
                yield from exprs(v)
    elif isinstance(j, list):
        for v in j:
            yield from exprs(v)
found = list(exprs(json.load(open(sys.argv[1]))["panels"]))
assert len(found) >= 15, found
print("groups:\n  - name: loom_train_dashboard\n    rules:")
for i, e in enumerate(found):
    print("      - record: loom_train:dashboard_%d\n        expr: %s" % (i, json.dumps(e)))
EOF
promtool check rules "$tmp/dashboard_rules.yml" >"$tmp/rules.out" 2>&1 || { cat "$tmp/rules.out"; die "dashboard queries"; }
echo "ok: the dashboard's $(grep -c 'record:' "$tmp/dashboard_rules.yml") queries are valid PromQL"

# 3. What the other parts report reaches the series: a step skipped for a NaN gradient (failpoint),
#    checkpoints every 20 steps, the memory arenas, RSS and limit, the eval token accuracy.
port=$(free_port)
url="http://127.0.0.1:$port"
train_config 60 "checkpoint_interval: 20"
LOOM_FAILPOINTS=nan_grad@step=7 start_training "$port" --metrics-linger 3
wait_for 60 done_json || die "the second run never reported done: $(tail -5 "$tmp/train.err")"
fetch "$url/metrics" "$tmp/metrics2.txt" || die "/metrics of the second run"
finish_training
promtool check metrics <"$tmp/metrics2.txt" >"$tmp/promtool2.out" 2>&1 && [ ! -s "$tmp/promtool2.out" ] ||
  { cat "$tmp/promtool2.out"; die "promtool check metrics (second run)"; }
python3 - "$tmp/metrics2.txt" <<'EOF' || die "values of the second run"
import math, sys
m = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    k, v = line.rsplit(" ", 1)
    m[k] = float(v)
assert m["loom_train_skipped_steps_total"] == 1, m["loom_train_skipped_steps_total"]
assert m["loom_train_step"] == 60
assert m["loom_train_checkpoints_total"] == 3 and m["loom_train_checkpoint_seconds_count"] == 3
assert m["loom_train_checkpoint_seconds_sum"] > 0 and m["loom_train_last_checkpoint_time_seconds"] > 1.6e9
arenas = {k for k in m if k.startswith("loom_train_memory_bytes{")}
for a in ("weights", "trainable", "gradients", "optimizer", "activations"):
    assert m.get('loom_train_memory_bytes{arena="%s"}' % a, 0) > 0, (a, sorted(arenas))
assert m["loom_train_memory_rss_bytes"] > 0 and m["loom_train_memory_limit_bytes"] >= m["loom_train_memory_rss_bytes"]
assert m["loom_train_memory_alarm_level"] == 0
acc = m["loom_train_eval_token_accuracy"]
assert math.isfinite(acc) and 0 <= acc <= 1, acc
print("ok: skipped 1, checkpoints 3, %d memory arenas, RSS %d, token accuracy %.3f" %
      (len(arenas), m["loom_train_memory_rss_bytes"], acc))
EOF
echo PASS
