#!/usr/bin/env bash
# `mpirun` across hosts without a second machine: two network namespaces joined
# by a veth pair stand for two hosts, one rank in each, talking TCP only.
#  1. a 2-rank `loom train` (tiny model, LoRA with dropout, evals, several
#     gradient buckets, dist.deterministic, threads 1) writes the same adapter
#     bytes and the same metrics (less the timing fields) as one process with
#     grad_accum 2 (dist.deterministic too);
#  2. bench/bench_allreduce.cpp over the same pair prints its tables.
# Needs root (ip netns add, ip netns exec) and iproute2: exit 77 (skipped)
# otherwise, except under CI=true, where that is a failure.
# Usage: dist_tcp_test.sh LOOM_BINARY SOURCE_DIR [BENCH_ALLREDUCE_BINARY]
#
# How mpirun gets there (Open MPI 4.1.4):
#  - mpirun runs inside namespace A (`ip netns exec A mpirun ...`). The hostfile
#    names the two veth addresses, slots=1 each; Open MPI sees that A's address
#    is one of its own interfaces' and starts that rank itself, and starts an
#    orted for the other address through its rsh launcher (plm rsh).
#  - --mca plm_rsh_agent AGENT replaces ssh: the launcher calls
#    `AGENT HOST orted -mca ess env ...` (no -x: that is added for an agent
#    named ssh only; the agent skips leading options anyway), the command as
#    separate words meant for a remote shell, as ssh would join them. The agent
#    runs `ip netns exec NS sh -c "$*"` in the namespace owning HOST; the
#    environment (PATH, LD_LIBRARY_PATH) comes along as it would not over ssh.
#  - --mca btl tcp,self: no shared memory (vader) between the ranks, and
#    --mca btl_tcp_if_include / oob_tcp_if_include SUBNET: MPI's messages and
#    the orted's runtime connection back to mpirun go over the veth pair only
#    (not loopback, not the veth's IPv6 link-local addresses).
#  Nothing else was needed: no plm_rsh_no_tree_spawn, no orte_keep_fqdn_hostnames;
#  the two namespaces share the host name, /tmp and /dev/shm, yet Open MPI counts
#  two hosts (loom logs "2 ranks on 2 hosts"), from the hostfile's nodes.
set -u
loom=$1
src=$2
bench=${3:-}
tiny=$src/tests/fixtures/model/tiny-llama.f32.gguf

skip() {
  if [ "${CI:-}" = true ]; then echo "FAIL: $* (a skip is a failure under CI=true)"; exit 1; fi
  echo "SKIP: $*"
  exit 77
}
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces (ip netns add)"
command -v ip >/dev/null 2>&1 || skip "ip is not installed (iproute2; scripts/setup --test-deps installs it)"
command -v mpirun >/dev/null 2>&1 || skip "mpirun is not installed (openmpi-bin; scripts/setup installs it)"

tmp=$(mktemp -d)
nsa=loom_dist_a_$$
nsb=loom_dist_b_$$
net=10.231.$(($$ % 250 + 1))
addr_a=$net.1
addr_b=$net.2
subnet=$net.0/24
cleanup() {
  local ns p
  for ns in "$nsa" "$nsb"; do
    # A process left in the test's own namespaces (an orted or rank after a timeout) is this test's.
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }

# Two namespaces, loopback up in each, a veth pair created straight into them
# (no interface ever appears in this namespace, so the names cannot clash).
ip netns add "$nsa" 2>"$tmp/netns.err" || skip "ip netns add failed: $(cat "$tmp/netns.err")"
ip netns add "$nsb" || skip "ip netns add failed for a second namespace"
ip link add veth_a netns "$nsa" type veth peer name veth_b netns "$nsb" || skip "cannot create a veth pair"
ip -n "$nsa" addr add "$addr_a/24" dev veth_a && ip -n "$nsb" addr add "$addr_b/24" dev veth_b &&
  ip -n "$nsa" link set lo up && ip -n "$nsb" link set lo up &&
  ip -n "$nsa" link set veth_a up && ip -n "$nsb" link set veth_b up || {
  echo "FAIL: cannot configure the veth pair"
  exit 1
}

# The launcher's remote shell: AGENT [OPTIONS] HOST COMMAND...
cat >"$tmp/agent" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do case \$1 in -*) shift ;; *) break ;; esac; done
host=\$1
shift
case \$host in
  $addr_a) ns=$nsa ;;
  $addr_b) ns=$nsb ;;
  *) echo "agent: no namespace for host '\$host'" >&2; exit 255 ;;
esac
echo "\$host: \$*" >>"$tmp/agent.log"
exec ip netns exec "\$ns" sh -c "\$*"
EOF
chmod +x "$tmp/agent"
printf '%s slots=1\n%s slots=1\n' "$addr_a" "$addr_b" >"$tmp/hostfile"

# mpirun_ab ARGS...: 2 ranks, rank 0 in namespace A, rank 1 in B, TCP only (90 s at most).
mpirun_ab() {
  timeout 90 ip netns exec "$nsa" mpirun --allow-run-as-root -np 2 --hostfile "$tmp/hostfile" \
    --mca plm_rsh_agent "$tmp/agent" --mca btl tcp,self \
    --mca btl_tcp_if_include "$subnet" --mca oob_tcp_if_include "$subnet" "$@"
}

