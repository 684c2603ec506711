#!/usr/bin/env python3
"""Quality, size and speed of every compression method on the default model (issue 12's table).

Source: SmolLM2-135M-Instruct's weights expanded to f32 (`loom quantize --type F32` of the Q4_1 file,
which only dequantizes). For each method: perplexity on held-out text and the KL divergence of its
token distribution from the source's (loom perplexity with the source's log-probs), the file size,
and prompt / generation speed (loom bench pp512 / tg128).

Methods:
  GGUF types   loom quantize --type T, next to llama-quantize T on the same F32 source (their files
               must be byte-identical: the script checks the tensor data's sha256);
  INT8         --method int8: symmetric / asymmetric x per channel / per tensor, W8A8 dynamic;
  INT4         --method int4 (RTN, groups of 128 where the widths allow: SmolLM2's 576 takes 96) and
               --method awq (same groups, AWQ scales from the calibration text);
  SmoothQuant  --method smoothquant --alpha 0.5, W8A8.
Eval text: /usr/share/common-licenses/{GPL-3,Apache-2.0,LGPL-3,MPL-2.0} (on every Debian; not in the
calibration). Calibration: docs/training.md.

Usage: python3 bench/bench_quality.py [--loom build/loom] [-t 2] [-c 512] [--types Q8_0,Q4_K_M,...]
                                      [--no-speed] [--no-llama]
Results: a table on stdout and bench/results/quality-<date>-t<T>.{json,md}.
"""
import argparse
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "third_party/llama.cpp/bin")
SRC_Q41 = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
EVAL_FILES = ["GPL-3", "Apache-2.0", "LGPL-3", "MPL-2.0"]
INT_METHODS = [  # name, loom quantize flags
    ("INT8 sym per channel (W8A8)", ["--method", "int8", "--scheme", "sym", "--granularity", "channel"]),
    ("INT8 asym per channel (W8A8)", ["--method", "int8", "--scheme", "asym", "--granularity", "channel"]),
    ("INT8 sym per tensor (W8A8)", ["--method", "int8", "--scheme", "sym", "--granularity", "tensor"]),
    ("INT8 asym per tensor (W8A8)", ["--method", "int8", "--scheme", "asym", "--granularity", "tensor"]),
    ("INT8 sym per channel, MSE range (W8A8)", ["--method", "int8", "--range", "mse"]),
    ("INT4 g128 RTN (asym)", ["--method", "int4"]),
    ("INT4 g128 AWQ (asym)", ["--method", "awq", "--calib", "CALIB"]),
    ("SmoothQuant W8A8 (alpha 0.5)", ["--method", "smoothquant", "--alpha", "0.5", "--calib", "CALIB"]),
    ("SmoothQuant W8A8 (alpha 0.7)", ["--method", "smoothquant", "--alpha", "0.7", "--calib", "CALIB"]),
]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench_quality: {' '.join(cmd[:4])} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def size_of(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


def tensor_digest(path):
    """sha256 of every tensor's data of a GGUF file (metadata aside), by name."""
    sys.path.insert(0, os.path.join(ROOT, "third_party/llama.cpp/src/gguf-py"))
    out = run(["/opt/loom-ref/bin/python", "-c",
               "import gguf,sys,hashlib;r=gguf.GGUFReader(sys.argv[1]);"
               "print(hashlib.sha256(b''.join(t.name.encode()+t.data.tobytes() for t in r.tensors)).hexdigest())",
               path]).stdout
    return out.strip()


def quality(loom, model, base_kld, threads, js):
    run([loom, "perplexity", "-m", model, "--kl-divergence-base", base_kld, "--kl-divergence", "-t", str(threads),
         "--json", js])
    d = json.load(open(js))
    return {"ppl": d["ppl"]["value"], "ppl_unc": d["ppl"]["uncertainty"], "kld": d["kld"]["value"],
            "same_top": d["same_top"]["value"], "dp_rms": d["p_diff_rms"]["value"]}


def speed(loom, model, threads):
    out = run([loom, "bench", "-m", model, "-p", "512", "-n", "128", "-r", "3", "-t", str(threads), "--json"]).stdout
    d = json.loads(out[out.index("{"):])
    return {"pp512": d["pp_tokens_per_s"], "tg128": d["tg_tokens_per_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--types", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K")
    ap.add_argument("--methods", default="all", help="comma-separated indexes into the INT method list, or all")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-quantize's side")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom_quality_")
    eval_txt, calib = os.path.join(tmp, "eval.txt"), os.path.join(ROOT, "docs/training.md")
    with open(eval_txt, "w") as f:
        for name in EVAL_FILES:
            f.write(open(os.path.join("/usr/share/common-licenses", name)).read())
    src = os.path.join(tmp, "source.F32.gguf")
    run([a.loom, "quantize", "-m", SRC_Q41, "-o", src, "--type", "F32", "-t", str(a.threads)])
    base_kld = os.path.join(tmp, "base.kld")
    run([a.loom, "perplexity", "-m", src, "-f", eval_txt, "-c", str(a.ctx), "-t", str(a.threads),
         "--kl-divergence-base", base_kld, "--json", os.path.join(tmp, "base.json")])
    base = json.load(open(os.path.join(tmp, "base.json")))
    rows = [{"method": "source (F32)", "ppl": base["ppl"]["value"], "ppl_unc": base["ppl"]["uncertainty"],
             "kld": 0.0, "same_top": 1.0, "dp_rms": 0.0, "bytes": size_of(src)}]
    if not a.no_speed:
        rows[0].update(speed(a.loom, src, a.threads))
    print(f"source: PPL {rows[0]['ppl']:.4f}, {base['n_chunks']} chunks of {a.ctx}", file=sys.stderr)

    for t in [x for x in a.types.split(",") if x]:
        out = os.path.join(tmp, f"loom-{t}.gguf")
        run([a.loom, "quantize", "-m", src, "-o", out, "--type", t, "-t", str(a.threads)])
        row = {"method": f"GGUF {t} (loom quantize)", "bytes": size_of(out)}
        row.update(quality(a.loom, out, base_kld, a.threads, os.path.join(tmp, f"q-{t}.json")))
        if not a.no_llama:
            ref = os.path.join(tmp, f"llama-{t}.gguf")
            run([os.path.join(BIN, "llama-quantize"), src, ref, t, str(a.threads)])
            row["equals_llama_quantize"] = tensor_digest(out) == tensor_digest(ref)
        if not a.no_speed:
            row.update(speed(a.loom, out, a.threads))
        rows.append(row)
        print(f"{row['method']}: PPL {row['ppl']:.4f} KLD {row['kld']:.5f}", file=sys.stderr)

    chosen = range(len(INT_METHODS)) if a.methods == "all" else [int(i) for i in a.methods.split(",")]
    for i in chosen:
        name, flags = INT_METHODS[i]
        out = os.path.join(tmp, f"int-{i}")
        flags = [calib if f == "CALIB" else f for f in flags]
        run([a.loom, "quantize", "-m", src, "-o", out, "--dtype", "bf16", "-t", str(a.threads)] + flags)
        row = {"method": name, "bytes": size_of(out)}
        row.update(quality(a.loom, out, base_kld, a.threads, os.path.join(tmp, f"i-{i}.json")))
        if not a.no_speed:
            row.update(speed(a.loom, out, a.threads))
        rows.append(row)
        print(f"{name}: PPL {row['ppl']:.4f} KLD {row['kld']:.5f}", file=sys.stderr)

    src_ppl = rows[0]["ppl"]
    lines = ["| method | size MiB | PPL | ΔPPL vs F32 | mean KLD | same top | pp512 t/s | tg128 t/s | = llama-quantize |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pp = r.get("pp512", float("nan"))
        tg = r.get("tg128", float("nan"))
        eq = {True: "yes", False: "NO"}.get(r.get("equals_llama_quantize"), "")
        lines.append(f"| {r['method']} | {r['bytes'] / 2**20:.1f} | {r['ppl']:.4f} ± {r.get('ppl_unc', 0):.4f} | "
                     f"{100 * (r['ppl'] / src_ppl - 1):+.2f}% | {r['kld']:.5f} | {100 * r['same_top']:.2f}% | "
                     f"{pp:.1f} | {tg:.1f} | {eq} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    stem = os.path.join(ROOT, "bench/results", f"quality-{datetime.date.today()}-t{a.threads}")
    json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "ctx": a.ctx, "threads": a.threads,
               "eval": EVAL_FILES, "rows": rows}, open(stem + ".json", "w"), indent=1)
    open(stem + ".md", "w").write(table + "\n")
    print(f"\nraw results: {stem}.json", file=sys.stderr)


if __name__ == "__main__":
    main()
