#!/usr/bin/env python3
"""Prompt-lookup speculative decoding (--spec-ngram): tokens/s with and without, and the acceptance rate.

Two parts, both greedy on the same prompts (repetitive: quoting a paragraph, editing code; not repetitive:
free writing; `--temp T` samples in the generate part instead):
  generate  `loom generate --temp 0` with and without --spec-ngram K: median generation tokens/s of --runs
            runs, the accepted share of drafted tokens, and whether the outputs are identical (they must be).
  serve     `loom serve` with and without --spec-ngram K, the same chat requests (one at a time, then
            each --concurrency at once): output tokens/s, acceptance from /metrics, identical texts.

Usage: python3 bench/bench_spec.py [--loom build/loom] [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                   [--k 5] [--runs 3] [--threads 2] [--tokens 200] [--concurrency 1,2,4]
                                   [--max-batch 2] [--only generate|serve] [--temp 0]
"""
import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
             "trimmed the wick, and watched the ships pass beyond the rocks. In winter the storms came from the "
             "north, and the waves broke over the lower windows, but the light never failed.")
CODE = ("def total_price(items, tax):\n    x = 0\n    for item in items:\n        x += item.price * item.count\n"
        "    x = x * (1 + tax)\n    return round(x, 2)\n\n\ndef cheapest(items):\n    best = None\n"
        "    for item in items:\n        if best is None or item.price < best.price:\n            best = item\n"
        "    return best\n")

# (name, repetitive, raw prompt for `loom generate`, chat message for `loom serve`)
PROMPTS = [
    ("quote", True, f"{PARAGRAPH}\n\nThe same paragraph again, word for word:\n",
     f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}"),
    ("code edit", True, f"```python\n{CODE}```\n\nThe same code with the variable x renamed to total:\n```python\n",
     f"Rename the variable x to total in this code and print the whole code:\n\n```python\n{CODE}```"),
    ("free text", False, "Here is a short story about a dragon who learns to cook.\n\n",
     "Write a short story about a dragon who learns to cook."),
]

GEN_RE = re.compile(r"generation: (\d+) tokens in ([\d.]+) ms")
SPEC_RE = re.compile(r"speculation: (\d+) of (\d+) drafted tokens accepted")


def run_generate(a, prompt, k):
    cmd = [a.loom, "generate", "-m", a.model, "-p", prompt, "-n", str(a.tokens), "--temp", str(a.temp),
           "-t", str(a.threads), "--seed", "1"]
    if k:
        cmd += ["--spec-ngram", str(k), "--spec-ngram-max", str(a.ngram_max), "--spec-ngram-min", str(a.ngram_min)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = GEN_RE.search(p.stderr)
    n, ms = int(m.group(1)), float(m.group(2))
    s = SPEC_RE.search(p.stderr)
    acc = (int(s.group(1)), int(s.group(2))) if s else (0, 0)
    return p.stdout, n / (ms / 1e3), acc


def bench_generate(a):
    how = "greedy" if a.temp <= 0 else f"sampled at --temp {a.temp} --seed 1"
    print(f"## loom generate: {a.tokens} tokens, {how}, -t {a.threads}, median of {a.runs} runs, "
          f"--spec-ngram {a.k} --spec-ngram-max {a.ngram_max} --spec-ngram-min {a.ngram_min}\n")
    print("| prompt | plain tok/s | speculative tok/s | speed-up | accepted / drafted | same output |")
    print("|---|---|---|---|---|---|")
    for name, _, prompt, _ in PROMPTS:
        plain, spec, same, acc = [], [], True, (0, 0)
        for _ in range(a.runs):  # alternate, so that load changes hit both
            out0, tps0, _ = run_generate(a, prompt, 0)
            out1, tps1, acc = run_generate(a, prompt, a.k)
            plain.append(tps0)
            spec.append(tps1)
            same = same and out0 == out1
        p, s = statistics.median(plain), statistics.median(spec)
        rate = f"{acc[0]} / {acc[1]} ({100 * acc[0] / acc[1]:.0f}%)" if acc[1] else "0 / 0"
        same_text = ("yes" if same else "NO") if a.temp <= 0 else "- (sampled: same distribution, other draws)"
        print(f"| {name} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {rate} | {same_text} |")
        sys.stdout.flush()


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def start_server(a, k):
    cmd = [a.loom, "serve", "-m", a.model, "--port", "0", "-t", str(a.threads), "--max-model-len", "2048"]
    if k:
        cmd += ["--spec-ngram", str(k), "--spec-ngram-max", str(a.ngram_max), "--spec-ngram-min", str(a.ngram_min),
                "--spec-max-batch", str(a.max_batch)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    m = re.search(r"http://([\d.]+):(\d+)", proc.stderr.readline())
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, int(m.group(2))


def chat(port, message, tokens):
    body = {"messages": [{"role": "user", "content": message}], "max_tokens": tokens, "temperature": 0}
    r = post(port, "/v1/chat/completions", body)
    return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]


def serve_round(port, message, tokens, conc):
    out = [None] * conc

    def one(i):
        out[i] = chat(port, message, tokens)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return out[0][0], sum(o[1] for o in out) / dt


def bench_serve(a):
    print(f"\n## loom serve: chat, {a.tokens} max tokens, greedy, -t {a.threads}, median of {a.runs} rounds "
          f"(plain and speculative servers both up, rounds alternating), --spec-ngram {a.k} "
          f"--spec-max-batch {a.max_batch}\n")
    print("| prompt | clients | plain tok/s | speculative tok/s | speed-up | accepted / drafted | same text |")
    print("|---|---|---|---|---|---|---|")
    servers = [start_server(a, 0), start_server(a, a.k)]
    try:
        for _, port in servers:
            chat(port, "Hello", 4)  # warm-up
        spec_port = servers[1][1]
        for name, _, _, message in PROMPTS:
            for conc in a.concurrency:
                d0 = metric(spec_port, "loom_spec_decode_draft_tokens_total")
                a0 = metric(spec_port, "loom_spec_decode_accepted_tokens_total")
                tps, texts = ([], []), ([], [])
                for _ in range(a.runs):
                    for i, (_, port) in enumerate(servers):
                        text, t = serve_round(port, message, a.tokens, conc)
                        tps[i].append(t)
                        texts[i].append(text)
                drafted = metric(spec_port, "loom_spec_decode_draft_tokens_total") - d0
                accepted = metric(spec_port, "loom_spec_decode_accepted_tokens_total") - a0
                p, sp = statistics.median(tps[0]), statistics.median(tps[1])
                rate = f"{accepted:.0f} / {drafted:.0f} ({100 * accepted / drafted:.0f}%)" if drafted else "0 / 0"
                same = all(t == texts[0][0] for t in texts[0] + texts[1])
                print(f"| {name} | {conc} | {p:.1f} | {sp:.1f} | {sp / p:.2f}x | {rate} | {'yes' if same else 'NO'} |")
                sys.stdout.flush()
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temp", type=float, default=0.0,
                    help="loom generate's --temp (0: greedy; above: speculative sampling, outputs not compared)")
    ap.add_argument("--concurrency", default="1,2,4", help="clients at once, comma-separated")
    ap.add_argument("--max-batch", type=int, default=2, help="--spec-max-batch of the speculating server")
    ap.add_argument("--only", choices=["generate", "serve"])
    a = ap.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    if a.only != "serve":
        bench_generate(a)
    if a.only != "generate":
        bench_serve(a)


if __name__ == "__main__":
    main()