# 0. Each rank runs in its own namespace, and the second one was started through the agent.
mpirun_ab sh -c 'echo "rank $OMPI_COMM_WORLD_RANK at $(ip -o -4 addr show scope global | awk "{print \$4}")"' \
  >"$tmp/where.out" 2>&1
if grep -qx "rank 0 at $addr_a/24" "$tmp/where.out" && grep -qx "rank 1 at $addr_b/24" "$tmp/where.out" &&
  grep -q "^$addr_b: .*orted" "$tmp/agent.log" 2>/dev/null; then
  ok
else
  bad "ranks not one per namespace:"; cat "$tmp/where.out"; cat "$tmp/agent.log" 2>/dev/null
fi

# 1. Training: 2 ranks (grad_accum 1) against one process (grad_accum 2).
python3 - "$tmp/train.jsonl" <<'EOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(37):
        f.write(json.dumps({"text": f"line {i}: the {'quick' if i % 3 else 'slow'} fox jumps over dog {i * 7}"}) + "\n")
EOF
# config NAME GRAD_ACCUM: LoRA with dropout, a warm-up cosine schedule, evals,
# an epoch boundary with a partial batch, gradients in buckets of 8 KiB (several).
config() {
  cat >"$tmp/$1.yaml" <<EOF
model: $tiny
data: {train: $tmp/train.jsonl, seq_len: 32, pack: false, eval_fraction: 0.1}
lora: {r: 4, dropout: 0.1}
optim: {lr: 3.0e-3, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 3}
batch_size: 2
grad_accum: $2
steps: 12
eval_interval: 4
seed: 11
threads: 1
log_interval: 1000
dist: {deterministic: true, bucket_mb: 0.0078125, timeout: 60}
output_dir: $tmp/$1
metrics_file: $tmp/$1.metrics.jsonl
EOF
}
config one 2
config two 1

# The metrics lines without their timing fields.
losses() {
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    # timings, and the communication fields of a data-parallel run
    for k in ("step_seconds", "elapsed_seconds", "tokens_per_s", "ranks", "wire_bytes",
              "uncompressed_wire_bytes", "comm_seconds", "comm_wait_seconds"):
        j.pop(k, None)
    print(json.dumps(j, sort_keys=True))' "$1"
}

if ! "$loom" train "$tmp/one.yaml" >"$tmp/one.log" 2>&1; then
  bad "one-process run failed:"; tail -20 "$tmp/one.log"
elif ! mpirun_ab "$loom" train "$tmp/two.yaml" >"$tmp/two.log" 2>&1; then
  bad "2-rank run over TCP failed:"; tail -30 "$tmp/two.log"
else
  if grep -q "2 ranks on 2 hosts" "$tmp/two.log" && grep -q "deterministic (rank order)" "$tmp/two.log"; then
    ok
  else
    bad "the 2-rank run did not log data parallel over 2 hosts:"; grep -m3 -i "parallel\|rank" "$tmp/two.log"
  fi
  if [ "$(grep -c '"loss"' "$tmp/one.metrics.jsonl")" -ne 12 ] || [ "$(grep -c '"eval_loss"' "$tmp/one.metrics.jsonl")" -ne 3 ]; then
    bad "one-process metrics: expected 12 step and 3 eval lines"; cat "$tmp/one.metrics.jsonl"
  elif ! diff <(losses "$tmp/one.metrics.jsonl") <(losses "$tmp/two.metrics.jsonl") >"$tmp/diff"; then
    bad "2 ranks over TCP: metrics differ from one process with grad_accum 2"; head -8 "$tmp/diff"
  else
    ok
  fi
  if cmp "$tmp/one/adapter_model.safetensors" "$tmp/two/adapter_model.safetensors" &&
    cmp "$tmp/one/adapter_config.json" "$tmp/two/adapter_config.json"; then
    ok
  else
    bad "2 ranks over TCP: adapter bytes differ from one process with grad_accum 2"
  fi
fi

# 2. The all-reduce benchmark over the same pair: a table per path and a fit line each.
if [ -z "$bench" ] || [ ! -x "$bench" ]; then
  echo "NOTE: the all-reduce benchmark was not built (LOOM_BUILD_BENCH=OFF): part 2 left out"
elif ! mpirun_ab "$bench" --min-bytes 4 --max-bytes 64K --reps 3 --warmup 1 --json "$tmp/bench.jsonl" \
  >"$tmp/bench.out" 2>&1; then
  bad "the all-reduce benchmark over TCP failed:"; tail -20 "$tmp/bench.out"
else
  cat "$tmp/bench.out"
  if grep -q "2 ranks on 2 hosts" "$tmp/bench.out" && [ "$(grep -c 'busbw GB/s' "$tmp/bench.out")" -eq 2 ] &&
    [ "$(grep -c '^fit t = alpha + beta \* bytes' "$tmp/bench.out")" -eq 2 ] &&
    [ "$(grep -cE '^ +(4 B|64 KiB) +[0-9.]+ [um]?s ' "$tmp/bench.out")" -eq 4 ] &&
    [ "$(grep -c '"median_s"' "$tmp/bench.jsonl")" -eq 16 ]; then
    ok
  else
    bad "the all-reduce benchmark's output lacks its tables"
  fi
fi

echo "dist_tcp: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
