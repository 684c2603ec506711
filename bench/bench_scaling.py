#!/usr/bin/env python3
"""An alpha-beta cost model of loom's data-parallel training step (docs/training.md, Scale-out, "Scaling
model"): validated against real step times on this machine, then projected to clusters.

The model (one step, every rank alike, weak scaling: a fixed batch per rank):
  - compute: forward t_f and backward t_b of one rank's micro-batch, then the optimizer t_o. Measured
    here (1 rank: step time with grad_accum 1 and G = 3, (T_G - T_1) / (G - 1) is one forward+backward,
    split 1:2 (full) or 1:1 (LoRA) as the FLOPs) or, for the projection, from FLOPs at an effective
    rate: full fine-tuning 6 x P x T (forward 2, backward 4), LoRA 4 x P x T for the frozen weights
    (forward and the input gradient) + 6 x P_adapters x T, plus attention 2 x layers x seq x d_attn per
    token forward (twice that backward); AdamW 28 bytes of memory traffic per trainable parameter.
    On this 2-core machine N ranks of `threads` threads share the cores: compute x max(1, N threads / cores).
  - gradients: the arena loom lays out (a Llama: per layer q/k/v/o and gate/up/down, with full
    fine-tuning the two norms per layer and, outside the layers, the embedding, final norm and an
    untied head; LoRA: A [r, in] and B [out, r] on all seven targets), cut into buckets as
    GradientReducer::plan_buckets does (whole layers, last first, merged up to dist.bucket_mb; what no
    layer covers in chunks of the cap, reduced after the backward).
  - a bucket is ready when the backward has done its layers (in proportion to the layers done); the
    communication thread takes them in order: start = max(ready, previous end), end = start + t(bucket);
    step = max(t_f + t_b, last end) + t_o (+ two all-reduces of a few bytes, the loss and the memory alarm:
    log2(N) alpha each, recursive doubling).
    dist.overlap false: every bucket is ready at the backward's end.
  - all-reduce of b bytes over N ranks (ring): 2(N-1) alpha + 2(N-1)/N b beta. Across nodes of g ranks
    (M = N/g nodes), flat: the ring's slowest link sets every step, 2(N-1) alpha_e + 2(N-1)/N b beta_e;
    hierarchical: a ring inside the node (reduce-scatter + all-gather) and g rings across nodes on 1/g
    each, sharing the node's network: 2(g-1) alpha_i + 2(g-1)/g b beta_i + 2(M-1) alpha_e + 2(M-1)/M b beta_e.
  - compression: PowerSGD rank r = two all-reduces per bucket (P: r x rows of each compressed matrix plus
    the uncompressed entries; then Q: r x cols), each with its own latency; loom compresses a matrix
    when r (rows + cols) 2 <= rows cols and it lies inside one bucket. top-k = an all-gather of 8 k bytes
    per rank (index, value), (N-1) alpha + (N-1) 8 k beta: it GROWS with N (its traffic passes the
    plain all-reduce's at N = 1/ratio). The compression's own arithmetic is not modelled.
  - E(N) = T_step(1) / T_step(N); T_step(1) has no communication.
  - not modelled: memory bandwidth shared by the ranks of a host, the communication thread's copies
    taking CPU from the compute (shared memory here), ranks reaching the all-reduce at different
    times (stragglers), the compression's own arithmetic, memory (full fine-tuning of 8B/70B needs
    ZeRO or sharding to fit at all).
  - loom's dist.algorithm auto with Open MPI 4.1: libnbc runs an in-place MPI_Iallreduce as a binomial
    tree (reduce to rank 0, then broadcast: 2 log2(N) steps of the whole bucket); the validation models
    that (--local-algorithm binomial); the projection's JSON has it as the variant "binomial".

Validation on this machine (loom under mpirun at N = 1 (grad_accum 1 and 3), 2, 4; LoRA main job with
batch_size 2 a rank and full fine-tuning with batch_size 1, seq_len 64; 1 thread a rank; 6 steps, median
of steps 2..6, median of 3 runs in a shuffled order; each run waits until no other cc1plus or
`loom train` runs; the output folder goes to /dev/shm and is removed; ~15 min on 2 cores), alpha/beta
from bench_allreduce (the 4-rank fit only feeds a diagnostic column):
  mpirun --allow-run-as-root -np 2 build/bench/loom_bench_allreduce --max-bytes 256M --reps 10 --paths async \
      --json /tmp/ar_n2_auto.jsonl
  mpirun --allow-run-as-root --oversubscribe -np 4 build/bench/loom_bench_allreduce --max-bytes 256M --reps 10 \
      --paths async --json /tmp/ar_n4_auto.jsonl
  python3 bench/bench_scaling.py --validate --allreduce-json /tmp/ar_n2_auto.jsonl /tmp/ar_n4_auto.jsonl \
      --out bench/results/scaling.json
The measured times and the all-reduce fits are kept in --out; --measured FILE reuses a previous --out's
instead of running loom (bench/results/scaling.json holds the figures of docs/training.md):
  python3 bench/bench_scaling.py --measured bench/results/scaling.json
Projection only (no loom, no MPI; the cluster profile's flags: --help):
  python3 bench/bench_scaling.py [--tflops 150 --inter-gbit 200 --tokens-per-rank 8192 ...] --out FILE
"""
import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    # layers, hidden, ffn, heads, kv heads, vocab, tied embedding/head
    "SmolLM2-135M": dict(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3, vocab=49152, tied=True),
    "Llama-3-8B": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, tied=False),
    "Llama-3-70B": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, tied=False),
}

