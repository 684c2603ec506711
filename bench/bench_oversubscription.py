#!/usr/bin/env python3
"""loom's speed on a busy machine: prompt (pp), generation (tg) and LoRA training tokens/s
with 0, 1 and 2 competing busy processes (`python3 -c 'while True: pass'`, pinned to nothing),
next to llama.cpp's llama-bench under the same load.

Usage: python3 bench/bench_oversubscription.py [--loom build/loom] [--baseline OLD_LOOM] [-t 2]
           [--loads 0,1,2] [-p 128] [-n 32] [-r 2] [--train-steps 4] [-m MODEL]

- pp/tg: `loom bench -m MODEL -t T -p P -n N -r R --json` and
  `third_party/llama.cpp/bin/llama-bench -m MODEL -t T -p P -n N -r R -o json` (column `-` when
  scripts/build_llamacpp has not built it yet: run this again then).
- train: `loom train configs/main_job.yaml` (the README's main job: SmolLM2-135M, LoRA r=16, 4 rows
  of 104 tokens a step) for --train-steps steps; tokens/s = input tokens per second over the steps
  after the first (from metrics_file).
- --baseline: another loom binary (e.g. one built before a change) measured the same way, as an
  extra column.
The busy processes start before and stop after each load level's runs. Results: a table on stdout
and bench/results/oversub-<date>-t<T>.json.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        return None, e.stdout or "", e.stderr or "", time.time() - t0


def loom_bench(loom, a):
    rc, out, err, _ = run([loom, "bench", "-m", a.model, "-t", str(a.threads), "-p", str(a.n_prompt),
                           "-n", str(a.n_gen), "-r", str(a.reps), "--json"], a.timeout)
    if rc != 0:
        return {"error": f"rc={rc}: {err.strip()[-200:]}"}
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            j = json.loads(line)
            return {"pp": j.get("pp_tokens_per_s"), "tg": j.get("tg_tokens_per_s")}
    return {"error": "no JSON line"}


def llama_bench(binary, a):
    if not os.access(binary, os.X_OK):
        return {"error": f"{binary} missing (scripts/build_llamacpp)"}
    rc, out, err, _ = run([binary, "-m", a.model, "-t", str(a.threads), "-p", str(a.n_prompt), "-n",
                           str(a.n_gen), "-r", str(a.reps), "-o", "json"], a.timeout)
    if rc != 0:
        return {"error": f"rc={rc}: {err.strip()[-200:]}"}
    res = {}
    for row in json.loads(out):
        key = "pp" if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0 else "tg"
        res[key] = row.get("avg_ts")
    return res


def loom_train(loom, a, tmp):
    run_dir = tempfile.mkdtemp(dir=tmp)  # a fresh output_dir: no overwrite question
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cmd = [loom, "train", os.path.join(ROOT, "configs/main_job.yaml"), "--set", f"steps={a.train_steps}",
           "--set", f"metrics_file={metrics}", "--set", f"output_dir={os.path.join(run_dir, 'adapter')}",
           "--set", "eval_interval=0", "--set", "eval_at_start=false", "-t", str(a.threads)]
    rc, out, err, _ = run(cmd, a.timeout)
    if not os.path.exists(metrics):
        return {"error": f"rc={rc}: {err.strip()[-200:]}"}
    steps = [json.loads(l) for l in open(metrics) if '"step"' in l and '"loss"' in l]
    if len(steps) < 2:
        return {"error": f"rc={rc}: {len(steps)} steps logged"}
    tokens = steps[-1]["input_tokens"] - steps[0]["input_tokens"]
    secs = steps[-1]["elapsed_seconds"] - steps[0]["elapsed_seconds"]
    return {"train": tokens / secs if secs > 0 else None}


def measure(label, fn):
    t0 = time.time()
    r = fn()
    print(f"  {label}: {r} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return r


def fmt(v):
    return "-" if v is None else f"{v:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("--baseline", help="another loom binary for an extra column")
    ap.add_argument("--llama-bench", default=os.path.join(ROOT, "third_party/llama.cpp/bin/llama-bench"))
    ap.add_argument("-m", "--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--loads", default="0,1,2", help="numbers of busy processes")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run")
    a = ap.parse_args()
    loads = [int(x) for x in a.loads.split(",")]
    sides = [("loom", a.loom)] + ([("baseline", a.baseline)] if a.baseline else [])
    results = {"threads": a.threads, "n_prompt": a.n_prompt, "n_gen": a.n_gen, "reps": a.reps,
               "train_steps": a.train_steps, "model": a.model, "nproc": os.cpu_count(), "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in loads:
            print(f"{n} busy process(es)", file=sys.stderr, flush=True)
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
            try:
                time.sleep(1.0)
                level = {"busy": n}
                for name, binary in sides:
                    level[name] = measure(f"{name} bench", lambda: loom_bench(binary, a))
                    level[name].update(measure(f"{name} train", lambda: loom_train(binary, a, tmp)))
                level["llama.cpp"] = measure("llama-bench", lambda: llama_bench(a.llama_bench, a))
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            results["levels"].append(level)
    names = [s[0] for s in sides] + ["llama.cpp"]
    print(f"\n{a.threads} threads, {os.cpu_count()} CPUs; pp{a.n_prompt} / tg{a.n_gen} tokens/s "
          f"(-r {a.reps}); train = main job LoRA tokens/s over steps 2-{a.train_steps}\n")
    head = ["busy processes"]
    for nm in names:
        head += [f"{nm} pp", f"{nm} tg"] + ([f"{nm} train"] if nm != "llama.cpp" else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for lv in results["levels"]:
        row = [str(lv["busy"])]
        for nm in names:
            r = lv[nm]
            row += [fmt(r.get("pp")), fmt(r.get("tg"))] + ([fmt(r.get("train"))] if nm != "llama.cpp" else [])
        print("| " + " | ".join(row) + " |")
    for lv in results["levels"]:
        for nm in names:
            if "error" in lv[nm]:
                print(f"note: {lv['busy']} busy, {nm}: {lv[nm]['error']}")
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    out = os.path.join(ROOT, "bench/results", f"oversub-{datetime.date.today()}-t{a.threads}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
