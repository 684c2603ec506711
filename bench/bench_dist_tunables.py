#!/usr/bin/env python3
"""Data-parallel tunables on this machine: step time and the wait for the all-reduce at the step's end
(docs/training.md, Scale-out, "Tunables (measured)"; results in bench/results/dist_tunables.md).

Each setting runs `mpirun --allow-run-as-root --oversubscribe -np RANKS build/loom train ...` for --steps
steps on the default model, for two jobs:
  full  configs/main_job.yaml --set method=full --set optim.lr=1e-5 --set batch_size=1
        --set data.seq_len=64 --set threads=1          (135M parameters: a 538 MB gradient)
  lora  configs/main_job.yaml --set batch_size=2 --set threads=1
        (LoRA r=16 on all seven targets, seq_len 104: a 19.5 MB gradient; 2 ranks x 2 rows = the
        main job's 4 rows a step)
and reports per setting the median over --repeats runs of each run's median over steps 2..n (step 1
builds the weights) of metrics_file's step_seconds, comm_wait_seconds (the step waiting for the
communication thread after the backward), comm_seconds (the thread busy) and wire_bytes. The runs
go round-robin over the settings (repeat 1 of every setting, then repeat 2, ...; each round in a new
random order), so a neighbour's load or the page cache's writeback after a full run falls on all
settings alike. Before each run the script looks for other compilers and
trainings (`pgrep -f cc1plus`, `pgrep -f "loom train"`) and the 1-minute load average, and with
--wait-quiet waits (up to --max-wait s) until there are none; a run is quiet when there were none
before and none after it (with --wait-quiet a run that was not is run again, --tries times at most);
the table says how many of the runs kept were quiet.

  python3 bench/bench_dist_tunables.py --jobs full lora --repeats 3 --wait-quiet \\
      --out bench/results/dist_tunables.json

A single setting: --only bucket_mb=1 (names as in the table: base, overlap=false, bucket_mb=N,
algorithm=A, compression=C).
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOBS = {
    "full": ["--set", "method=full", "--set", "optim.lr=1e-5", "--set", "batch_size=1", "--set", "data.seq_len=64"],
    "lora": ["--set", "batch_size=2"],
}

# (name, --set overrides); `base` is the default of every key: overlap on, 25 MB buckets, auto, none.
SETTINGS = [
    ("base", []),
    ("overlap=false", ["dist.overlap=false"]),
    ("bucket_mb=1", ["dist.bucket_mb=1"]),
    ("bucket_mb=100", ["dist.bucket_mb=100"]),
    ("bucket_mb=1000", ["dist.bucket_mb=1000"]),
    ("algorithm=ring", ["dist.algorithm=ring"]),
    ("algorithm=tree", ["dist.algorithm=tree"]),
    ("algorithm=rabenseifner", ["dist.algorithm=rabenseifner"]),
    ("algorithm=recursive_doubling", ["dist.algorithm=recursive_doubling"]),
    ("compression=topk", ["dist.compression=topk", "dist.ratio=0.1"]),
    ("compression=powersgd", ["dist.compression=powersgd", "dist.rank=4"]),
]


def others_busy(own_pids=()):
    """Other engineers' compilers and trainings now, and the 1-minute load average."""
    found = []
    for pattern in ("cc1plus", "loom train"):
        p = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        found += [int(x) for x in p.stdout.split() if int(x) not in own_pids and int(x) != os.getpid()]
    with open("/proc/loadavg") as f:
        load1 = float(f.read().split()[0])
    return found, load1


def wait_quiet(max_wait):
    t0 = time.time()
    while True:
        busy, load1 = others_busy()
        if not busy or time.time() - t0 > max_wait:
            return busy, load1
        time.sleep(10)


