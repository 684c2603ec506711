#!/usr/bin/env python3
"""Pruning quality, size and speed on the default model (issue 13's table).

Source: SmolLM2-135M-Instruct's weights expanded to f32 (`loom quantize --type F32` of the Q4_1 file,
which only dequantizes). Every pruned model is written as F16 GGUF (exact zeros kept). Reported:
perplexity on held-out text and the KL divergence from the source's token distribution (`loom
perplexity`), the file size, and for the structured methods prompt / generation speed (`loom bench`
pp512 / tg128) and the perplexity after a short LoRA recovery fine-tune (r 16 on all seven modules,
--recovery-steps steps of 4 x 256 tokens of other license texts, merged into the pruned model). The
recovery text is close to the eval text, so the same fine-tune of the unpruned source is the baseline
for the recovered models.

Methods: magnitude (per matrix, the Wanda paper's baseline) and Wanda (per row) at 30%, 50% and 2:4;
heads, MLP channels and layers removed at 10% and 25% (heads: the nearest count GQA's equal groups
allow). Eval text: /usr/share/common-licenses/{GPL-3,Apache-2.0,LGPL-3,MPL-2.0}; calibration:
docs/training.md; recovery text: {GPL-2,LGPL-2.1,GFDL-1.3,Artistic,MPL-1.1,BSD} (none in the eval).

Usage: python3 bench/bench_prune.py [--loom build/loom] [-t 2] [--recovery-steps 60] [--no-speed]
Results: a table on stdout and bench/results/prune-<date>.{json,md}.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_Q41 = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
LIC = "/usr/share/common-licenses"
EVAL_FILES = ["GPL-3", "Apache-2.0", "LGPL-3", "MPL-2.0"]
RECOVERY_FILES = ["GPL-2", "LGPL-2.1", "GFDL-1.3", "Artistic", "MPL-1.1", "BSD"]
CALIB = os.path.join(ROOT, "docs/training.md")
UNSTRUCTURED = [  # label, flags
    ("magnitude 30%", ["--method", "magnitude", "--sparsity", "0.3"]),
    ("magnitude 50%", ["--method", "magnitude", "--sparsity", "0.5"]),
    ("magnitude 2:4", ["--method", "magnitude", "--pattern", "2:4"]),
    ("Wanda 30%", ["--method", "wanda", "--sparsity", "0.3"]),
    ("Wanda 50%", ["--method", "wanda", "--sparsity", "0.5"]),
    ("Wanda 2:4", ["--method", "wanda", "--pattern", "2:4"]),
]
STRUCTURED = [
    ("heads 10% / 25% (GQA: 1 of 3 per group)", ["--heads", "0.25"]),
    ("MLP channels 10%", ["--channels", "0.10"]),
    ("MLP channels 25%", ["--channels", "0.25"]),
    ("layers 10% (3 of 30)", ["--layers", "3"]),
    ("layers 25% (7 of 30)", ["--layers", "7"]),
]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"bench_prune: {' '.join(cmd[:4])} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def quality(a, model, base_kld, js):
    run([a.loom, "perplexity", "-m", model, "--kl-divergence", "--kl-divergence-base", base_kld, "-t",
         str(a.threads), "--json", js])
    d = json.load(open(js))
    return {"ppl": d["ppl"]["value"], "kld": d["kld"]["value"]}


def speed(a, model):
    out = run([a.loom, "bench", "-m", model, "-p", "512", "-n", "128", "-r", "2", "-t", str(a.threads), "--json"]).stdout
    d = json.loads(out[out.index("{"):])
    return {"pp512": round(d["pp_tokens_per_s"], 1), "tg128": round(d["tg_tokens_per_s"], 1)}


def recover(a, model, work, name):
    cfg = os.path.join(work, name + "-recovery.yaml")
    out = os.path.join(work, name + "-recovery")
    with open(cfg, "w") as f:
        f.write(f"model: {model}\ndata:\n  train: {os.path.join(work, 'recovery.jsonl')}\n  format: text\n"
                f"  seq_len: 256\nlora:\n  r: 16\n  alpha: 32\n  dropout: 0.0\noptim:\n  lr: 1e-3\n"
                f"schedule:\n  kind: cosine\n  warmup_steps: 5\nbatch_size: 4\nsteps: {a.recovery_steps}\n"
                f"output_dir: {out}\nseed: 0\nthreads: {a.threads}\n")
    run([a.loom, "train", cfg, "--overwrite"])
    merged = os.path.join(work, name + "-recovered")
    run([a.loom, "merge", "-m", model, "--adapter", out, "-o", merged, "--dtype", "f32", "--overwrite"])
    return merged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--recovery-steps", type=int, default=60)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--work", default=os.path.join(ROOT, "out/bench_prune"))
    a = ap.parse_args()
    a.loom = os.path.abspath(a.loom)
    work = a.work
    os.makedirs(work, exist_ok=True)
    text = os.path.join(work, "eval.txt")
    with open(text, "w") as out:
        for n in EVAL_FILES:
            out.write(open(os.path.join(LIC, n), encoding="utf-8").read())
    with open(os.path.join(work, "recovery.jsonl"), "w") as out:
        for n in RECOVERY_FILES:
            body = open(os.path.join(LIC, n), encoding="utf-8", errors="replace").read()
            for i in range(0, len(body), 1500):
                out.write(json.dumps({"text": body[i:i + 1500]}) + "\n")
    src = os.path.join(work, "source.f32.gguf")
    if not os.path.exists(src):
        run([a.loom, "quantize", "-m", SRC_Q41, "-o", src, "--type", "F32"])
    base_kld = os.path.join(work, "source.kld")
    run([a.loom, "perplexity", "-m", src, "-f", text, "-t", str(a.threads), "--kl-divergence-base", base_kld,
         "--json", os.path.join(work, "source.json")])
    src_ppl = json.load(open(os.path.join(work, "source.json")))["ppl"]["value"]
    rows = [{"method": "source (f32)", "ppl": src_ppl, "kld": 0.0, "mib": os.path.getsize(src) / 2**20}]
    if not a.no_speed:
        f16 = os.path.join(work, "source.f16.gguf")
        run([a.loom, "quantize", "-m", src, "-o", f16, "--type", "F16"])
        rows[0]["speed_f16"] = speed(a, f16)
    # The same recovery fine-tune on the unpruned source: the recovery text is license text too, so
    # this is the baseline the recovered pruned models compare with (not the untuned source).
    rows[0]["recovered"] = quality(a, recover(a, src, work, "source"), base_kld, os.path.join(work, "source-rec.json"))
    print(f"  source: ppl {src_ppl:.4f}, after the recovery fine-tune {rows[0]['recovered']['ppl']:.4f}", flush=True)
    for i, (label, flags) in enumerate(UNSTRUCTURED + STRUCTURED):
        out = os.path.join(work, f"p{i}.gguf")
        r = run([a.loom, "prune", "-m", src, "-o", out, "--calib", CALIB, "--calib-chunks", "32", "-t",
                 str(a.threads)] + flags)
        zero = re.search(r"([\d.]+)% of them zero", r.stderr)
        fewer = re.search(r"\(([\d.]+)% fewer\)", r.stderr)
        row = {"method": label, "mib": os.path.getsize(out) / 2**20,
               "zero_pct": float(zero.group(1)) if zero else 0.0, "fewer_pct": float(fewer.group(1)) if fewer else 0.0}
        row.update(quality(a, out, base_kld, os.path.join(work, f"p{i}.json")))
        if (label, flags) in STRUCTURED:
            if not a.no_speed:
                row["speed"] = speed(a, out)
            rec = recover(a, out, work, f"p{i}")
            row["recovered"] = quality(a, rec, base_kld, os.path.join(work, f"p{i}-rec.json"))
        rows.append(row)
        print(f"  {label}: {row}", flush=True)
    md = ["| method | linear weights removed / zero | F16 size | PPL | ΔPPL | KLD | PPL after LoRA recovery | "
          "pp512 tok/s | tg128 tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rem = f"{r.get('fewer_pct', 0):.1f}% removed" if r.get("fewer_pct") else f"{r.get('zero_pct', 0):.1f}% zero"
        sp = r.get("speed") or r.get("speed_f16") or {}
        rec = r.get("recovered")
        md.append(f"| {r['method']} | {rem if r['method'] != 'source (f32)' else '-'} | {r['mib']:.1f} MiB | "
                  f"{r['ppl']:.3f} | {100 * (r['ppl'] / src_ppl - 1):+.1f}% | {r['kld']:.4f} | "
                  f"{rec['ppl']:.3f} ({100 * (rec['ppl'] / src_ppl - 1):+.1f}%) |" if rec else
                  f"| {r['method']} | {rem if r['method'] != 'source (f32)' else '-'} | {r['mib']:.1f} MiB | "
                  f"{r['ppl']:.3f} | {100 * (r['ppl'] / src_ppl - 1):+.1f}% | {r['kld']:.4f} | - |")
        md[-1] += f" {sp.get('pp512', '-')} | {sp.get('tg128', '-')} |"
    print("\n".join(md))
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    stem = os.path.join(ROOT, "bench/results", f"prune-{datetime.date.today()}")
    json.dump(rows, open(stem + ".json", "w"), indent=2)
    open(stem + ".md", "w").write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