NS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


# ---------------------------------------------------------------- the gradient arena and its buckets

def targets(m):
    """The seven projections of a layer as (out, in) = the weight's (rows, cols)."""
    d, f = m["hidden"], m["ffn"]
    hd = d // m["heads"]
    q, kv = m["heads"] * hd, m["kv_heads"] * hd
    return [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]


def arena(m, method, lora_r):
    """(layers, rest): per layer the list of its tensors (rows, cols) (vectors: rows 1), and the
    tensors no layer covers."""
    layers = []
    for _ in range(m["layers"]):
        if method == "full":
            layers.append(targets(m) + [(1, m["hidden"]), (1, m["hidden"])])
        else:
            t = []
            for out, inp in targets(m):
                t += [(lora_r, inp), (out, lora_r)]
            layers.append(t)
    rest = []
    if method == "full":
        rest = [(m["vocab"], m["hidden"]), (1, m["hidden"])] + ([] if m["tied"] else [(m["vocab"], m["hidden"])])
    return layers, rest


def plan_buckets(layers, rest, cap_bytes, elem_bytes=4):
    """GradientReducer::plan_buckets: whole layers, last first, merged while under the cap; what no
    layer covers in chunks of the cap (a matrix split over chunks is in no bucket's matrix list).
    Each bucket: elements, layer_lo (None: after the backward), matrices wholly inside."""
    cap = max(1, cap_bytes // elem_bytes)
    buckets = []
    for l in range(len(layers) - 1, -1, -1):
        n = sum(r * c for r, c in layers[l])
        last = buckets[-1] if buckets else None
        if last and last["layer_lo"] == l + 1 and last["elements"] + n <= cap:
            last["elements"] += n
            last["layer_lo"] = l
            last["matrices"] += layers[l]
        else:
            buckets.append({"elements": n, "layer_lo": l, "matrices": list(layers[l])})
    at = 0
    spans = []
    for r, c in rest:
        spans.append((at, r, c))
        at += r * c
    for o in range(0, at, cap):
        n = min(cap, at - o)
        inside = [(r, c) for s, r, c in spans if s >= o and s + r * c <= o + n]
        buckets.append({"elements": n, "layer_lo": None, "matrices": inside})
    return buckets


# ---------------------------------------------------------------- collectives

def allreduce_time(b, n, p):
    if n <= 1 or b <= 0:
        return 0.0
    g = min(n, p["ranks_per_node"])
    nodes = math.ceil(n / g)
    if p.get("algorithm") == "binomial":  # reduce to a root, then broadcast: 2 log2(N) steps of the whole b
        return 2 * (math.ceil(math.log2(g)) * (p["alpha_i"] + b * p["beta_i"])
                    + math.ceil(math.log2(nodes)) * (p["alpha_e"] + b * p["beta_e"]))
    if nodes == 1:
        return 2 * (n - 1) * p["alpha_i"] + 2 * (n - 1) / n * b * p["beta_i"]
    if not p["hierarchical"]:
        return 2 * (n - 1) * p["alpha_e"] + 2 * (n - 1) / n * b * max(p["beta_e"], p["beta_i"])
    return (2 * (g - 1) * p["alpha_i"] + 2 * (g - 1) / g * b * p["beta_i"]
            + 2 * (nodes - 1) * p["alpha_e"] + 2 * (nodes - 1) / nodes * b * p["beta_e"])


def small_allreduce_time(n, p):
    """A few bytes: recursive doubling (what MPI picks for them), log2(N) steps of the slowest link."""
    if n <= 1:
        return 0.0
    alpha = p["alpha_i"] if n <= p["ranks_per_node"] else p["alpha_e"]
    return math.ceil(math.log2(n)) * alpha


def allgather_time(s, n, p):
    """Each rank contributes s bytes, every rank ends with all n s."""
    if n <= 1 or s <= 0:
        return 0.0
    g = min(n, p["ranks_per_node"])
    nodes = math.ceil(n / g)
    if nodes == 1:
        return (n - 1) * (p["alpha_i"] + s * p["beta_i"])
    if not p["hierarchical"]:
        return (n - 1) * (p["alpha_e"] + s * max(p["beta_e"], p["beta_i"]))
    return ((g - 1) * (p["alpha_i"] + s * p["beta_i"])  # inside the node
            + (nodes - 1) * (p["alpha_e"] + g * s * p["beta_e"])  # node blocks across nodes, g rings on slices
            + (g - 1) * p["alpha_i"] + (g - 1) * (nodes - 1) * s * p["beta_i"])  # the other nodes' blocks inside


def bucket_comm(bk, n, p, comp, elem_bytes=4):
    """(seconds, bytes this rank sends) of one bucket's reduction."""
    if comp["kind"] == "none":
        b = bk["elements"] * elem_bytes
        return allreduce_time(b, n, p), 2 * (n - 1) / n * b
    if comp["kind"] == "topk":
        # ceil(ratio n) per tensor and per run between tensors: ~ ratio x elements
        k = math.ceil(comp["ratio"] * bk["elements"])
        e = 4 + elem_bytes  # uint32 index + value
        return allgather_time(e * k, n, p), (n - 1) * e * k
    if comp["kind"] == "powersgd":
        r = comp["rank"]
        p_f = q_f = 0
        compressed = 0
        for rows, cols in bk["matrices"]:
            if rows > 1 and r * (rows + cols) * 2 <= rows * cols:
                p_f += r * rows
                q_f += r * cols
                compressed += rows * cols
        p_b = (p_f + bk["elements"] - compressed) * elem_bytes
        q_b = q_f * elem_bytes
        t = allreduce_time(p_b, n, p) + (allreduce_time(q_b, n, p) if q_f else 0.0)
        return t, 2 * (n - 1) / n * (p_b + q_b)
    if comp["kind"] == "allreduce_fraction":  # hypothetical: a sparse all-reduce of a share, indices agreed
        b = comp["ratio"] * bk["elements"] * elem_bytes
        return allreduce_time(b, n, p), 2 * (n - 1) / n * b
    raise ValueError(comp)


def simulate(buckets, n_layers, n, p, comp, t_f, t_b, t_o, overlap=True, elem_bytes=4):
    """One step: returns step seconds, the wait after the backward, the comm thread's busy time, bytes."""
    compute_end = t_f + t_b
    end = 0.0
    busy = sent = 0.0
    for bk in buckets:
        if overlap and bk["layer_lo"] is not None:
            ready = t_f + t_b * (n_layers - bk["layer_lo"]) / n_layers
        else:
            ready = compute_end
        t, s = bucket_comm(bk, n, p, comp, elem_bytes)
        end = max(ready, end) + t
        busy += t
        sent += s
    small = 2 * small_allreduce_time(n, p)  # the step's loss/tokens and the memory alarm
    step = max(compute_end, end) + t_o + small
    return {"step": step, "wait": max(0.0, end - compute_end), "comm": busy, "wire_bytes": sent}


# ---------------------------------------------------------------- compute from FLOPs

def flops(m, method, lora_r, tokens, seq):
    """(forward, backward) FLOPs of one rank's micro-batch."""
    pm = sum(r * c for r, c in targets(m)) * m["layers"] + m["vocab"] * m["hidden"]  # + the head's product
    d_attn = m["heads"] * (m["hidden"] // m["heads"])
    seq = min(seq, tokens)  # fewer tokens than a row: one shorter row
    attn = 2 * m["layers"] * seq * d_attn  # per token, causal (QK^T and AV over seq/2 on average)
    if method == "full":
        fwd = (2 * pm + attn) * tokens
        return fwd, 2 * fwd
    pa = sum(lora_r * (r + c) for r, c in targets(m)) * m["layers"]
    return (2 * pm + attn + 2 * pa) * tokens, (2 * pm + 2 * attn + 4 * pa) * tokens


def trainable(m, method, lora_r):
    layers, rest = arena(m, method, lora_r)
    return sum(r * c for l in layers for r, c in l) + sum(r * c for r, c in rest)


# ---------------------------------------------------------------- measuring loom here

JOBS = {
    "lora": ["--set", "batch_size=2"],
    "full": ["--set", "method=full", "--set", "optim.lr=1e-5", "--set", "batch_size=1", "--set", "data.seq_len=64"],
}


def busy_now():
    found = []
    for pattern in ("cc1plus", "loom train"):
        r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        found += r.stdout.split()
    return found


def measure(job, n, grad_accum, steps, work, tag, threads=1, algorithm="auto"):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n)] if n > 1 else []
    metrics = os.path.join(work, tag + ".jsonl")
    cmd += [os.path.join(ROOT, "build", "loom"), "train", os.path.join(ROOT, "configs", "main_job.yaml")] + JOBS[job]
    # The output folder (a 540 MB model with method full) in tmpfs, removed after the run: its
    # writeback would land on the next run.
    out = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"loom-scaling-{os.getpid()}-{tag}")
    cmd += ["--set", f"threads={threads}", "--set", f"steps={steps}", "--set", f"grad_accum={grad_accum}",
            "--set", "eval_interval=0", "--set", f"output_dir={out}",
            "--set", f"metrics_file={metrics}", "--set", f"dist.algorithm={algorithm}", "--overwrite"]
    for _ in range(180):  # wait (up to 30 min) for other compilers and trainings to end
        if not busy_now():
            break
        time.sleep(10)
    quiet = not busy_now()
    try:
        with open(os.path.join(work, tag + ".log"), "w") as log:
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    quiet = quiet and not busy_now()  # none before, none after
    s = [json.loads(l) for l in open(metrics)]
    s = [x for x in s if "step_seconds" in x][1:]  # steps 2..n
    return {"step": statistics.median(x["step_seconds"] for x in s),
            "wait": statistics.median(x.get("comm_wait_seconds", 0) for x in s),
            "comm": statistics.median(x.get("comm_seconds", 0) for x in s),
            "wire_bytes": s[-1].get("wire_bytes", 0), "quiet": quiet, "command": " ".join(cmd)}


