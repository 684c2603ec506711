#!/usr/bin/env bash
# A real Prometheus server scrapes `loom train --metrics-port` every second
# during a tiny-model run; the loom_train_ series are then read back through
# its HTTP API (/api/v1/query): the last step, the run's info labels, the
# target's health, and that the scrapes saw the run go on.
# Usage: train_prometheus_test.sh LOOM_BINARY SOURCE_DIR   (exit 77: skipped, prometheus missing, not under CI=true)
set -u
. "$(dirname "$0")/train_monitor_common.sh"
require_tool prometheus "the Prometheus server, Debian package prometheus"

port=$(free_port)
prom_port=$(free_port)
[ "$port" != "$prom_port" ] || prom_port=$(free_port)
prom="http://127.0.0.1:$prom_port"
cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: loom_train
    static_configs:
      - targets: ['127.0.0.1:$port']
EOF
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
bg_pids+=($!)
wait_for 30 fetch "$prom/-/ready" || { tail -20 "$tmp/prometheus.log"; die "Prometheus not ready on $prom"; }
# Prometheus starts a target's scrape loop only at its first discovery reload (up to 5 s after it is
# ready): wait until it has tried the (not yet listening) target once, so the run is scraped throughout.
scraping() {
  python3 - "$prom" <<'PY'
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/api/v1/targets", timeout=5) as r:
    targets = json.load(r)["data"]["activeTargets"]
assert targets and not targets[0]["lastScrape"].startswith("0001"), targets
PY
}
wait_for 30 scraping || die "Prometheus never tried to scrape 127.0.0.1:$port"

# About 1,000 steps of the tiny model (a few seconds), evaluated every 250 steps; 3 s more
# of serving after the end, so at least one scrape sees the final values.
steps=1000
train_config $steps
sed -i 's/^eval_interval: .*/eval_interval: 250/' "$tmp/train.yaml"
start=$SECONDS
start_training "$port" --metrics-linger 3
finish_training
echo "ok: the run took $((SECONDS - start)) s (3 s of it serving after the end)"

# query EXPR: the first result's value (an instant vector), or empty.
query() {
  python3 - "$prom" "$1" <<'EOF'
import json, sys, urllib.parse, urllib.request
url = sys.argv[1] + "/api/v1/query?" + urllib.parse.urlencode({"query": sys.argv[2]})
with urllib.request.urlopen(url, timeout=5) as r:
    body = json.load(r)
assert body["status"] == "success", body
res = body["data"]["result"]
print(res[0]["value"][1] if res else "")
EOF
}
# The last scrape may still be in flight when the trainer exits: read back (Prometheus keeps what it
# scraped; range selectors skip the staleness markers it wrote when the target went away).
wait_for 10 test "$(query "max_over_time(loom_train_step{job=\"loom_train\"}[5m])")" = "$steps" ||
  die "max_over_time(loom_train_step) is '$(query "max_over_time(loom_train_step{job=\"loom_train\"}[5m])")', wanted $steps"
scrapes=$(query 'count_over_time(loom_train_step{job="loom_train"}[5m])')
[ "${scrapes:-0}" -ge 2 ] || die "only '${scrapes}' scrapes stored"
up=$(query 'max_over_time(up{job="loom_train"}[5m])')
[ "$up" = 1 ] || die "up is '$up'"
info=$(query 'count(max_over_time(loom_train_info{job="loom_train",model="tiny-llama.f32.gguf",method="lora"}[5m]))')
[ "$info" = 1 ] || die "loom_train_info{model,method} not stored ('$info')"
total=$(query 'max_over_time(loom_train_total_steps{job="loom_train"}[5m])')
[ "$total" = "$steps" ] || die "loom_train_total_steps is '$total'"
tokens=$(query 'max_over_time(loom_train_tokens_total{job="loom_train"}[5m])')
[ "$tokens" = $((steps * 2 * 48)) ] || die "loom_train_tokens_total is '$tokens', wanted $((steps * 2 * 48))"
hist=$(query 'max_over_time(loom_train_step_seconds_count{job="loom_train"}[5m])')
[ "$hist" = "$steps" ] || die "loom_train_step_seconds_count is '$hist'"
first=$(query 'min_over_time(loom_train_step{job="loom_train"}[5m])')
echo "ok: Prometheus stored $scrapes scrapes of loom_train_step (from step $first to $steps), up 1, info labels, tokens $tokens"
echo PASS
