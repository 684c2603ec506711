#!/usr/bin/env python3
"""QLoRA memory table: LoRA training with quantize_base none (the bf16 base as
stored), q8_0, q4_0 and nf4, on one model, one case after another.

For every quantize_base value, runs `loom train` (LoRA r=8 on all seven
modules, dropout 0, 1 row a step, --steps steps at --seq-len, --threads threads)
and reports:
  weights MiB    loom's own accounting (the `memory` event of --log-format json):
                 the frozen weights resident ("weights": the quantized layer
                 matrices + the embedding as stored) and their prepared copies
                 ("weights_prepared": the matmul panels), and the backward's
                 transposed copies ("weights_backward");
  peak RSS MiB   of the loom process (wait4's ru_maxrss);
  loss           of each step, and tokens/s of the steps after the first.

Models: a random-weight Llama-3.2-1B shape as a bf16 HF folder,
  .venv-ref/bin/python scripts/make_random_model.py --shape llama-3.2-1b --format hf --dtype bf16
and the default model's bf16 form (models/variants/SmolLM2-135M-Instruct.BF16.gguf,
the same weights as the Q4_1 file expanded by llama.cpp) for the losses.

Usage: python3 bench/bench_qlora.py [--loom build/loom] [--model PATH] [--seq-len 512]
                                    [--quant none,q8_0,q4_0,nf4] [--steps 4] [-t 2] [--backward auto]
Results: a table on stdout and bench/results/qlora-<date>-<model>.{json,md}.
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
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIB = 1024.0 * 1024.0


def config_text(model, data, seq_len, steps, threads, quant, out_dir, metrics, backward="auto"):
    return (f"model: {model}\ndata:\n  train: {data}\n  format: text\n  seq_len: {seq_len}\n"
            f"lora:\n  r: 8\n  alpha: 16\n  dropout: 0.0\n  target_modules: [{', '.join(TARGETS)}]\n"
            f"optim:\n  lr: 1e-4\nbatch_size: 1\nsteps: {steps}\nthreads: {threads}\nseed: 1\n"
            f"quantize_base: {quant}\nbackward: {backward}\n"
            f"metrics_file: {metrics}\noutput_dir: {out_dir}\noverwrite: true\n")


def run_case(a, tmp, data, quant):
    metrics = os.path.join(tmp, f"metrics-{quant}.jsonl")
    cfg = os.path.join(tmp, f"{quant}.yaml")
    with open(cfg, "w") as f:
        f.write(config_text(a.model, data, a.seq_len, a.steps, a.threads, quant, os.path.join(tmp, "out"), metrics,
                            a.backward))
    rc, _, err, peak, wall = run_measured([a.loom, "train", cfg, "--log-format", "json"])
    run = {"model": a.model, "quantize_base": quant, "backward": a.backward, "seq_len": a.seq_len, "rc": rc, "peak_rss_mib": peak,
           "wall_s": wall}
    mem = memory_event(err)
    if mem:
        for k in ("weights", "weights_prepared", "weights_backward", "activations"):
            run[k + "_mib"] = mem["arenas"].get(k, 0) / MIB
    if rc == 0 and os.path.exists(metrics):
        steps = [json.loads(l) for l in open(metrics) if '"loss"' in l]
        run["losses"] = [s["loss"] for s in steps]
        run["step_seconds"] = [s["step_seconds"] for s in steps]
        run["tokens_per_s"] = steady_tokens_per_s(run["step_seconds"], a.seq_len)
    else:
        run["error"] = err[-2000:]
    return run


def table(runs):
    lines = ["| quantize_base | weights MiB | prepared MiB | backward MiB | peak RSS MiB | vs none | losses | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    base = next((r["peak_rss_mib"] for r in runs if r["quantize_base"] == "none" and r["rc"] == 0), None)
    for r in runs:
        if r["rc"] != 0:
            lines.append(f"| {r['quantize_base']} | failed (rc {r['rc']}) | | | {r['peak_rss_mib']:.0f} | | | |")
            continue
        vs = f"{100 * (r['peak_rss_mib'] / base - 1):+.0f}%" if base else ""
        losses = " ".join(f"{x:.4f}" for x in r.get("losses", []))
        lines.append(f"| {r['quantize_base']} | {r.get('weights_mib', 0):.0f} | {r.get('weights_prepared_mib', 0):.0f} | "
                     f"{r.get('weights_backward_mib', 0):.0f} | {r['peak_rss_mib']:.0f} | {vs} | {losses} | "
                     f"{r.get('tokens_per_s', 0):.0f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "loom"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "random-llama-3.2-1b-bf16"))
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--quant", default="none,q8_0,q4_0,nf4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--backward", default="auto", help="backward: auto|exact|f16|bf16|int8 (exact keeps no W^T copies)")
    a = ap.parse_args()
    if a.threads > 2:
        sys.exit("at most 2 threads on the shared machine")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "train.jsonl")
        make_data(data, 16, a.seq_len)
        for q in a.quant.split(","):
            print(f"running quantize_base {q} ...", file=sys.stderr, flush=True)
            runs.append(run_case(a, tmp, data, q))
            if runs[-1]["rc"] != 0:
                print(runs[-1].get("error", ""), file=sys.stderr)
    md = table(runs)
    print(md)
    out = os.path.join(ROOT, "bench", "results")
    os.makedirs(out, exist_ok=True)
    stem = f"qlora-{datetime.date.today().isoformat()}-{os.path.basename(a.model.rstrip('/'))}-{a.backward}"
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(runs, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(f"{' '.join(sys.argv)}\n\n{md}\n")


if __name__ == "__main__":
    main()