def run_validation(args):
    work = tempfile.mkdtemp(prefix="loom-scaling-")
    points = [(job, n, g) for job in args.jobs for n, g in [(1, 1), (1, args.split_accum), (2, 1), (4, 1)]]
    runs = {f"{j}/{n}/{g}": [] for j, n, g in points}
    rng = random.Random(1)
    for rep in range(args.repeats):
        order = list(points)
        rng.shuffle(order)  # a new order each round: what runs after a full run's output writes varies
        for j, n, g in order:
            r = measure(j, n, g, args.steps, work, f"{j}_n{n}_g{g}_r{rep}", args.threads, args.algorithm)
            runs[f"{j}/{n}/{g}"].append(r)
            print(f"measured {j} N={n} grad_accum={g} rep {rep}: step {r['step']:.3f} s, wait {r['wait']:.4f} s"
                  f"{'' if r['quiet'] else ' (not quiet)'}", file=sys.stderr, flush=True)
    out = {}
    for key, rs in runs.items():
        out[key] = {k: statistics.median(r[k] for r in rs) for k in ("step", "wait", "comm", "wire_bytes")}
        out[key]["runs"] = rs
        out[key]["quiet"] = sum(r["quiet"] for r in rs)
    return out


def read_fits(files, path):
    """{ranks: (alpha, beta, file)} from bench_allreduce --json files (the fit of `path`)."""
    fits = {}
    for name in files or []:
        head = None
        for line in open(name):
            j = json.loads(line)
            if "ranks" in j and "algorithm" in j:
                head = j
            if j.get("fit") and j.get("path") == path:
                fits[head["ranks"] if head else 2] = (j["alpha_s"], j["beta_s_per_byte"], name)
    return fits


