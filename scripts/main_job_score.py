#!/usr/bin/env python3
"""Scores a model (optionally with a LoRA adapter) on data/main_job/eval.jsonl for scripts/main_job.

Asks every eval question through `loom chat` (greedy) and counts replies that are exactly
"ANSWER: <integer>" (format) and those whose number is also right (accuracy). Standard library only.
Usage: main_job_score.py LOOM MODEL EVAL_JSONL [--adapter DIR] [--label NAME] [--show N]
"""
import argparse
import json
import re
import subprocess
import sys

FORMAT = re.compile(r"^ANSWER: (-?\d+)$")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("loom")
    ap.add_argument("model")
    ap.add_argument("eval")
    ap.add_argument("--adapter")
    ap.add_argument("--label", default="model")
    ap.add_argument("--show", type=int, default=2, help="replies to print as samples")
    ap.add_argument("--threads", default="2")
    a = ap.parse_args()

    with open(a.eval, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    n_format = n_correct = 0
    for i, rec in enumerate(records):
        question = rec["messages"][0]["content"]
        expected = FORMAT.match(rec["messages"][1]["content"]).group(1)
        cmd = [a.loom, "chat", "-m", a.model, "-p", question, "-n", "12", "--temp", "0", "-t", a.threads]
        if a.adapter:
            cmd += ["--adapter", a.adapter]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"main_job_score: {' '.join(cmd)} failed:\n{out.stderr}")
        reply = out.stdout.strip()
        m = FORMAT.match(reply)
        n_format += m is not None
        n_correct += m is not None and m.group(1) == expected
        if i < a.show:
            print(f"  [{a.label}] Q: {question}  expected: ANSWER: {expected}\n  [{a.label}] A: {reply!r}")
    n = len(records)
    print(f"  [{a.label}] format 'ANSWER: <n>': {n_format}/{n} ({100 * n_format / n:.0f}%), "
          f"correct: {n_correct}/{n} ({100 * n_correct / n:.0f}%)")


if __name__ == "__main__":
    main()
