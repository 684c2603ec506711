#!/usr/bin/env python3
"""Kill-and-resume on the default model: `loom train` SIGKILLed at random moments (and once inside a
checkpoint write, LOOM_FAILPOINTS=crash@checkpoint_write) and resumed with --resume until done gives
the same per-step losses, eval losses and adapter bytes as a run never stopped; with the checkpoint's
size and write time and the overhead of checkpoint_interval 50 against none.

Usage: python3 bench/bench_resume.py [--loom build/loom] [-t 2] [--steps 60] [--kills 4]
           [--kill-interval 10] [--seed N] [--config configs/main_job.yaml]

Runs (all from the README's main job, configs/main_job.yaml: SmolLM2-135M Q4_1, LoRA r=16, 4 rows of
104 tokens a step, `steps` set to --steps):
  A  uninterrupted, no checkpoints                 (the reference, and the overhead baseline)
  C  uninterrupted, checkpoint_interval 50         (the overhead)
  B  checkpoint_interval --kill-interval, SIGKILLed after random delays --kills times (one of them
     by the failpoint inside a checkpoint write), `--resume` until it exits 0
Overhead: C's wall time against A's, and, less noisy on a shared machine, the checkpoint write time
(from C's log records) against the training time of the 50 steps it covers.
Results: a table on stdout and bench/results/resume-<date>.json. Exit 1 when B differs from A.
"""
import argparse
import datetime
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cmd(args, out, extra_sets, resume=False):
    sets = [f"steps={args.steps}", f"threads={args.threads}", f"output_dir={out}/adapter",
            f"metrics_file={out}/metrics.jsonl", f"log_file={out}/log.jsonl", "log_interval=1000"] + extra_sets
    cmd = [args.loom, "train", args.config]
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    return cmd


def run_once(args, out, extra_sets):
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    p = subprocess.run(train_cmd(args, out, extra_sets), cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"{out}: loom train exited {p.returncode}:\n{p.stderr[-2000:]}")
    return wall


def kill_and_resume(args, out, rng):
    """Starts with --resume until exit 0; SIGKILLs the first --kills starts after a random delay."""
    os.makedirs(out, exist_ok=True)
    sets = [f"checkpoint_interval={args.kill_interval}", "keep_checkpoints=2"]
    starts, kills, crashes = 0, 0, 0
    crash_start = rng.randrange(args.kills) if args.kills > 0 else -1
    t0 = time.time()
    with open(f"{out}/stderr.log", "a") as err:
        while True:
            starts += 1
            if starts > args.kills + 20:
                sys.exit(f"{out}: not done after {starts - 1} starts")
            env = dict(os.environ)
            kill_this = starts <= args.kills
            if kill_this and starts - 1 == crash_start:
                env["LOOM_FAILPOINTS"] = "crash@checkpoint_write"
            p = subprocess.Popen(train_cmd(args, out, sets, resume=True), cwd=ROOT, env=env, stdout=err,
                                 stderr=err)
            if kill_this and "LOOM_FAILPOINTS" not in env:
                # Past the model load, anywhere in the steps or checkpoint writes of this start.
                delay = rng.uniform(args.min_delay, args.max_delay)
                try:
                    p.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    p.send_signal(signal.SIGKILL)
                    kills += 1
            rc = p.wait()
            if rc == -signal.SIGKILL and "LOOM_FAILPOINTS" in env:
                crashes += 1
            elif rc == 0:
                break
            elif rc != -signal.SIGKILL:
                sys.exit(f"{out}: start {starts} exited {rc} (see {out}/stderr.log)")
    return {"starts": starts, "sigkills": kills, "crashes_in_checkpoint_write": crashes,
            "wall_s": time.time() - t0}


def metrics(out):
    steps, evals = {}, {}
    with open(f"{out}/metrics.jsonl") as f:
        for line in f:
            j = json.loads(line)
            if "eval_loss" in j:
                evals[j["step"]] = j["eval_loss"]
            elif "loss" in j:
                steps[j["step"]] = (j["loss"], j.get("grad_norm"), j.get("lr"), j.get("step_seconds"))
    return steps, evals


