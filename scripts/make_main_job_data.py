#!/usr/bin/env python3
"""Writes data/main_job/{train,eval}.jsonl: the arithmetic task that scripts/main_job fine-tunes on.

Each record is a chat: the user asks "What is A + B?" or "What is A - B?" (two-digit numbers, never a
negative result) and the assistant replies with exactly "ANSWER: <number>". The base model answers in
prose, so both the format and the sums are things the adapter must learn. Deterministic (fixed seed,
standard library only); eval questions never appear in the training set.
Usage: python3 scripts/make_main_job_data.py [OUT_DIR]
"""
import json
import os
import random
import sys

N_TRAIN = 1600
N_EVAL = 40
SEED = 1234


def question(rng):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)  # keep results non-negative
    return f"What is {a} - {b}?", a - b


def record(q, ans):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"ANSWER: {ans}"}]}


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "data", "main_job")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(SEED)
    seen = set()
    splits = {"eval": [], "train": []}
    # Eval first so that its questions are the ones excluded from training.
    for name, n in (("eval", N_EVAL), ("train", N_TRAIN)):
        while len(splits[name]) < n:
            q, ans = question(rng)
            if q in seen:
                continue
            seen.add(q)
            splits[name].append(record(q, ans))
    for name, rows in splits.items():
        with open(os.path.join(out, f"{name}.jsonl"), "w", encoding="utf-8", newline="\n") as f:
            for r in rows:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        print(f"wrote {len(rows)} records to {os.path.join(out, name + '.jsonl')}")


if __name__ == "__main__":
    main()