def loom_cmd(ranks, job, overrides, steps, work, name, threads):
    cmd = []
    if ranks > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)]
    cmd += [os.path.join(ROOT, "build", "loom"), "train", os.path.join(ROOT, "configs", "main_job.yaml")]
    cmd += JOBS[job]
    cmd += ["--set", f"threads={threads}", "--set", f"steps={steps}", "--set", "eval_interval=0",
            "--set", f"output_dir={scratch_dir(name)}", "--set", f"metrics_file={os.path.join(work, name)}.jsonl",
            "--overwrite"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def scratch_dir(name):
    """The run's output folder (a 540 MB model with method full): in tmpfs when there is one, so that
    its writeback does not land on the next run; removed after the run."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"loom-dist-tun-{os.getpid()}-{name}")


def run_one(cmd, out, metrics, log):
    try:
        with open(log, "w") as f:
            subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steps = [json.loads(l) for l in open(metrics)]
    steps = [s for s in steps if "step_seconds" in s][1:]  # step 1 builds the weights
    med = lambda k: statistics.median(s.get(k, 0.0) for s in steps)
    return {"step_seconds": med("step_seconds"), "comm_wait_seconds": med("comm_wait_seconds"),
            "comm_seconds": med("comm_seconds"), "wire_bytes": steps[-1].get("wire_bytes", 0),
            "uncompressed_wire_bytes": steps[-1].get("uncompressed_wire_bytes", 0),
            "per_step": [s["step_seconds"] for s in steps]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--jobs", nargs="+", default=["full", "lora"], choices=list(JOBS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="+", help="setting names to run (default: all)")
    p.add_argument("--wait-quiet", action="store_true", help="wait before each run until no other cc1plus / loom train")
    p.add_argument("--max-wait", type=float, default=1800)
    p.add_argument("--tries", type=int, default=3, help="with --wait-quiet: runs of a setting that was not quiet, at most")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                   help="run the settings in the table's order each round (default: shuffled, --seed)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="JSON file for every run's figures")
    args = p.parse_args()
    settings = [s for s in SETTINGS if not args.only or s[0] in args.only]
    work = tempfile.mkdtemp(prefix="loom-dist-tun-")
    runs = {(j, s[0]): [] for j in args.jobs for s in settings}
    rng = random.Random(args.seed)
    for rep in range(args.repeats):
        for job in args.jobs:
            order = list(settings)
            if args.shuffle:  # a fresh order each round: what runs first (after a full run's writes) varies
                rng.shuffle(order)
            for name, overrides in order:
                for attempt in range(args.tries if args.wait_quiet else 1):
                    busy, load1 = wait_quiet(args.max_wait) if args.wait_quiet else others_busy()
                    tag = f"{job}_{name.replace('=', '_')}_r{rep}_a{attempt}"
                    cmd = loom_cmd(args.ranks, job, overrides, args.steps, work, tag, args.threads)
                    r = run_one(cmd, scratch_dir(tag), os.path.join(work, tag) + ".jsonl", os.path.join(work, tag) + ".log")
                    busy_after, _ = others_busy()
                    busy = busy or busy_after
                    if not busy:
                        break
                r.update({"quiet": not busy, "load1_before": load1, "command": " ".join(cmd)})
                runs[(job, name)].append(r)
                print(f"{job:4s} {name:30s} rep {rep}: step {r['step_seconds']:.3f} s, wait {r['comm_wait_seconds']:.4f} s, "
                      f"comm {r['comm_seconds']:.4f} s, {r['wire_bytes']} B{'' if not busy else ', NOT quiet'}",
                      flush=True)
    print(f"\n{args.ranks} ranks, {args.threads} thread(s) each, {args.steps} steps a run, median of steps 2..{args.steps}, "
          f"then the median over {args.repeats} runs (min-max of the runs' medians in brackets)")
    summary = {}
    for job in args.jobs:
        base = statistics.median(r["step_seconds"] for r in runs[(job, "base")]) if (job, "base") in runs else None
        print(f"\n{job}\n")
        print("| setting | step s | vs base | comm_wait s | comm s | wire MB/step | quiet runs |")
        print("|---|---|---|---|---|---|---|")
        for name, _ in settings:
            rs = runs[(job, name)]
            st = [r["step_seconds"] for r in rs]
            s = statistics.median(st)
            w = statistics.median(r["comm_wait_seconds"] for r in rs)
            c = statistics.median(r["comm_seconds"] for r in rs)
            rel = f"{100 * (s / base - 1):+.0f}%" if base and name != "base" else "-"
            print(f"| {name} | {s:.3f} ({min(st):.3f}-{max(st):.3f}) | {rel} | {w:.4f} | {c:.4f} | "
                  f"{rs[0]['wire_bytes'] / 1e6:.1f} | {sum(r['quiet'] for r in rs)}/{len(rs)} |")
            summary[f"{job}/{name}"] = {"step_seconds": s, "comm_wait_seconds": w, "comm_seconds": c, "runs": rs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": args.ranks, "threads": args.threads, "steps": args.steps, "repeats": args.repeats,
                       "results": summary}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