def profile_from_fit(alpha, beta, n, algorithm, source):
    """alpha/beta of one step from bench_allreduce's fit t = alpha + beta b over n ranks: ring
    t = 2(n-1) a + 2(n-1)/n b beta; binomial (Open MPI 4.1's libnbc for an in-place all-reduce, which is
    what loom's dist.algorithm auto gets) t = 2 log2(n) (a + b beta)."""
    if algorithm == "binomial":
        a = alpha / (2 * math.ceil(math.log2(n)))
        b = beta / (2 * math.ceil(math.log2(n)))
    else:
        a = alpha / (2 * (n - 1))
        b = beta / (2 * (n - 1) / n)
    return {"alpha_i": a, "beta_i": b, "alpha_e": a, "beta_e": b, "ranks_per_node": 1 << 30, "hierarchical": False,
            "algorithm": algorithm, "fit_alpha_s": alpha, "fit_beta_s_per_byte": beta, "fit_ranks": n,
            "source": source}


def local_profile(args, saved_fits=None):
    """The link from the 2-rank fit (or --alpha-us/--beta-gbps); fits at other rank counts, when given,
    are kept for the diagnostic column. saved_fits: those of a previous --out (--measured)."""
    fits = read_fits(args.allreduce_json, args.allreduce_path)
    if not fits and saved_fits:
        fits = {int(n): tuple(v) for n, v in saved_fits.items()}
    if 2 in fits:
        alpha, beta, name = fits[2]
        source = f"{name} ({args.allreduce_path} path, 2 ranks)"
    else:
        alpha, beta = args.alpha_us * 1e-6, 1.0 / (args.beta_gbps * 1e9)
        source = f"--alpha-us {args.alpha_us} --beta-gbps {args.beta_gbps} (a 2-rank fit)"
    prof = profile_from_fit(alpha, beta, 2, args.local_algorithm, source)
    prof["fits_at"] = {n: profile_from_fit(a, b, n, args.local_algorithm, f"{f} ({n} ranks)")
                       for n, (a, b, f) in fits.items()}
    prof["fits"] = {n: list(v) for n, v in fits.items()}
    return prof


