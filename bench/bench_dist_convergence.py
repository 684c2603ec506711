#!/usr/bin/env python3
"""Does gradient compression converge as the uncompressed all-reduce? (docs/training.md, Scale-out)

Runs the main job (configs/main_job.yaml: SmolLM2-135M-Instruct, LoRA r=16) data-parallel under
mpirun for each compression and seed, and reports per compression the mean over seeds of
  - the training loss of the last 20 steps,
  - the eval loss at the last step,
  - the bytes on the wire per step (rank 0, from metrics_file),
with the spread over seeds, and each compression's difference to `none` seed by seed (paired).

  python3 bench/bench_dist_convergence.py --ranks 2 --seeds 0 1 2 3 --steps 200 --out bench/results/dist_convergence.json

Needs build/loom and the default model (scripts/setup). Each run is ~2.5 min on 2 cores.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, spec, seed, work):
    # "topk:plain": top-k with dist.lazy_adam false (the zeros of unsent entries enter AdamW's moments).
    compression, _, variant = spec.partition(":")
    if variant not in ("", "plain"):
        sys.exit(f"unknown variant '{variant}' in '{spec}' (expected NAME or NAME:plain)")
    name = f"{compression}_{variant or 'default'}_s{seed}"
    metrics = os.path.join(work, name + ".jsonl")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.ranks),
           os.path.join(ROOT, "build", "loom"), "train", os.path.join(ROOT, "configs", "main_job.yaml"),
           "--set", f"steps={args.steps}", "--set", f"batch_size={4 // args.ranks}", "--set", "threads=1",
           "--set", f"seed={seed}", "--set", f"dist.compression={compression}",
           "--set", f"dist.ratio={args.ratio}", "--set", f"dist.rank={args.rank}",
           "--set", f"dist.lazy_adam={'false' if variant == 'plain' else 'true'}",
           "--set", f"output_dir={os.path.join(work, name)}", "--set", f"metrics_file={metrics}", "--overwrite"]
    with open(os.path.join(work, name + ".log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    lines = [json.loads(l) for l in open(metrics)]
    losses = [l["loss"] for l in lines if "loss" in l]
    evals = [l["eval_loss"] for l in lines if "eval_loss" in l]
    steps = [l for l in lines if "loss" in l]
    return {"last20": sum(losses[-20:]) / len(losses[-20:]), "eval": evals[-1],
            "wire_bytes": steps[-1].get("wire_bytes", 0),
            "uncompressed_wire_bytes": steps[-1].get("uncompressed_wire_bytes", 0)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compressions", nargs="+", default=["none", "topk", "powersgd"],
                   help="dist.compression values; topk:plain is top-k with dist.lazy_adam: false")
    p.add_argument("--ratio", type=float, default=0.1, help="dist.ratio for topk (0.1: 90%% sparsity)")
    p.add_argument("--rank", type=int, default=4, help="dist.rank for powersgd")
    p.add_argument("--out", help="JSON file for the figures")
    args = p.parse_args()
    if 4 % args.ranks:
        sys.exit("--ranks must divide the main job's 4 rows per step")
    work = tempfile.mkdtemp(prefix="loom-dist-conv-")
    res = {c: {} for c in args.compressions}
    for seed in args.seeds:
        for c in args.compressions:
            res[c][seed] = run(args, c, seed, work)
            print(f"{c:9s} seed {seed}: last-20 loss {res[c][seed]['last20']:.4f}, eval {res[c][seed]['eval']:.4f}, "
                  f"{res[c][seed]['wire_bytes']} B/step", flush=True)
    print(f"\n{args.ranks} ranks, {args.steps} steps, seeds {args.seeds}; mean (stdev) over seeds")
    print("| compression | last-20 train loss | eval loss | vs none, paired (last-20) | bytes/step (uncompressed) |")
    print("|---|---|---|---|---|")
    summary = {}
    for c in args.compressions:
        l20 = [res[c][s]["last20"] for s in args.seeds]
        ev = [res[c][s]["eval"] for s in args.seeds]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
        paired = [res[c][s]["last20"] / res["none"][s]["last20"] - 1 for s in args.seeds] if "none" in res else []
        w = res[c][args.seeds[0]]
        summary[c] = {"last20_mean": statistics.mean(l20), "last20_stdev": sd(l20), "eval_mean": statistics.mean(ev),
                      "eval_stdev": sd(ev), "paired_last20": paired, "wire_bytes": w["wire_bytes"],
                      "uncompressed_wire_bytes": w["uncompressed_wire_bytes"], "runs": res[c]}
        pr = f"{100 * statistics.mean(paired):+.1f}% ({100 * sd(paired):.1f})" if paired else "-"
        print(f"| {c} | {statistics.mean(l20):.4f} ({sd(l20):.4f}) | {statistics.mean(ev):.4f} ({sd(ev):.4f}) | {pr} "
              f"| {w['wire_bytes']} ({w['uncompressed_wire_bytes']}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": args.ranks, "steps": args.steps, "seeds": args.seeds, "ratio": args.ratio,
                       "rank": args.rank, "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
