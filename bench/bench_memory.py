#!/usr/bin/env python3
"""Gradient checkpointing and bf16 saved activations: activation memory, peak RSS
and step time of LoRA training, the whole curve.

For every model x seq_len x gradient_checkpointing x activation_dtype case, runs
`loom train` (LoRA r=8 on all seven modules, dropout 0, 1 row a step, --steps
steps, --threads threads) and reports:
  activations  loom's own accounting: the memory estimate's activation arena
               (the `memory` event of --log-format json), MiB;
  peak RSS     of the loom process (wait4's ru_maxrss), MiB;
  step s       mean step_seconds of the steps after the first (warm-up).
Each case runs alone, one after another (RAM is shared).

Models: the default model (Q4_1) and a random-weight Llama-3.2-1B shape made by
  .venv-ref/bin/python scripts/make_random_model.py --shape llama-3.2-1b --type q4_0

Usage: python3 bench/bench_memory.py [--loom build/loom] [--models a.gguf,b.gguf] [--seq-lens 2048,4096]
                                     [--ckpt 0,1,2,4] [--dtypes f32,bf16] [--steps 3] [-t 2]
                                     [--only 'MODEL_SUBSTRING:SEQ_LEN'...] [--estimate-only]
--estimate-only runs no step: only loom's activation accounting of every case (seconds each).
Results: a table on stdout and bench/results/memory-<date>-t<T>.{json,md}.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import make_data, memory_record as memory_event, run_measured, steady_tokens_per_s  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = ["models/SmolLM2-135M-Instruct.Q4_1.gguf", "models/random-llama-3.2-1b.Q4_0.gguf"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIB = 1024.0 * 1024.0


def config_text(model, data, seq_len, steps, threads, ckpt, dtype, out_dir, metrics, estimate_only=False):
    # estimate_only: a memory_limit of 1 byte stops the run right after the estimate (exit 1).
    return (("memory_limit: 1\n" if estimate_only else "") +f"model: {model}\ndata:\n  train: {data}\n  format: text\n  seq_len: {seq_len}\n"
            f"lora:\n  r: 8\n  alpha: 16\n  dropout: 0.0\n  target_modules: [{', '.join(TARGETS)}]\n"
            f"optim:\n  lr: 1e-4\nbatch_size: 1\nsteps: {steps}\nthreads: {threads}\n"
            f"gradient_checkpointing: {ckpt}\nactivation_dtype: {dtype}\n"
            f"metrics_file: {metrics}\noutput_dir: {out_dir}\noverwrite: true\n")


def run_case(a, tmp, data, model, seq_len, ckpt, dtype):
    tag = f"{os.path.basename(model)}-{seq_len}-{ckpt}-{dtype}"
    metrics = os.path.join(tmp, f"metrics-{tag}.jsonl")
    cfg = os.path.join(tmp, f"{tag}.yaml")
    with open(cfg, "w") as f:
        f.write(config_text(model, data, seq_len, a.steps, a.threads, ckpt, dtype, os.path.join(tmp, "out"), metrics,
                            a.estimate_only))
    rc, _, err, peak, wall = run_measured([a.loom, "train", cfg, "--log-format", "json"])
    run = {"model": os.path.basename(model), "seq_len": seq_len, "gradient_checkpointing": ckpt,
           "activation_dtype": dtype, "rc": rc, "peak_rss_mib": peak, "wall_s": wall}
    mem = memory_event(err)
    if a.estimate_only:
        run = {k: v for k, v in run.items() if k not in ("rc", "peak_rss_mib", "wall_s")}
    if mem:
        run["activations_mib"] = mem["arenas"]["activations"] / MIB
        run["estimate_mib"] = mem["estimate"] / MIB
    if a.estimate_only:
        pass
    elif rc == 0 and os.path.exists(metrics):
        steps = [json.loads(l) for l in open(metrics) if '"loss"' in l]
        run["step_seconds"] = [s["step_seconds"] for s in steps]
        run["losses"] = [s["loss"] for s in steps]
        rest = run["step_seconds"][1:] or run["step_seconds"]
        run["step_s"] = sum(rest) / len(rest)
        run["tokens_per_s"] = steady_tokens_per_s(run["step_seconds"], seq_len)
    else:
        run["error"] = err[-2000:]
    return run


def estimate_table(runs):
    lines = ["| model | seq_len | checkpointing | act. dtype | activations MiB | vs off, f32 | whole estimate MiB |",
             "|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["seq_len"]): r for r in runs
            if r["gradient_checkpointing"] == 0 and r["activation_dtype"] == "f32" and "activations_mib" in r}
    for r in runs:
        b = base.get((r["model"], r["seq_len"]))
        ck = "off" if r["gradient_checkpointing"] == 0 else str(r["gradient_checkpointing"])
        if "activations_mib" not in r:
            lines.append(f"| {r['model']} | {r['seq_len']} | {ck} | {r['activation_dtype']} | failed | | |")
            continue
        d = f"{100 * (r['activations_mib'] / b['activations_mib'] - 1):+.0f}%" if b else "-"
        lines.append(f"| {r['model']} | {r['seq_len']} | {ck} | {r['activation_dtype']} | {r['activations_mib']:.0f} "
                     f"| {d} | {r['estimate_mib']:.0f} |")
    return "\n".join(lines)


def table(runs):
    lines = ["| model | seq_len | checkpointing | act. dtype | activations MiB | vs off | peak RSS MiB | step s | vs off |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in runs:
        if r["gradient_checkpointing"] == 0 and r["activation_dtype"] == "f32" and "step_s" in r:
            base[(r["model"], r["seq_len"])] = r
    for r in runs:
        b = base.get((r["model"], r["seq_len"]))
        ck = "off" if r["gradient_checkpointing"] == 0 else str(r["gradient_checkpointing"])
        if "step_s" not in r:
            lines.append(f"| {r['model']} | {r['seq_len']} | {ck} | {r['activation_dtype']} | "
                         f"{r.get('activations_mib', float('nan')):.0f} | | failed (rc {r['rc']}) | | |")
            continue
        dact = f"{100 * (r['activations_mib'] / b['activations_mib'] - 1):+.0f}%" if b else "-"
        dt = f"{100 * (r['step_s'] / b['step_s'] - 1):+.0f}%" if b else "-"
        lines.append(f"| {r['model']} | {r['seq_len']} | {ck} | {r['activation_dtype']} | "
                     f"{r['activations_mib']:.0f} | {dact} | {r['peak_rss_mib']:.0f} | {r['step_s']:.1f} | {dt} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--seq-lens", default="2048,4096")
    ap.add_argument("--ckpt", default="0,1,2,4", help="gradient_checkpointing values (0 = off)")
    ap.add_argument("--dtypes", default="f32,bf16", help="activation_dtype values")
    ap.add_argument("--steps", type=int, default=3, help="steps a case (the first is not timed)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--estimate-only", action="store_true",
                    help="only loom's memory estimate of each case (no steps: memory_limit 1 stops the run)")
    ap.add_argument("--only", action="append", default=[],
                    help="run only cases MODEL_SUBSTRING:SEQ_LEN (repeatable), e.g. 1b:4096")
    a = ap.parse_args()
    if a.threads > 2:
        print("note: more than 2 threads on a shared 2-core machine measures contention", file=sys.stderr)

    models = [m if os.path.isabs(m) else os.path.join(ROOT, m) for m in a.models.split(",") if m]
    for m in models:
        if not os.path.exists(m):
            sys.exit(f"error: --models: {m} does not exist (scripts/fetch_model, scripts/make_random_model.py)")
    seq_lens = [int(s) for s in a.seq_lens.split(",") if s]
    tmp = tempfile.mkdtemp(prefix="loom_bench_memory_")
    data = os.path.join(tmp, "train.jsonl")
    make_data(data, a.steps + 4, max(seq_lens))
    results = {"threads": a.threads, "steps": a.steps, "batch": 1, "r": 8,
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "loom": a.loom, "runs": []}
    for model in models:
        for seq_len in seq_lens:
            if a.only and not any(o.split(":")[0] in os.path.basename(model)
                                  and int(o.split(":")[1]) == seq_len for o in a.only):
                continue
            for dtype in [d for d in a.dtypes.split(",") if d]:
                for ckpt in [int(c) for c in a.ckpt.split(",") if c]:
                    run = run_case(a, tmp, data, model, seq_len, ckpt, dtype)
                    results["runs"].append(run)
                    print(f"{run['model']} seq {seq_len} ckpt {ckpt} {dtype}: act "
                          f"{run.get('activations_mib', float('nan')):.0f} MiB, peak {run.get('peak_rss_mib', float('nan')):.0f} MiB, "
                          f"step {run.get('step_s', float('nan')):.1f} s", file=sys.stderr, flush=True)
    if a.estimate_only:
        md = "LoRA r=8 on 7 modules, 1 row a step: loom's memory estimate\n\n" + estimate_table(results["runs"])
    else:
        md = (f"LoRA r=8 on 7 modules, 1 row a step, {a.threads} threads, {a.steps} steps a case (first not timed)\n\n"
              + table(results["runs"]))
    print("\n" + md)
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    kind = "memory-estimate" if a.estimate_only else "memory"
    stem = os.path.join(ROOT, "bench/results", f"{kind}-{datetime.datetime.now():%Y%m%d-%H%M%S}-t{a.threads}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    print(f"\nraw results: {stem}.json")


if __name__ == "__main__":
    main()