def validate(args, measured, saved_fits=None):
    prof = local_profile(args, saved_fits)
    m = MODELS["SmolLM2-135M"]
    rows = []
    for job in args.jobs:
        t1 = measured[f"{job}/1/1"]["step"]
        ga = max(int(k.split("/")[2]) for k in measured if k.startswith(f"{job}/1/"))
        tg = measured[f"{job}/1/{ga}"]["step"]
        c = min(max((tg - t1) / (ga - 1), 0.0), t1)  # one micro-batch's forward + backward
        t_o = t1 - c  # the optimizer and the step's other fixed costs
        share_f = 1 / 3 if job == "full" else 1 / 2
        layers, rest = arena(m, job, 16)
        buckets = plan_buckets(layers, rest, 25 << 20)
        for n in (1, 2, 4):
            key = f"{job}/{n}/1"
            if key not in measured:
                continue
            f = max(1.0, n * args.threads / args.cores)
            r = simulate(buckets, m["layers"], n, prof, {"kind": "none"}, c * share_f * f, c * (1 - share_f) * f,
                         t_o * f)
            # Diagnostic: the all-reduce as measured at this rank count (oversubscribed at 4 here).
            pn = prof["fits_at"].get(n)
            rn = simulate(buckets, m["layers"], n, pn, {"kind": "none"}, c * share_f * f, c * (1 - share_f) * f,
                          t_o * f) if pn and n > 1 else None
            meas = measured[key]
            rows.append({"job": job, "ranks": n, "measured_step": meas["step"], "predicted_step": r["step"],
                         "error": r["step"] / meas["step"] - 1, "measured_wait": meas["wait"],
                         "predicted_wait": r["wait"], "measured_comm": meas["comm"], "predicted_comm": r["comm"],
                         "measured_wire_bytes": meas["wire_bytes"], "predicted_wire_bytes": r["wire_bytes"],
                         "oversubscription": f, "compute_1": c, "optimizer_1": t_o, "split_accum": ga,
                         "measured_E": measured[f"{job}/1/1"]["step"] / meas["step"],
                         "predicted_E": (c + t_o) / r["step"], "quiet_runs": meas.get("quiet"),
                         "predicted_step_fit_at_n": rn["step"] if rn else None,
                         "predicted_wait_fit_at_n": rn["wait"] if rn else None})
    return prof, rows


# ---------------------------------------------------------------- projection

def cluster_profile(args):
    return {"alpha_i": args.intra_alpha_us * 1e-6, "beta_i": 1 / (args.intra_gbps * 1e9),
            "alpha_e": args.inter_alpha_us * 1e-6, "beta_e": 1 / (args.inter_gbit / 8 * args.inter_efficiency * 1e9),
            "ranks_per_node": args.ranks_per_node, "hierarchical": True}


COMPRESSIONS = {
    "none": {"kind": "none"},
    "powersgd": {"kind": "powersgd", "rank": 4},
    "topk": {"kind": "topk", "ratio": 0.1},
}


