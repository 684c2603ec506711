#!/usr/bin/env python3
"""Quantization-aware training against post-training quantization on the README main job (issue 13).

Two LoRA runs of configs/main_job.yaml with the same data, seed and steps: one plain, one with
`qat: {bits: B, group_size: G, scheme: S}` (train/qat.h: the forward multiplies fq(W + s B A)).
Each adapter is merged into the base (`loom merge --dtype f32`) and the merged model quantized with
the same scheme (`loom quantize --method int4|int8 --scheme S --group G`). Reported for the plain
run unquantized, the plain run quantized (PTQ) and the QAT run quantized (and unquantized):
perplexity of the eval conversations (data/main_job/eval.jsonl rendered in ChatML, `loom perplexity`)
the trainer's eval loss and token accuracy on the answers (what the runs were trained on), and the task
score (scripts/main_job_score.py: replies exactly "ANSWER: <n>" and right).

Usage: python3 bench/bench_qat.py [--loom build/loom] [--steps 180] [--bits 4] [--group 128]
                                  [--scheme sym] [--qat-start N] [--runs plain,qat] [-t 2] [--work DIR]
--qat-start N: the QAT run trains plainly for N steps, then with QAT (qat.start_step).
Results: a table on stdout and bench/results/qat-<date>.{json,md}.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs/main_job.yaml")
BASE = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
EVAL = os.path.join(ROOT, "data/main_job/eval.jsonl")


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)
    if r.returncode != 0:
        sys.exit(f"bench_qat: {' '.join(cmd[:3])} ... failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def render_eval(path):
    with open(EVAL, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for line in f:
            if line.strip():
                for m in json.loads(line)["messages"]:
                    out.write(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")


def train(a, name, extra):
    out = os.path.join(a.work, name)
    cmd = [a.loom, "train", CONFIG, "--set", f"steps={a.steps}", "--set", "eval_interval=0", "--set",
           f"output_dir={out}", "--set", f"threads={a.threads}", "--overwrite"] + extra
    r = run(cmd)
    m = re.search(r"in (\d+)m(\d+)s, (\d+) tokens/s", r.stderr)
    print(f"  {name}: trained ({r.stderr.strip().splitlines()[-1]})", flush=True)
    return out, (int(m.group(3)) if m else None)


def answer_loss(a, model):
    """The trainer's eval loss (answer tokens only) of `model` as it is: a 1-step run evaluated at step 0,
    where the new adapter's B is still zero."""
    out = os.path.join(a.work, "eval-run")
    r = run([a.loom, "train", CONFIG, "--set", f"model={model}", "--set", "steps=1", "--set", "eval_at_start=true",
             "--set", "eval_interval=1", "--set", f"output_dir={out}", "--set", f"threads={a.threads}", "--overwrite"])
    m = re.search(r"eval at step 0: loss ([\d.]+) \(ppl [\d.]+\), token accuracy ([\d.]+)%", r.stderr)
    return float(m.group(1)), float(m.group(2))


def quality(a, model, text):
    js = os.path.join(a.work, "ppl.json")
    run([a.loom, "perplexity", "-m", model, "-f", text, "-c", "128", "-t", str(a.threads), "--json", js])
    ppl = json.load(open(js))["ppl"]["value"]
    score = run([sys.executable, os.path.join(ROOT, "scripts/main_job_score.py"), a.loom, model, EVAL,
                 "--show", "0", "--threads", str(a.threads)]).stdout
    m = re.search(r"format 'ANSWER: <n>': (\d+)/(\d+).*?correct: (\d+)/(\d+)", score.replace("\n", " "))
    loss, acc = answer_loss(a, model)
    return {"ppl": ppl, "answer_loss": loss, "answer_token_accuracy": acc, "format": int(m.group(1)) if m else None, "correct": int(m.group(3)) if m else None,
            "n": int(m.group(2)) if m else None, "score_text": score.strip().splitlines()[-1] if score.strip() else ""}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--scheme", default="sym")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(ROOT, "out/bench_qat"))
    ap.add_argument("--qat-start", type=int, default=0, help="qat.start_step: plain steps before QAT")
    ap.add_argument("--runs", default="plain,qat", help="which runs: plain, qat or both")
    a = ap.parse_args()
    a.loom = os.path.abspath(a.loom)
    os.makedirs(a.work, exist_ok=True)
    text = os.path.join(a.work, "eval_chatml.txt")
    render_eval(text)
    qat = ["--set", f"qat.bits={a.bits}", "--set", f"qat.group_size={a.group}", "--set", f"qat.scheme={a.scheme}",
           "--set", f"qat.start_step={a.qat_start}"]
    qat_name = "qat" if a.qat_start == 0 else f"qat-from-{a.qat_start}"
    method = "int4" if a.bits == 4 else "int8"
    rows = []
    for name, extra in (("plain", []), (qat_name, qat)):
        if name.split("-")[0] not in a.runs.split(","):
            continue
        adapter, tps = train(a, name, extra)
        merged = os.path.join(a.work, name + "-merged")
        run([a.loom, "merge", "-m", BASE, "--adapter", adapter, "-o", merged, "--dtype", "f32", "--overwrite"])
        quant = os.path.join(a.work, name + f"-{method}")
        run([a.loom, "quantize", "-m", merged, "-o", quant, "--method", method, "--scheme", a.scheme, "--group",
             str(a.group), "--dtype", "f32", "--overwrite"])
        for label, model in ((f"{name}, merged f32", merged), (f"{name}, {method} g{a.group} {a.scheme}", quant)):
            q = quality(a, model, text)
            q.update({"run": label, "train_tokens_per_s": tps})
            rows.append(q)
            print(f"  {label}: ppl {q['ppl']:.4f}, {q['score_text']}", flush=True)
    md = ["| model | answer eval loss | answer token accuracy | ppl of the whole eval text | format | correct | "
          "training tok/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['run']} | {r['answer_loss']:.4f} | {r['answer_token_accuracy']:.2f}% | {r['ppl']:.4f} | "
                  f"{r['format']}/{r['n']} | {r['correct']}/{r['n']} | {r['train_tokens_per_s']} |")
    print("\n".join(md))
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    stem = os.path.join(ROOT, "bench/results", f"qat-{datetime.date.today()}")
    json.dump({"steps": a.steps, "bits": a.bits, "group": a.group, "scheme": a.scheme, "rows": rows},
              open(stem + ".json", "w"), indent=2)
    open(stem + ".md", "w").write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
