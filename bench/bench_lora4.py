#!/usr/bin/env python3
"""What keeping LoRA adapters in 4 bits (or int8, bf16) costs and saves in `loom serve` (--lora-bits 4
against 32).

Two servers of the same base and adapter, one with --lora-bits 32 (f32) and one with --lora-bits 4 (A in
groups of 128 columns or the fitting multiple of 32, B per row; kernels/int_quant.h), or with --bits, 8
(int8, kernels/lora_i8.h) or 16 (bf16). Both answer the
README main job's 40 eval questions greedily (16 tokens, with log-probs); reported: how many answers are
identical, the task score of each (format "ANSWER: <n>" and right), the mean and largest difference of
the chosen tokens' log-probs while the texts agree, the memory per adapter from the start-up log, and
generation throughput with --clients concurrent requests spread over --copies registrations of the
adapter (so several 4-bit adapters share each step).

Usage: python3 bench/bench_lora4.py [--loom build/loom] [--adapter out/main_job-adapter] [-t 2]
       [--copies 8] [--clients 16] [--max-tokens 64] [--bits 4|8|16]
The adapter defaults to the main job's; without one, the script trains 60 steps of it first.
"""
import argparse
import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
ANSWER = re.compile(r"^ANSWER: (-?\d+)$")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))


class Server:
    def __init__(self, loom, adapter, bits, copies, threads):
        self.port = free_port()
        args = [loom, "serve", "-m", BASE, "--port", str(self.port), "-t", str(threads), "--lora-bits", str(bits),
                "--max-loras", str(copies)]
        for i in range(copies):
            args += ["--adapter", f"tuned{i}={adapter}"]
        self.log = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        for _ in range(300):
            time.sleep(0.2)
            self.log.seek(0)
            text = self.log.read()
            if "on http://" in text:
                break
            if self.p.poll() is not None:
                sys.exit(f"bench_lora4: loom serve exited:\n{text}")
        m = re.search(r"adapter 'tuned0': ([\d.]+) MiB \((\S+); ([\d.]+) MiB in f32\)", text)
        self.mib, self.f32_mib = (float(m.group(1)), float(m.group(3))) if m else (float("nan"),) * 2

    def close(self):
        self.p.terminate()
        self.p.wait()


def answers(server, questions):
    out = []
    for q in questions:
        r = post(server.port, {"model": "tuned0", "messages": [{"role": "user", "content": q}], "temperature": 0,
                               "max_tokens": 16, "logprobs": True})
        c = r["choices"][0]
        lps = [t["logprob"] for t in (c.get("logprobs") or {}).get("content") or []]
        out.append((c["message"]["content"], lps))
    return out


def throughput(server, questions, copies, clients, max_tokens):
    def one(i):
        r = post(server.port, {"model": f"tuned{i % copies}", "temperature": 0, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                               "ignore_eos": True})
        return r["usage"]["completion_tokens"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as ex:
        tokens = sum(ex.map(one, range(clients * 2)))
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("--adapter", default=os.path.join(ROOT, "out/main_job-adapter"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8, 16),
                    help="the --lora-bits compared with f32 (4: 4-bit, 8: int8, 16: bf16)")
    a = ap.parse_args()
    if not os.path.isdir(a.adapter):
        a.adapter = os.path.join(tempfile.mkdtemp(prefix="loom_lora4_"), "adapter")
        subprocess.run([a.loom, "train", os.path.join(ROOT, "configs/main_job.yaml"), "--set", "steps=60", "--set",
                        "eval_interval=0", "--set", "eval_at_start=false", "--set", f"output_dir={a.adapter}",
                        "-t", str(a.threads)], check=True, capture_output=True)
    rows = [json.loads(l) for l in open(os.path.join(ROOT, "data/main_job/eval.jsonl"))]
    questions = [r["messages"][0]["content"] for r in rows]
    expected = [r["messages"][1]["content"] for r in rows]
    res = {}
    for bits in (32, a.bits):
        s = Server(a.loom, a.adapter, bits, a.copies, a.threads)
        try:
            res[bits] = {"answers": answers(s, questions), "mib": s.mib, "f32_mib": s.f32_mib,
                         "tok_s": throughput(s, questions, a.copies, a.clients, a.max_tokens)}
        finally:
            s.close()
    same = sum(x[0] == y[0] for x, y in zip(res[32]["answers"], res[a.bits]["answers"]))
    diffs = [abs(p - q) for x, y in zip(res[32]["answers"], res[a.bits]["answers"]) if x[0] == y[0]
             for p, q in zip(x[1], y[1])]
    print(f"adapter {a.adapter}, {len(questions)} eval questions, greedy, 16 tokens\n")
    print("| lora bits | MiB per adapter | format | correct | gen tok/s "
          f"({a.clients} clients, {a.copies} adapters) |")
    print("|---|---|---|---|---|")
    for bits in (32, a.bits):
        ans = [t for t, _ in res[bits]["answers"]]
        fmt_ok = sum(bool(ANSWER.match(t.strip())) for t in ans)
        right = sum(t.strip() == e for t, e in zip(ans, expected))
        print(f"| {bits} | {res[bits]['mib']:.2f} | {fmt_ok}/{len(ans)} | {right}/{len(ans)} | "
              f"{res[bits]['tok_s']:.1f} |")
    print(f"\nidentical answers: {same}/{len(questions)}; chosen-token log-prob difference where identical: "
          f"mean {sum(diffs) / max(1, len(diffs)):.4f}, max {max(diffs, default=0):.4f} over {len(diffs)} tokens")


if __name__ == "__main__":
    main()