def project_one(m, method, comp, prof, args, ns):
    tokens = args.tokens_per_rank
    f_fwd, f_bwd = flops(m, method, args.lora_r, tokens, args.seq_len)
    rate = args.tflops * 1e12
    t_f, t_b = f_fwd / rate, f_bwd / rate
    t_o = 28 * trainable(m, method, args.lora_r) / (args.hbm_gbps * 1e9)
    layers, rest = arena(m, method, args.lora_r)
    buckets = plan_buckets(layers, rest, int(args.bucket_mb * (1 << 20)), args.grad_bytes)
    t1 = t_f + t_b + t_o
    out = {"t_forward": t_f, "t_backward": t_b, "t_optimizer": t_o, "t_step_1": t1,
           "gradient_bytes": trainable(m, method, args.lora_r) * args.grad_bytes, "buckets": len(buckets), "N": {}}
    for n in ns:
        res = {}
        for variant in ("hierarchical", "flat", "binomial"):
            p = dict(prof, hierarchical=variant == "hierarchical", algorithm="binomial" if variant == "binomial" else "ring")
            r = simulate(buckets, m["layers"], n, p, comp, t_f, t_b, t_o, elem_bytes=args.grad_bytes)
            res[variant] = {"step": r["step"], "E": t1 / r["step"], "wait": r["wait"], "comm": r["comm"],
                            "wire_bytes": r["wire_bytes"]}
        out["N"][n] = res
    return out


