#!/usr/bin/env python3
"""LoRA fine-tuning speed and memory: loom against PEFT + transformers (PyTorch CPU).

Both sides train the same LoRA (r=8, alpha=16, dropout 0, on q,k,v,o,gate,up,down) of the same model
(SmolLM2-135M-Instruct; loom reads the Q4_1 GGUF as it is, transformers dequantizes the same GGUF to
f32) on the same rows (every row one sample of exactly --seq-len tokens, all tokens in the loss),
--batch rows per optimizer step, AdamW, the same thread count. Reported: training tokens/s over the
steps after the first (warm-up), and peak resident memory of the whole process.

Usage: python3 bench/bench_train_vs_peft.py [-t 2] [--seq-len 512] [--batch 2] [--steps 6]
                                            [--loom build/loom] [--python /opt/loom-ref/bin/python]
                                            [--backward f16,int8] [--set KEY=VALUE ...] [--no-peft] [--no-loom]
                                            [--peft-precision f32,bf16]
The PEFT side needs a Python with torch, transformers, peft and gguf (scripts/fixtures/requirements.txt).
Results: a table on stdout and bench/results/train-<date>-t<T>.json.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import make_data, run_measured, steady_tokens_per_s  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

PEFT_SIDE = r'''
import json, sys, time
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
d, f = cfg["model_dir"], cfg["model_file"]
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=cfg["r"], lora_alpha=cfg["alpha"], lora_dropout=0.0,
                                         target_modules=cfg["targets"], task_type="CAUSAL_LM"))
S, B = cfg["seq_len"], cfg["batch"]
rows = []
for line in open(cfg["data"]):
    ids = tok(json.loads(line)["text"])["input_ids"][:S]
    if len(ids) == S:
        rows.append(ids)
assert len(rows) >= B * cfg["steps"], "not enough rows"
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
model.train()
times, losses = [], []
for s in range(cfg["steps"]):
    x = torch.tensor(rows[s * B:(s + 1) * B])
    t0 = time.perf_counter()
    # bf16: what transformers' Trainer does on CPU with bf16=True (autocast; f32 master weights)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["precision"] == "bf16"):
        out = model(input_ids=x, labels=x)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
    losses.append(out.loss.item())
print(json.dumps({"step_seconds": times, "losses": losses, "torch": torch.__version__,
                  "torch_threads": torch.get_num_threads()}))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("-r", "--rank", type=int, default=8)
    ap.add_argument("-m", "--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("--python", default="/opt/loom-ref/bin/python")
    ap.add_argument("--backward", default="f16,int8", help="loom backward modes to run (exact,f16,int8)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra loom config setting for every loom run (loom train --set), e.g. precision=bf16")
    ap.add_argument("--peft-precision", default="f32,bf16",
                    help="PEFT runs: f32 and/or bf16 (torch.autocast on CPU, as Trainer(bf16=True)), comma-separated")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--no-loom", action="store_true")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="loom_bench_train_")
    data = os.path.join(tmp, "train.jsonl")
    make_data(data, a.batch * a.steps + 8, a.seq_len)
    tokens_per_step = a.batch * a.seq_len
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    results = {"threads": a.threads, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps, "r": a.rank,
               "model": a.model, "date": datetime.datetime.now().isoformat(timespec="seconds"), "runs": []}

    if not a.no_loom:
        for mode in [m for m in a.backward.split(",") if m]:
            metrics = os.path.join(tmp, f"metrics-{mode}.jsonl")
            cfg = os.path.join(tmp, f"loom-{mode}.yaml")
            with open(cfg, "w") as f:
                f.write(f"model: {a.model}\ndata:\n  train: {data}\n  format: text\n  seq_len: {a.seq_len}\n"
                        f"lora:\n  r: {a.rank}\n  alpha: {2 * a.rank}\n  dropout: 0.0\n"
                        f"  target_modules: [{', '.join(TARGETS)}]\noptim:\n  lr: 1e-4\n"
                        f"batch_size: {a.batch}\nsteps: {a.steps}\nthreads: {a.threads}\n"
                        f"backward: {mode}\nmetrics_file: {metrics}\noutput_dir: {os.path.join(tmp, 'out-' + mode)}\n")
            sets = [arg for kv in a.set for arg in ("--set", kv)]
            rc, out, err, peak, wall = run_measured([a.loom, "train", cfg] + sets, env)
            run = {"side": f"loom (Q4_1 GGUF, backward {mode}{''.join(' ' + kv for kv in a.set)})", "rc": rc, "peak_rss_mib": peak, "wall_s": wall}
            if rc == 0:
                steps = [json.loads(l) for l in open(metrics) if '"loss"' in l]
                run["step_seconds"] = [s["step_seconds"] for s in steps]
                run["losses"] = [s["loss"] for s in steps]
                run["tokens_per_s"] = steady_tokens_per_s(run["step_seconds"], tokens_per_step)
            else:
                run["error"] = err[-2000:]
            results["runs"].append(run)
            print(f"{run['side']}: {run.get('tokens_per_s', float('nan')):.1f} tok/s, peak {peak:.0f} MiB",
                  file=sys.stderr)

    for precision in ([] if a.no_peft else [p for p in a.peft_precision.split(",") if p]):
        cfg = {"threads": a.threads, "model_dir": os.path.dirname(os.path.abspath(a.model)),
               "model_file": os.path.basename(a.model), "r": a.rank, "alpha": 2 * a.rank, "targets": TARGETS,
               "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps, "data": data, "precision": precision}
        rc, out, err, peak, wall = run_measured([a.python, "-c", PEFT_SIDE, json.dumps(cfg)], env)
        side = "f32" if precision == "f32" else "bf16 autocast"
        run = {"side": f"PEFT + transformers (PyTorch CPU, {side})", "rc": rc, "wall_s": wall, "peak_rss_mib": peak}
        if rc == 0:
            run.update(json.loads([l for l in out.splitlines() if l.startswith("{")][-1]))
            run["tokens_per_s"] = steady_tokens_per_s(run["step_seconds"], tokens_per_step)
        else:
            run["error"] = err[-2000:]
        results["runs"].append(run)
        print(f"{run['side']}: {run.get('tokens_per_s', float('nan')):.1f} tok/s, "
              f"peak {run.get('peak_rss_mib', float('nan')):.0f} MiB", file=sys.stderr)

    # ratios against PEFT's fastest run (its best setting)
    peft_runs = [r for r in results["runs"] if r["side"].startswith("PEFT") and "tokens_per_s" in r]
    peft = max(peft_runs, key=lambda r: r["tokens_per_s"], default=None)
    print(f"\nLoRA r={a.rank} on 7 modules, seq_len {a.seq_len}, {a.batch} rows/step, {a.threads} threads, "
          f"{a.steps} steps (first excluded)\n")
    print("| run | tokens/s | peak RSS MiB | tokens/s vs PEFT's fastest | memory vs that run |")
    print("|---|---|---|---|---|")
    for r in results["runs"]:
        tps, mem = r.get("tokens_per_s"), r.get("peak_rss_mib")
        vs = f"{tps / peft['tokens_per_s']:.2f}x" if peft and tps else "-"
        mvs = f"{mem / peft['peak_rss_mib']:.2f}x" if peft and mem and r.get("rc") == 0 else "-"
        print(f"| {r['side']} | {tps:.1f} | {mem:.0f} | {vs} | {mvs} |" if tps else f"| {r['side']} | failed | - | - | - |")
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    out = os.path.join(ROOT, "bench/results", f"train-{datetime.date.today()}-t{a.threads}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