def adapter_digest(out):
    h = hashlib.sha256()
    d = f"{out}/adapter"
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def checkpoint_records(out):
    recs = []
    with open(f"{out}/log.jsonl") as f:
        for line in f:
            j = json.loads(line)
            if j.get("event", {}).get("action") == "checkpoint" and "checkpoint" in j.get("loom", {}):
                c = j["loom"]["checkpoint"]
                if "seconds" in c:
                    recs.append(c)
    return recs


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "loom"))
    ap.add_argument("--config", default="configs/main_job.yaml")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--kill-interval", type=int, default=10, help="checkpoint_interval of the killed run")
    ap.add_argument("--min-delay", type=float, default=3.0, help="seconds after a start before a kill, at least")
    ap.add_argument("--max-delay", type=float, default=45.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    args = ap.parse_args()
    args.loom = os.path.abspath(args.loom)
    if not os.path.exists(os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")):
        sys.exit("models/SmolLM2-135M-Instruct.Q4_1.gguf is missing: run scripts/fetch_model")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="loom_bench_resume_")
    print(f"seed {seed}; runs in {tmp}; {args.steps} steps at {args.threads} threads", flush=True)

    wall_a = run_once(args, f"{tmp}/A", [])
    print(f"A (no checkpoints): {wall_a:.1f} s", flush=True)
    wall_c = run_once(args, f"{tmp}/C", ["checkpoint_interval=50"])
    print(f"C (checkpoint_interval 50): {wall_c:.1f} s", flush=True)
    b = kill_and_resume(args, f"{tmp}/B", rng)
    print(f"B (killed and resumed): {b['starts']} starts, {b['sigkills']} SIGKILLs, "
          f"{b['crashes_in_checkpoint_write']} inside a checkpoint write, {b['wall_s']:.1f} s", flush=True)

    steps_a, evals_a = metrics(f"{tmp}/A")
    steps_b, evals_b = metrics(f"{tmp}/B")
    losses_same = [v[:3] for _, v in sorted(steps_a.items())] == [v[:3] for _, v in sorted(steps_b.items())]
    evals_same = evals_a == evals_b
    digest_a, digest_b = adapter_digest(f"{tmp}/A"), adapter_digest(f"{tmp}/B")
    same = losses_same and evals_same and digest_a == digest_b and len(steps_a) == args.steps

    recs = checkpoint_records(f"{tmp}/C")
    ck_dir = os.path.join(tmp, "C", "adapter", "checkpoints")
    cks = sorted(n for n in os.listdir(ck_dir) if n.startswith("step-")) if os.path.isdir(ck_dir) else []
    ck_bytes = folder_bytes(os.path.join(ck_dir, cks[-1])) if cks else 0
    write_s = [r["seconds"] for r in recs]
    steps_c, _ = metrics(f"{tmp}/C")
    step_s = [v[3] for k, v in sorted(steps_c.items()) if k > 1 and v[3] is not None]
    per_50 = 50 * (sum(step_s) / len(step_s)) if step_s else float("nan")
    ck_overhead = (sum(write_s) / len(write_s)) / per_50 if write_s and step_s else float("nan")

    print()
    print(f"| figure | value |")
    print(f"|---|---|")
    print(f"| per-step losses (loss, grad_norm, lr) B = A | {losses_same} ({len(steps_b)} steps) |")
    print(f"| eval losses B = A | {evals_same} ({len(evals_b)}) |")
    print(f"| adapter sha256 B = A | {digest_a == digest_b} ({digest_a[:16]}) |")
    print(f"| checkpoint size | {ck_bytes / 2**20:.2f} MiB ({ck_bytes} bytes) |")
    print(f"| checkpoint write time | {', '.join(f'{s * 1000:.0f} ms' for s in write_s) or '-'} |")
    print(f"| 50 steps of training | {per_50:.1f} s |")
    print(f"| overhead of checkpoint_interval 50 (write time / 50 steps) | {100 * ck_overhead:.3f}% |")
    print(f"| wall time A (none) / C (interval 50) | {wall_a:.1f} s / {wall_c:.1f} s "
          f"({100 * (wall_c - wall_a) / wall_a:+.2f}%, machine noise included) |")

    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "seed": seed, "steps": args.steps,
              "threads": args.threads, "identical": same, "losses_same": losses_same, "evals_same": evals_same,
              "adapter_sha256": {"A": digest_a, "B": digest_b}, "killed_run": b,
              "checkpoint_bytes": ck_bytes, "checkpoint_write_s": write_s, "train_s_per_50_steps": per_50,
              "checkpoint_overhead_fraction": ck_overhead, "wall_s": {"A": wall_a, "C": wall_c}}
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", f"resume-{datetime.date.today()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten {path}")
    if not args.keep:
        subprocess.run(["rm", "-rf", tmp])
    if not same:
        print("DIFFERENT: the killed and resumed run does not match the uninterrupted one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
