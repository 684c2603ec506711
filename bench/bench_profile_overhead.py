#!/usr/bin/env python3
"""What recording a profile costs (docs/profiling.md, issue 15: under 3% of step time).

Runs each job with and without --profile, alternating (A B A B ...) so drift on a
shared machine hits both alike, and reports the median of each and the overhead:
  - train: the main job (configs/main_job.yaml) for --steps steps, the mean step_seconds
    of the steps after the first two (metrics_file), evaluation off;
  - bench: `loom bench` prompt processing (pp) and generation (tg) tokens/s.

  python3 bench/bench_profile_overhead.py --repeats 5 --threads 2 --out bench/results/profile_overhead.json

Needs build/loom and the default model (scripts/setup).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOM = os.path.join(ROOT, "build", "loom")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def train_step_seconds(args, work, profile):
    metrics = os.path.join(work, "m.jsonl")
    cmd = [LOOM, "train", os.path.join(ROOT, "configs", "main_job.yaml"), "--set", f"steps={args.steps}",
           "--set", "eval_interval=0", "--set", f"threads={args.threads}", "--set", f"metrics_file={metrics}",
           "--set", f"output_dir={os.path.join(work, 'out')}", "--overwrite"]
    if profile:
        cmd += ["--profile", os.path.join(work, "trace.json")]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = [json.loads(l) for l in open(metrics) if '"step_seconds"' in l]
    timed = [s["step_seconds"] for s in steps[2:]]
    return sum(timed) / len(timed)


def bench_tokens_per_s(args, work, profile):
    cmd = [LOOM, "bench", "-m", MODEL, "-p", "256", "-n", "64", "-r", "3", "-t", str(args.threads), "--json"]
    if profile:
        cmd += ["--profile", os.path.join(work, "bench_trace.json")]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["pp_tokens_per_s"], r["tg_tokens_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="JSON file for the figures")
    args = p.parse_args()
    if not os.path.exists(LOOM) or not os.path.exists(MODEL):
        sys.exit("needs build/loom and the default model: run scripts/setup first")
    work = tempfile.mkdtemp(prefix="loom-prof-overhead-")
    runs = {"train_off": [], "train_on": [], "pp_off": [], "pp_on": [], "tg_off": [], "tg_on": []}
    for r in range(args.repeats):
        for on in (False, True):
            tag = "on" if on else "off"
            runs[f"train_{tag}"].append(train_step_seconds(args, work, on))
            pp, tg = bench_tokens_per_s(args, work, on)
            runs[f"pp_{tag}"].append(pp)
            runs[f"tg_{tag}"].append(tg)
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.4g}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    summary = {
        "threads": args.threads, "steps": args.steps, "repeats": args.repeats, "median": med, "runs": runs,
        # Overheads: more time a step, fewer tokens a second.
        "train_overhead": med["train_on"] / med["train_off"] - 1,
        "pp_overhead": med["pp_off"] / med["pp_on"] - 1,
        "tg_overhead": med["tg_off"] / med["tg_on"] - 1,
    }
    print(f"\n{args.threads} threads, median of {args.repeats}, alternating without/with --profile")
    print("| job | without | with --profile | overhead |\n|---|---|---|---|")
    print(f"| train step (main job) | {med['train_off'] * 1e3:.1f} ms | {med['train_on'] * 1e3:.1f} ms | "
          f"{100 * summary['train_overhead']:+.1f}% |")
    print(f"| bench pp256 | {med['pp_off']:.1f} t/s | {med['pp_on']:.1f} t/s | {100 * summary['pp_overhead']:+.1f}% |")
    print(f"| bench tg64 | {med['tg_off']:.1f} t/s | {med['tg_on']:.1f} t/s | {100 * summary['tg_overhead']:+.1f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