def solve(lo, hi, fn, target, iters=60, log=True):
    """fn monotone on [lo, hi]; x with fn(x) = target (bisection, geometric when log)."""
    f_lo = fn(lo) - target
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if log else (lo + hi) / 2
        if (fn(mid) - target) * f_lo > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) if log else (lo + hi) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("validation on this machine")
    g.add_argument("--validate", action="store_true", help="run loom at N = 1 (grad_accum 1, 2), 2, 4 and compare")
    g.add_argument("--measured", help="a previous --out JSON: its measured times instead of running loom")
    g.add_argument("--jobs", nargs="+", default=["lora", "full"], choices=list(JOBS))
    g.add_argument("--steps", type=int, default=6)
    g.add_argument("--split-accum", type=int, default=3,
                   help="1 rank with grad_accum 1 and this: (T_G - T_1) / (G - 1) is one forward+backward")
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--threads", type=int, default=1, help="threads per rank")
    g.add_argument("--cores", type=int, default=os.cpu_count())
    g.add_argument("--allreduce-json", nargs="+",
                   help="bench_allreduce --json outputs: the 2-rank fit gives alpha and beta; fits at other rank "
                        "counts give the diagnostic column")
    g.add_argument("--allreduce-path", default="async", help="the fit of this path (async: the buckets' path)")
    g.add_argument("--local-algorithm", choices=["binomial", "ring"], default="binomial",
                   help="the all-reduce of the validation runs: binomial = dist.algorithm auto with Open MPI 4.1 "
                        "(libnbc's choice for an in-place all-reduce), ring = dist.algorithm ring")
    g.add_argument("--algorithm", default="auto", help="dist.algorithm of the validation runs")
    g.add_argument("--alpha-us", type=float, default=20.0, help="without --allreduce-json: the fit's alpha (us)")
    g.add_argument("--beta-gbps", type=float, default=5.0, help="without --allreduce-json: the fit's 1/beta (GB/s)")
    c = p.add_argument_group("cluster profile of the projection (public figures, not measured)")
    c.add_argument("--tflops", type=float, default=150.0,
                   help="effective TFLOP/s per accelerator (default ~48%% of an A100 SXM's 312 bf16 dense peak)")
    c.add_argument("--hbm-gbps", type=float, default=1500.0, help="memory GB/s for AdamW (A100 80GB: 2039 peak)")
    c.add_argument("--ranks-per-node", type=int, default=8)
    c.add_argument("--intra-gbps", type=float, default=200.0,
                   help="inside a node, GB/s per ring link (NVLink 3: 300 GB/s a direction, NVIDIA's A100 figures)")
    c.add_argument("--intra-alpha-us", type=float, default=5.0, help="latency of one step inside a node (assumed)")
    c.add_argument("--inter-gbit", type=float, default=200.0, help="network Gb/s per node: one HDR InfiniBand / 200 GbE NIC (a DGX A100 has eight: 1600)")
    c.add_argument("--inter-efficiency", type=float, default=0.9, help="share of the line rate reached")
    c.add_argument("--inter-alpha-us", type=float, default=10.0,
                   help="latency of one step between nodes (assumed: InfiniBand's wire ~1-2 us plus the library's)")
    c.add_argument("--tokens-per-rank", type=int, default=8192, help="tokens per rank per step (4 x 2048)")
    c.add_argument("--seq-len", type=int, default=2048)
    c.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element (loom: f32)")
    c.add_argument("--bucket-mb", type=float, default=25.0)
    c.add_argument("--lora-r", type=int, default=16)
    c.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    c.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--out", help="JSON file: profile, measured, validation, projection")
    args = p.parse_args()
    result = {"command": " ".join(sys.argv)}

    measured = saved_fits = None
    if args.validate:
        measured = run_validation(args)
    elif args.measured:
        saved = json.load(open(args.measured))
        measured, saved_fits = saved["measured"], saved.get("allreduce_fits")
    if measured:
        result["measured"] = measured
        prof, rows = validate(args, measured, saved_fits)
        result["allreduce_fits"] = prof["fits"]  # {ranks: [alpha s, beta s/byte, bench_allreduce --json file]}
        result["local_profile"] = prof
        result["validation"] = rows
        print(f"## Validation on this machine ({args.cores} cores, {args.threads} thread(s) a rank)\n")
        print(f"alpha/beta: {prof['source']}: fit t = {prof['fit_alpha_s'] * 1e6:.1f} us + bytes / "
              f"{1e-9 / prof['fit_beta_s_per_byte']:.2f} GB/s, i.e. per ring step alpha = {prof['alpha_i'] * 1e6:.1f} us, "
              f"1/beta = {1e-9 / prof['beta_i']:.2f} GB/s\n")
        print("| job | N | measured step s (runs' min-max) | predicted s | error | wait measured / predicted s | "
              "comm thread measured / predicted s | E measured / predicted | wire MB measured / model | "
              "predicted with the N-rank fit (error) | quiet runs |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            rs = measured[f"{r['job']}/{r['ranks']}/1"].get("runs", [])
            spread = f" ({min(x['step'] for x in rs):.3f}-{max(x['step'] for x in rs):.3f})" if rs else ""
            quiet = f"{sum(x['quiet'] for x in rs)}/{len(rs)}" if rs else "-"
            print(f"| {r['job']} | {r['ranks']} | {r['measured_step']:.3f}{spread} | {r['predicted_step']:.3f} | "
                  f"{100 * r['error']:+.0f}% | {r['measured_wait']:.3f} / {r['predicted_wait']:.3f} | "
                  f"{r['measured_comm']:.3f} / {r['predicted_comm']:.3f} | {r['measured_E']:.2f} / {r['predicted_E']:.2f} | "
                  f"{r['measured_wire_bytes'] / 1e6:.2f} / {r['predicted_wire_bytes'] / 1e6:.2f} | "
                  + (f"{r['predicted_step_fit_at_n']:.3f} ({100 * (r['predicted_step_fit_at_n'] / r['measured_step'] - 1):+.0f}%)"
                     if r["predicted_step_fit_at_n"] else "-") + f" | {quiet} |")
        for job in args.jobs:
            r0 = next(r for r in rows if r["job"] == job)
            print(f"\n{job}: one rank's forward+backward {r0['compute_1']:.3f} s (grad_accum {r0['split_accum']} against 1), optimizer and "
                  f"the rest {r0['optimizer_1']:.3f} s")
        print()

    prof = cluster_profile(args)
    result["cluster_profile"] = {k: vars(args)[k] for k in (
        "tflops", "hbm_gbps", "ranks_per_node", "intra_gbps", "intra_alpha_us", "inter_gbit", "inter_efficiency",
        "inter_alpha_us", "tokens_per_rank", "seq_len", "grad_bytes", "bucket_mb", "lora_r")}
    print("## Projection: E(N) = T_step(1) / T_step(N), weak scaling\n")
    print(f"Cluster profile (public figures, not measured here): {args.ranks_per_node} accelerators a node at "
          f"{args.tflops:g} effective TFLOP/s and {args.hbm_gbps:g} GB/s memory; inside a node {args.intra_gbps:g} GB/s "
          f"a link, alpha {args.intra_alpha_us:g} us; between nodes {args.inter_gbit:g} Gb/s a node at "
          f"{100 * args.inter_efficiency:.0f}% ({args.inter_gbit / 8 * args.inter_efficiency:.1f} GB/s), alpha "
          f"{args.inter_alpha_us:g} us. {args.tokens_per_rank} tokens a rank a step (seq_len {args.seq_len}), "
          f"{args.grad_bytes}-byte gradients, {args.bucket_mb:g} MB buckets, overlap on. Cells: hierarchical "
          f"all-reduce (flat ring in brackets). PowerSGD rank 4; top-k ratio 0.1 is an all-gather whose bytes "
          f"grow with N (= the all-reduce's at N = 10, 25x it at 256).\n")
    proj = {}
    for name in args.models:
        m = MODELS[name]
        print(f"### {name}\n")
        print("| method | compression | T_step(1) s | grad MB | " + " | ".join(f"N={n}" for n in args.ranks) + " |")
        print("|---|---|---|---|" + "---|" * len(args.ranks))
        for method in ("lora", "full"):
            for cname, comp in COMPRESSIONS.items():
                r = project_one(m, method, comp, prof, args, args.ranks)
                proj[f"{name}/{method}/{cname}"] = r
                cells = [f"{r['N'][n]['hierarchical']['E']:.2f} ({r['N'][n]['flat']['E']:.2f})" for n in args.ranks]
                mlabel = f"LoRA r={args.lora_r}" if method == "lora" else "full"
                print(f"| {mlabel} | {cname} | {r['t_step_1']:.3f} | {r['gradient_bytes'] / 1e6:.0f} | "
                      + " | ".join(cells) + " |")
        print()
    result["projection"] = proj

    # The guide: LoRA, 256 cards, a compression cutting 90% of the traffic: E 0.89 against 0.72 without.
    guide = {}
    print("### The guide's figure (LoRA, 256 cards: 0.89 with a compression cutting 90% of the traffic, 0.72 "
          "without)\n")
    print(f"LoRA r={args.lora_r}, N = 256, the profile above. Cells: E(256) hierarchical (flat ring), and the MB a "
          f"rank sends a step.\n")
    variants = [("none", COMPRESSIONS["none"]), ("topk 0.1", COMPRESSIONS["topk"]),
                ("powersgd 4", COMPRESSIONS["powersgd"]),
                ("all-reduce of 10% (hypothetical)", {"kind": "allreduce_fraction", "ratio": 0.1})]
    print("| model | " + " | ".join(v[0] for v in variants) + " | E(256)=0.72 without compression needs |")
    print("|---|" + "---|" * (len(variants) + 1))
    for name in args.models:
        m = MODELS[name]
        g = {}
        for cname, comp in variants:
            r = project_one(m, "lora", comp, prof, args, [256])["N"][256]
            g[cname] = {"E": r["hierarchical"]["E"], "E_flat": r["flat"]["E"], "wire_bytes": r["hierarchical"]["wire_bytes"]}

        def e_tokens(tokens, m=m):
            a = argparse.Namespace(**dict(vars(args), tokens_per_rank=tokens))
            return project_one(m, "lora", COMPRESSIONS["none"], prof, a, [256])["N"][256]["hierarchical"]["E"]

        def e_net(gbit, m=m):
            a = argparse.Namespace(**dict(vars(args), inter_gbit=gbit))
            return project_one(m, "lora", COMPRESSIONS["none"], cluster_profile(a), args, [256])["N"][256]["hierarchical"]["E"]

        need = []
        if e_tokens(args.tokens_per_rank) > 0.72:
            g["tokens_per_rank_for_E_0.72"] = solve(1, args.tokens_per_rank, e_tokens, 0.72)
            g["inter_gbit_for_E_0.72"] = solve(0.001, args.inter_gbit, e_net, 0.72)
            need = [f"{g['tokens_per_rank_for_E_0.72']:.0f} tokens a rank, or {g['inter_gbit_for_E_0.72']:.2g} Gb/s a node"]
        guide[name] = g
        print(f"| {name} | " + " | ".join(f"{g[c]['E']:.3f} ({g[c]['E_flat']:.3f}), {g[c]['wire_bytes'] / 1e6:.0f} MB"
                                         for c, _ in variants) + f" | {need[0] if need else '-'} |")
    result["guide_comparison"] = guide
    print()
    # Where the model does give 0.72 without compression (fewer tokens a rank, or a slower network):
    # what the compressions give there.
    print("In the settings where the model gives E(256) = 0.72 without compression (hierarchical):\n")
    print("| model | setting | " + " | ".join(v[0] for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for name in args.models:
        g = guide[name]
        if "tokens_per_rank_for_E_0.72" not in g:
            continue
        m = MODELS[name]
        tok = max(1, round(g["tokens_per_rank_for_E_0.72"]))
        gbit = g["inter_gbit_for_E_0.72"]
        for label, a in [(f"{tok} tokens a rank", argparse.Namespace(**dict(vars(args), tokens_per_rank=tok))),
                         (f"{gbit:.2g} Gb/s a node", argparse.Namespace(**dict(vars(args), inter_gbit=gbit)))]:
            pr = cluster_profile(a)
            es = {c: project_one(m, "lora", comp, pr, a, [256])["N"][256]["hierarchical"]["E"] for c, comp in variants}
            g.setdefault("at_E_0.72", {})[label] = es
            print(f"| {name} | {label} | " + " | ".join(f"{es[c]:.2f}" for c, _ in variants) + " |")
    print()

    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
