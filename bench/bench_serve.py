#!/usr/bin/env python3
"""Serving benchmark: `loom serve` against llama.cpp's llama-server under concurrent streaming load.

Runs with plain python3 (standard library only). Needs loom built in build/ and llama-server from
scripts/build_llamacpp. See bench/README.md ("Serving: loom serve vs llama-server").

For each concurrency C (default 1,4,16,64) and each server the script starts the server on a free
port with C sequence slots (loom: --max-seqs C; llama-server: -np C -c C*ctx -cb), waits for
/health, sends one warm-up request, then runs C client threads for --duration seconds. Each
thread loops: one streaming /v1/completions request with a fixed-length token prompt and
max_tokens N, ignore_eos so every request generates exactly N tokens, greedy (temperature 0).
When the time is up no new request starts; the ones in flight finish and are counted.
The server's peak RSS (VmHWM) is read, then it gets SIGTERM.

Adapters mode (loom only): the same load at concurrency 16 against loom serving 1, 8 and 64
random rank-8 LoRA adapters (PEFT folders written by this script), requests spread round-robin
over the adapters. --registered 1000: as many names registered (their folders hard-link the
64 written weight files), requests round-robin over all of them, with --max-lora-memory room for
only a few (LRU: nearly every request loads its adapter). --repeat N runs the whole set N times
interleaved and reports medians with their range, each ratio taken within its repetition.

Raw results go to bench/results/serve-<date>-t<T>.json (gitignored), tables to stdout and .md.
"""

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_LOOM = os.path.join(ROOT, "build", "loom")
DEFAULT_LLAMA = os.path.join(ROOT, "third_party", "llama.cpp", "bin", "llama-server")
RESULTS_DIR = os.path.join(ROOT, "bench", "results")
MODEL_NAME = "base"  # the id loom serves the base model as (llama-server ignores "model")
BUSY_CORES = 0.3    # CPU use by other processes above which a run is flagged as disturbed
NONCE_TOKENS = 4     # random tokens opening every prompt, so no prefix cache can match


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Prompts. Varied passages, tokenized once with the model's tokenizer; every request sends a
# token list (both servers accept token prompts), so both see exactly the same tokens.

PASSAGES = [
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were used "
    "in East Asia to print textiles and Buddhist texts, and movable type made of baked clay appeared "
    "in China in the eleventh century. What changed in fifteenth-century Mainz was the combination of "
    "metal type cast in a hand mould, an oil-based ink and a screw press adapted from wine making.",
    "To make a simple sourdough bread, mix flour, water and an active starter, then let the dough rest "
    "for half an hour before adding salt. Over the next few hours fold the dough every thirty minutes "
    "to build strength. Shape it into a tight ball, let it rise overnight in the refrigerator, and "
    "bake it in a very hot covered pot for the first twenty minutes.",
    "Photosynthesis converts light energy into chemical energy. In the thylakoid membranes, chlorophyll "
    "absorbs photons and drives the splitting of water, releasing oxygen and producing ATP and NADPH. "
    "The Calvin cycle in the stroma then uses these carriers to fix carbon dioxide into three-carbon "
    "sugars, which the plant builds into glucose, starch and cellulose.",
    "Dear team, the quarterly review is moved to Thursday at ten. Please bring updated figures for the "
    "regional sales, the status of the warehouse migration and a short list of risks for the next "
    "quarter. If you cannot attend, send your notes to Maria by Wednesday evening so that she can "
    "present them on your behalf.",
    "A binary search tree keeps its keys in order: every key in the left subtree of a node is smaller "
    "than the node's key and every key in the right subtree is larger. Lookups, insertions and "
    "deletions take time proportional to the height of the tree, which is why balanced variants such "
    "as red-black trees and AVL trees rotate nodes to keep the height logarithmic.",
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens and wrote the weather in a leather book that his father had kept before "
    "him. On stormy nights he stayed awake until dawn, listening to the waves and watching for the "
    "lights of fishing boats returning to the harbour.",
    "Interest compounds when the interest earned in one period is added to the principal for the next. "
    "A deposit of one thousand euros at five percent a year grows to about one thousand six hundred "
    "and twenty-nine euros after ten years. The rule of seventy-two gives a quick estimate of the "
    "doubling time: divide seventy-two by the yearly rate in percent.",
    "Migratory birds navigate using several cues at once. Young birds inherit a rough direction and "
    "distance, and they calibrate a magnetic compass against the rotation of the night sky and the "
    "position of the setting sun. Older birds also learn landmarks such as coastlines, mountain "
    "ranges and rivers, which lets them correct for wind drift on later journeys.",
    "Before replacing a light switch, turn off the circuit at the breaker panel and confirm with a "
    "voltage tester that the wires are dead. Note which wire goes to which terminal, loosen the "
    "screws and remove the old switch. Connect the new switch the same way, fold the wires neatly "
    "into the box, fasten the cover plate and restore the power.",
    "The French Revolution transformed European politics. Financial crisis, bad harvests and new "
    "ideas about rights and citizenship led the Estates-General to become a National Assembly in "
    "1789. Within a few years the monarchy had fallen, the church had lost its lands, and a series of "
    "wars spread revolutionary principles and conscription across the continent.",
    "A healthy running routine alternates hard and easy days. Start with three short runs a week at "
    "a pace that still allows conversation, and add no more than ten percent of distance each week. "
    "Sleep, food and rest days matter as much as the training itself, because the body adapts during "
    "recovery rather than during the run.",
    "Volcanoes form where magma reaches the surface. At subduction zones, water released from the "
    "sinking plate lowers the melting point of the mantle above it, producing sticky, gas-rich magma "
    "and explosive eruptions. At hot spots and mid-ocean ridges, runny basaltic lava flows out more "
    "gently and builds broad shields or new sea floor.",
    "The meeting notes from Tuesday: the design of the mobile app is approved with two changes. The "
    "login screen will offer passkeys as well as passwords, and the settings page moves into the "
    "profile menu. Testing starts on the fifteenth; the release is planned for the end of the month "
    "if no critical bugs are found.",
    "Jazz grew out of blues, ragtime and brass band music in New Orleans at the start of the "
    "twentieth century. Its players improvised over repeating chord patterns, swung the rhythm and "
    "traded solos. Over the following decades the style changed again and again, from big band swing "
    "to bebop, cool jazz, modal jazz and fusion.",
    "Rainwater harvesting collects runoff from roofs into tanks for later use. A simple system needs "
    "gutters, a first-flush diverter that discards the dirtiest water, a screened inlet and a covered "
    "tank. The stored water suits gardens and toilets; for drinking it must be filtered and "
    "disinfected, and the tank should be cleaned once a year.",
    "In a small mountain village the baker opens his shop at five in the morning. The smell of fresh "
    "rolls reaches the square before the church bells ring, and the first customers are the farmers "
    "on their way to the fields. By noon the shelves are empty, and he spends the afternoon preparing "
    "the dough for the next day.",
    "Vaccines train the immune system without causing the disease. They present an antigen, such as "
    "an inactivated virus, a protein subunit or the genetic instructions for making one, so that B "
    "cells produce antibodies and memory cells form. When the real pathogen arrives, the body "
    "recognises it and responds quickly and strongly.",
    "The function reads a configuration file, checks that every required key is present and returns "
    "a dictionary of settings. Missing keys raise an error that names the file and the key; unknown "
    "keys are logged as warnings so that typos are noticed. Default values are documented next to "
    "each key in the example configuration shipped with the program.",
    "Chess openings balance development, control of the centre and king safety. The Italian Game "
    "brings a bishop quickly to an active square, the Queen's Gambit offers a pawn to gain central "
    "control, and the Sicilian Defence gives Black an unbalanced position with chances to counter "
    "attack on the queenside.",
    "Glaciers move because ice deforms under its own weight and slides over its bed on a thin film of "
    "meltwater. As they flow they pluck rocks from the valley floor and grind them against the "
    "bedrock, carving U-shaped valleys, cirques and fjords. When the ice retreats it leaves moraines, "
    "erratic boulders and lakes behind.",
]


def tokenize(text, loom, llama_tokenize, model):
    """Token ids of `text` without BOS, from loom's tokenizer (or llama-tokenize as a fallback)."""
    if loom and os.access(loom, os.X_OK):
        cmd = [loom, "tokenize", "-m", model, "--ids", "--no-bos", "--text", text]
    elif os.access(llama_tokenize, os.X_OK):
        cmd = [llama_tokenize, "-m", model, "--ids", "--no-bos", "--log-disable", "-p", text]
    else:
        raise SystemExit("need build/loom or llama-tokenize to tokenize the prompts")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:2])} failed (rc {p.returncode}):\n{p.stderr[-2000:]}")
    for line in reversed(p.stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("["):
            return json.loads(line)
    raise SystemExit(f"no token list in the output of {' '.join(cmd[:2])}:\n{p.stdout[-2000:]}")


def build_prompt_pool(a, n_prompts=64):
    """n_prompts token lists of a.prompt_tokens - NONCE_TOKENS tokens: passages in seeded orders,
    the list repeated (each pass in a new order) for prompts longer than all passages together."""
    llama_tokenize = os.path.join(os.path.dirname(a.llama_server), "llama-tokenize")
    loom = None if a.no_loom and not os.access(a.loom, os.X_OK) else a.loom
    toks = [tokenize(p, loom, llama_tokenize, a.model) for p in PASSAGES]
    sep = tokenize("\n\n", loom, llama_tokenize, a.model)
    body_len = a.prompt_tokens - NONCE_TOKENS
    rng = random.Random(a.seed)
    pool = []
    for _ in range(n_prompts):
        ids = []
        while len(ids) < body_len:
            order = list(range(len(toks)))
            rng.shuffle(order)
            for i in order:
                if len(ids) >= body_len:
                    break
                ids += toks[i] + sep
        pool.append(ids[:body_len])
    return pool


def request_prompt(pool, seed, stream_id, index):
    """The prompt of request `index` of client `stream_id`: a passage list from the pool behind
    NONCE_TOKENS random tokens. The nonce makes every prompt differ from the first token on, so
    neither server's prefix/prompt cache saves any prefill work; both get the same sequence."""
    rng = random.Random(f"{seed}/{stream_id}/{index}")
    nonce = [rng.randrange(1000, 40000) for _ in range(NONCE_TOKENS)]
    return nonce + pool[rng.randrange(len(pool))]


# --------------------------------------------------------------------------------------------
# Servers.

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port, path, timeout=5.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def read_status_kib(pid, key):
    """A `key:  N kB` line of /proc/PID/status in KiB, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_seconds(pid):
    """User + system CPU seconds of process pid (all its threads), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def machine_busy_s():
    """CPU seconds all processes have used since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


def own_cpu_s():
    t = os.times()
    return t.user + t.system


def wait_idle(max_wait, threshold):
    """Waits (up to max_wait s) until the machine's CPU use over 1 s is below `threshold` cores.
    Returns the last measurement in cores."""
    t0 = time.monotonic()
    while True:
        b0 = machine_busy_s()
        time.sleep(1.0)
        busy = machine_busy_s() - b0
        if busy < threshold or time.monotonic() - t0 >= max_wait:
            return busy
        log(f"machine busy ({busy:.2f} cores in use by others); waiting")
        time.sleep(4.0)


class Server:
    """One server process: started on a free port, its output in a log file."""

    def __init__(self, kind, cmd_fn, workdir, start_timeout):
        self.kind = kind
        self.port = free_port()
        self.cmd = cmd_fn(self.port)
        self.log_path = os.path.join(workdir, f"{kind}-{self.port}.log")
        self.start_timeout = start_timeout
        self.proc = None
        self.start_s = None

    def start(self):
        log(" ".join(self.cmd[:40]) + (f" ... ({len(self.cmd)} arguments)" if len(self.cmd) > 40 else ""))
        self.logf = open(self.log_path, "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=ROOT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with rc {self.proc.returncode} while starting: "
                                   f"{self.log_tail(600)}")
            try:
                status, _ = http_get(self.port, "/health", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > self.start_timeout:
                raise RuntimeError(f"{self.kind} not healthy after {self.start_timeout} s: {self.log_tail(600)}")
            time.sleep(0.1)
        self.start_s = time.monotonic() - t0

    def peak_rss_mib(self):
        kib = read_status_kib(self.proc.pid, "VmHWM") if self.proc else None
        return None if kib is None else kib / 1024.0

    def metrics(self):
        """GET /metrics, lines without comments (None when the endpoint fails)."""
        try:
            status, text = http_get(self.port, "/metrics")
        except OSError:
            return None
        if status != 200:
            return None
        return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]

    def stop(self):
        """SIGTERM, then SIGKILL after 60 s. Returns the exit status."""
        if not self.proc:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log(f"{self.kind} ignored SIGTERM for 60 s; killing it")
                self.proc.kill()
                self.proc.wait()
        self.logf.close()
        return self.proc.returncode

    def log_tail(self, n=2000):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""


def ctx_per_seq(a):
    """Context per sequence/slot: prompt + generated tokens, rounded up to 256."""
    need = a.prompt_tokens + a.max_tokens
    return (need + 255) // 256 * 256


def loom_cmd(a, conc, adapters=(), lora_memory_mib=0):
    def make(port):
        cmd = [a.loom, "serve", "-m", a.model, "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
               "--max-seqs", str(conc), "--max-model-len", str(ctx_per_seq(a)),
               "--http-threads", str(max(64, conc + 8)), "--shutdown-grace", "5"]
        for name, path in adapters:
            cmd += ["--adapter", f"{name}={path}"]
        if adapters and lora_memory_mib:
            cmd += ["--max-lora-memory", f"{lora_memory_mib}M"]
        elif adapters:
            cmd += ["--max-loras", str(a.max_loras or len(adapters))]
        if adapters:
            cmd += ["--lora-bits", str(a.lora_bits)]
        return cmd + a.loom_arg
    return make


def llama_cmd(a, conc):
    def make(port):
        return [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(a.threads), "-tb", str(a.threads), "-np", str(conc),
                "-c", str(conc * ctx_per_seq(a)), "-cb", "--no-webui", "--metrics"] + a.llama_arg
    return make


# --------------------------------------------------------------------------------------------
# Load generator: one thread per concurrent client, a new connection per request.

def connect(port, timeout):
    """A new connection per request (llama-server sometimes drops kept-alive ones between
    requests), with TCP_NODELAY like curl, aiohttp and urllib3 set it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def one_request(conn, body):
    """Sends one streaming completion; returns a dict of timings (seconds) and counts."""
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        text = resp.read().decode("utf-8", "replace")
        return {"error": f"HTTP {resp.status}: {text[:300]}", "t0": t0}
    chunk_times = []   # arrival of every SSE chunk that carries generated text
    usage = None
    finish = None
    done = False
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        now = time.perf_counter()
        obj = json.loads(data)
        if "error" in obj:
            return {"error": f"stream error: {json.dumps(obj)[:300]}", "t0": t0}
        for ch in obj.get("choices") or []:
            if ch.get("text"):
                chunk_times.append(now)
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
        if obj.get("usage"):
            usage = obj["usage"]
    # Drain what is left so the connection can be reused.
    resp.read()
    t_end = time.perf_counter()
    if not done:
        return {"error": "stream ended without [DONE]", "t0": t0}
    tokens = usage.get("completion_tokens") if usage else None
    if tokens is None:
        tokens = len(chunk_times)
    return {
        "t0": t0, "t_end": t_end,
        "ttft": (chunk_times[0] - t0) if chunk_times else None,
        "itl": [b - c for c, b in zip(chunk_times, chunk_times[1:])],
        "chunks": len(chunk_times),
        "tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "finish": finish,
        "e2e": t_end - t0,
        "chunk_times": chunk_times,
    }


def run_load(port, conc, duration, make_body, timeout):
    """`conc` clients loop for `duration` s (requests in flight at the end finish). Returns
    (records, start, deadline, end) with perf_counter times."""
    records = []
    lock = threading.Lock()
    barrier = threading.Barrier(conc + 1)
    times = {}

    def client(cid):
        barrier.wait()
        i = 0
        while time.perf_counter() < times["deadline"]:
            body = make_body(cid, i)
            conn = connect(port, timeout)
            try:
                rec = one_request(conn, body)
            except (OSError, http.client.HTTPException, ValueError) as e:
                rec = {"error": f"{type(e).__name__}: {e}", "t0": time.perf_counter()}
            finally:
                conn.close()
            if "error" in rec:
                time.sleep(0.05)  # a failing server must not turn this into a busy loop
            rec["client"] = cid
            with lock:
                records.append(rec)
            i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(conc)]
    for t in threads:
        t.start()
    times["start"] = time.perf_counter()
    times["deadline"] = times["start"] + duration
    barrier.wait()
    for t in threads:
        t.join()
    return records, times["start"], times["deadline"], time.perf_counter()


def percentile(xs, q):
    """Linear-interpolated q-th percentile (0..100) of xs, None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records, start, deadline, end, max_tokens):
    ok = [r for r in records if "error" not in r]
    errors = [r["error"] for r in records if "error" in r]
    wall = end - start
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    # Chunks that arrived before the deadline, per second of the load window: a throughput
    # without the drain at the end (chunk ~ token; both servers stream one token per chunk).
    window_chunks = sum(1 for r in ok for t in r["chunk_times"] if t <= deadline)
    short = [r["tokens"] for r in ok if r["tokens"] != max_tokens]
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    return {
        "requests": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": wall,
        "completion_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else None,
        "req_s": len(ok) / wall if wall > 0 else None,
        "window_chunk_tok_s": window_chunks / (deadline - start),
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "itl_mean_ms": ms(sum(itl) / len(itl)) if itl else None,
        "e2e_p50_ms": ms(percentile(e2e, 50)), "e2e_p99_ms": ms(percentile(e2e, 99)),
        "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in ok)),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None}),
        "requests_not_max_tokens": len(short),
        "finish_reasons": sorted({str(r["finish"]) for r in ok}),
    }


def make_body_fn(a, kind, pool, models, max_tokens=None):
    """Request bodies: the same prompt/length/sampling for both servers; llama-server also gets
    its own names for the length (n_predict) and cache_prompt off."""
    counter = {"n": 0}
    lock = threading.Lock()
    n_gen = max_tokens or a.max_tokens

    def make(cid, i):
        with lock:  # round-robin over the models in arrival order
            m = models[counter["n"] % len(models)]
            counter["n"] += 1
        body = {"model": m, "prompt": request_prompt(pool, a.seed, cid, i),
                "max_tokens": n_gen, "temperature": 0, "seed": a.seed,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if kind == "llama.cpp":
            body["n_predict"] = n_gen
            body["cache_prompt"] = False
        return json.dumps(body).encode()
    return make


def warm_up(a, kind, port, pool, models, conc, limit=None):
    """One short request per model (every adapter gets loaded and touched; the first `limit`
    only), `conc` at a time; not measured. Raises RuntimeError when one fails."""
    pending = list(models)[:limit]
    errors = []
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not pending or errors:
                    return
                m = pending.pop()
            body = make_body_fn(a, kind, pool, [m], max_tokens=8)(-1, len(pending))
            conn = connect(port, a.request_timeout)
            try:
                r = one_request(conn, body)
            except (OSError, http.client.HTTPException, ValueError) as e:
                r = {"error": f"{type(e).__name__}: {e}"}
            finally:
                conn.close()
            if "error" in r:
                with lock:
                    errors.append(f"{m}: {r['error']}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(conc, len(models))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"warm-up request failed: {errors[0]}")


def bench_server(a, kind, cmd_fn, conc, pool, workdir, models=(MODEL_NAME,), label=None, warm_limit=None):
    """Starts one server, warms it up, runs the load, stops it. Returns a result dict."""
    srv = Server(kind, cmd_fn, workdir, a.start_timeout)
    res = {"server": kind, "concurrency": conc, "cmd": srv.cmd if len(srv.cmd) < 200 else srv.cmd[:40] + ["..."],
           "label": label}
    try:
        srv.start()
        res["startup_s"] = srv.start_s
        warm_up(a, kind, srv.port, pool, models, conc, warm_limit)
        rss_before = srv.peak_rss_mib()
        if a.wait_idle > 0:
            res["idle_check_cores"] = wait_idle(a.wait_idle, BUSY_CORES)
        cpu0, load0 = cpu_seconds(srv.proc.pid), os.getloadavg()[0]
        machine0, own0 = machine_busy_s(), own_cpu_s()
        records, start, deadline, end = run_load(srv.port, conc, a.duration,
                                                 make_body_fn(a, kind, pool, list(models)),
                                                 a.request_timeout)
        cpu1 = cpu_seconds(srv.proc.pid)
        machine1, own1 = machine_busy_s(), own_cpu_s()
        res.update(summarize(records, start, deadline, end, a.max_tokens))
        # Server CPU time over the load (cores busy on average) and the 1-minute load average
        # before and after it: a busy machine (others' builds) makes the numbers noise.
        res["server_cpu_s"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        res["server_cores_busy"] = None if res["server_cpu_s"] is None else res["server_cpu_s"] / res["wall_s"]
        res["loadavg_1m"] = [load0, os.getloadavg()[0]]
        # Cores the load generator (this process) and everything else on the machine used.
        res["client_cores_busy"] = (own1 - own0) / res["wall_s"]
        if res["server_cpu_s"] is not None:
            res["other_cores_busy"] = max(0.0, (machine1 - machine0 - (own1 - own0) - res["server_cpu_s"])
                                          / res["wall_s"])
        res["request_log"] = [
            {"client": r["client"], "t0_s": round(r["t0"] - start, 4),
             **({"error": r["error"]} if "error" in r else
                {"ttft_ms": None if r["ttft"] is None else round(r["ttft"] * 1000, 2),
                 "e2e_ms": round(r["e2e"] * 1000, 2), "tokens": r["tokens"], "chunks": r["chunks"]})}
            for r in sorted(records, key=lambda r: r["t0"])]
        res["peak_rss_mib"] = srv.peak_rss_mib()
        res["rss_after_warmup_mib"] = rss_before
        res["metrics"] = srv.metrics()
        if res["errors"]:
            log(f"{kind} c={conc}: {res['errors']} failed requests, e.g. {res['error_samples'][:2]}")
    except Exception as e:  # noqa: BLE001 - one failing server must not end the benchmark
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"{kind} c={conc}: {res['error']}")
    finally:
        res["exit_code"] = srv.stop()
        res["log_tail"] = srv.log_tail(3000)
    if res.get("output_tok_s") is not None:
        log(f"{kind} c={conc}{' ' + label if label else ''}: {res['output_tok_s']:.1f} tok/s, "
            f"{res['requests']} requests, peak RSS {fmt(res.get('peak_rss_mib'), 0)} MiB")
    return res


# --------------------------------------------------------------------------------------------
# Random PEFT LoRA adapters (no numpy/torch: random bytes with the float exponents pinned).

LORA_TARGETS = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]


ALL_TARGETS = [t for _, t in LORA_TARGETS]


def model_dims(a):
    """(layers, hidden, q_out, kv_out, ffn) from `loom info` (SmolLM2-135M's values otherwise)."""
    dims = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "ffn": 1536}
    try:
        p = subprocess.run([a.loom, "info", "-m", a.model], capture_output=True, text=True, timeout=120)
        for line in p.stdout.splitlines():
            k, _, v = line.partition(":")
            v = v.strip()
            if k == "layers":
                dims["layers"] = int(v)
            elif k == "hidden size":
                dims["hidden"] = int(v)
            elif k == "ffn size":
                dims["ffn"] = int(v)
            elif k == "heads":  # "9 (kv heads 3, head dim 64)"
                parts = v.replace("(", " ").replace(")", " ").replace(",", " ").split()
                dims["heads"], dims["kv_heads"], dims["head_dim"] = int(parts[0]), int(parts[3]), int(parts[6])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        log("loom info failed; using SmolLM2-135M's shapes for the adapters")
    q = dims["heads"] * dims["head_dim"]
    kv = dims["kv_heads"] * dims["head_dim"]
    return dims["layers"], dims["hidden"], q, kv, dims["ffn"]


def random_f32(rng, n, exp_byte):
    """n little-endian float32 values of random sign and mantissa, magnitude in
    [2^(2*exp_byte-127), 2^(2*exp_byte-125)): the top byte (sign + 7 exponent bits) is pinned."""
    data = bytearray(rng.randbytes(4 * n))
    table = bytes((b & 0x80) | exp_byte for b in range(256))
    data[3::4] = bytes(data[3::4]).translate(table)
    return data


def write_adapter(path, seed, dims, r=8, alpha=16, targets=None):
    targets = targets or ALL_TARGETS
    layers, hidden, q_out, kv_out, ffn = dims
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
              "o_proj": (q_out, hidden), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn),
              "down_proj": (ffn, hidden)}
    rng = random.Random(seed)
    header, blobs, off = {}, [], 0
    for i in range(layers):
        for block, t in LORA_TARGETS:
            if t not in targets:
                continue
            fan_in, fan_out = shapes[t]
            for which, shape, exp_byte in (("lora_A", [r, fan_in], 0x3D), ("lora_B", [fan_out, r], 0x3C)):
                # A ~ +-[2^-5, 2^-3) (about 1/sqrt(in)); B small: the base model's output stays sane.
                blob = random_f32(rng, shape[0] * shape[1], exp_byte)
                name = f"base_model.model.model.layers.{i}.{block}.{t}.{which}.weight"
                header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(blob)]}
                blobs.append(blob)
                off += len(blob)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((-(8 + len(hj))) % 64)  # data starts 64-byte aligned, so loom can map it
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
           "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "target_modules": [t for t in ALL_TARGETS if t in targets],
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def registered_adapters(adir, paths, n):
    """n adapter names for the registered mode: folder regNNNN with its own adapter_config.json and
    the weights of written adapter NNNN % len(paths) hard-linked (the server loads each name as its
    own adapter; the page cache holds the distinct files once)."""
    out = []
    for k in range(n):
        name = f"reg{k:04d}"
        p = os.path.join(adir, "registered", name)
        src = paths[k % len(paths)][1]
        if not os.path.isfile(os.path.join(p, "adapter_model.safetensors")):
            os.makedirs(p, exist_ok=True)
            shutil.copy(os.path.join(src, "adapter_config.json"), os.path.join(p, "adapter_config.json"))
            os.link(os.path.join(src, "adapter_model.safetensors"), os.path.join(p, "adapter_model.safetensors"))
        out.append((name, p))
    return out


# --------------------------------------------------------------------------------------------
# Output.

def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def md_table(head, rows):
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def result_cells(r):
    if r.get("output_tok_s") is None:
        return ["-"] * 8 + [r.get("error", "failed")[:80]]
    note = []
    if r["errors"]:
        note.append(f"{r['errors']} errors")
    if r["requests_not_max_tokens"]:
        note.append(f"{r['requests_not_max_tokens']} req != max_tokens")
    if r.get("error"):
        note.append(r["error"][:60])
    if (r.get("other_cores_busy") or 0) > BUSY_CORES:
        note.append(f"busy machine: others used {r['other_cores_busy']:.1f} cores")
    return [r["requests"], fmt(r["output_tok_s"]), fmt(r["req_s"], 2),
            fmt(r["ttft_p50_ms"], 0), fmt(r["ttft_p99_ms"], 0), fmt(r["itl_p50_ms"], 1),
            fmt(r["itl_p99_ms"], 1), fmt(r.get("peak_rss_mib"), 0), "; ".join(note)]


METRIC_HEAD = ["requests", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
               "ITL p50 ms", "ITL p99 ms", "peak RSS MiB", "note"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads for both servers")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma list of concurrent clients")
    ap.add_argument("--duration", type=float, default=30, help="seconds of load per run")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--prompt-tokens", type=int, default=160, help="prompt tokens per request")
    ap.add_argument("--adapters", default="1,8,64",
                    help="comma list of adapter counts for the loom adapters mode ('' or 0: skip)")
    ap.add_argument("--adapter-concurrency", type=int, default=16, help="clients in the adapters mode")
    ap.add_argument("--max-loras", type=int, default=0,
                    help="loom --max-loras in the adapters mode (default: the adapter count, all resident)")
    ap.add_argument("--adapter-rank", type=int, default=8, help="LoRA rank of the random adapters")
    ap.add_argument("--adapter-targets", default=",".join(ALL_TARGETS),
                    help="comma list of the projections the random adapters adapt (default: all seven; "
                         "PEFT's default for Llama models is q_proj,v_proj)")
    ap.add_argument("--lora-bits", type=int, default=16, choices=(32, 16, 8, 4),
                    help="loom --lora-bits in the adapters mode (16: bf16, the server's default; 32: f32, 8: int8, 4: 4-bit)")
    ap.add_argument("--registered", default="",
                    help="comma list of registered-adapter counts (e.g. 1000) served under an adapter memory "
                         "budget (LRU), requests round-robin over all of them ('': skip)")
    ap.add_argument("--lora-memory", type=float, default=0, metavar="MIB",
                    help="loom --max-lora-memory for the registered runs (default: room for 2 x "
                         "--adapter-concurrency adapters)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the adapters mode's servers this many times, interleaved; medians reported")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server")
    ap.add_argument("--no-loom", action="store_true", help="skip loom (and the adapters mode)")
    ap.add_argument("--loom", default=DEFAULT_LOOM, help="the loom binary")
    ap.add_argument("--llama-server", default=DEFAULT_LLAMA, help="the llama-server binary")
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="GGUF both servers load")
    ap.add_argument("--seed", type=int, default=1234, help="seed of prompts, nonces and adapters")
    ap.add_argument("--loom-arg", action="append", default=[], help="extra argument for loom serve (repeatable)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra argument for llama-server (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to get healthy")
    ap.add_argument("--request-timeout", type=float, default=600, help="socket timeout per request")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each run wait up to this long for other processes to leave the CPUs idle")
    ap.add_argument("--keep-adapters", help="write the adapters to this folder and keep them, reusing ones already there "
                         "(default: a temp dir, deleted at the end)")
    a = ap.parse_args()

    concs = [int(c) for c in a.concurrency.split(",") if c.strip()]
    adapter_counts = [int(c) for c in a.adapters.split(",") if c.strip() and int(c) > 0]
    registered_counts = [int(c) for c in a.registered.split(",") if c.strip() and int(c) > 0]
    a.adapter_targets = [t.strip() for t in a.adapter_targets.split(",") if t.strip()]
    bad = [t for t in a.adapter_targets if t not in ALL_TARGETS]
    if bad or not a.adapter_targets:
        raise SystemExit(f"--adapter-targets: {','.join(bad) or '(none)'} not among {','.join(ALL_TARGETS)}")
    a.adapter_targets = [t for t in ALL_TARGETS if t in a.adapter_targets]  # the canonical order
    if a.prompt_tokens <= NONCE_TOKENS:
        raise SystemExit(f"--prompt-tokens must be > {NONCE_TOKENS}")
    if not os.path.isfile(a.model):
        raise SystemExit(f"model {a.model} not found; run scripts/fetch_model")
    if not a.no_loom and not os.access(a.loom, os.X_OK):
        raise SystemExit(f"{a.loom} not built (cmake --build build --target loom), or use --no-loom")
    if not a.no_llama and not os.access(a.llama_server, os.X_OK):
        raise SystemExit(f"{a.llama_server} missing; run scripts/build_llamacpp, or use --no-llama")

    pool = build_prompt_pool(a)
    workdir = tempfile.mkdtemp(prefix="loom-bench-serve-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"date": stamp, "threads": a.threads, "duration_s": a.duration, "max_tokens": a.max_tokens,
            "prompt_tokens": a.prompt_tokens, "ctx_per_seq": ctx_per_seq(a), "seed": a.seed,
            "model": os.path.relpath(a.model, ROOT), "concurrency": concs, "adapters": adapter_counts,
            "adapter_rank": a.adapter_rank, "adapter_targets": a.adapter_targets, "lora_bits": a.lora_bits,
            "loadavg_start": os.getloadavg(), "host": platform.node(), "nproc": os.cpu_count(),
            "python": sys.version.split()[0], "runs": [], "adapter_runs": []}
    try:
        for conc in concs:
            if not a.no_loom:
                meta["runs"].append(bench_server(a, "loom", loom_cmd(a, conc), conc, pool, workdir))
            if not a.no_llama:
                meta["runs"].append(bench_server(a, "llama.cpp", llama_cmd(a, conc), conc, pool, workdir))

        if (adapter_counts or registered_counts) and not a.no_loom:
            adir = a.keep_adapters or os.path.join(workdir, "adapters")
            if a.adapter_targets != ALL_TARGETS:  # another set of files than the default's
                adir = os.path.join(adir, "targets-" + "-".join(a.adapter_targets))
            dims = model_dims(a)
            n_max = max(adapter_counts + ([64] if registered_counts else []))
            log(f"writing {n_max} random r={a.adapter_rank} adapters to {adir}")
            paths = []
            for k in range(n_max):
                p = os.path.join(adir, f"lora{k:02d}")
                if not os.path.isfile(os.path.join(p, "adapter_model.safetensors")):
                    write_adapter(p, f"{a.seed}/adapter/{k}", dims, r=a.adapter_rank, targets=a.adapter_targets)
                paths.append((f"lora{k:02d}", p))
            reg_paths = registered_adapters(adir, paths, max(registered_counts)) if registered_counts else []
            weights = os.path.getsize(os.path.join(paths[0][1], "adapter_model.safetensors"))
            lora_memory = a.lora_memory or 2 * a.adapter_concurrency * weights * a.lora_bits / 32 / 2**20
            runs = [(n, False) for n in adapter_counts] + [(n, True) for n in registered_counts]
            for rep in range(a.repeat):
                for n, registered in runs:
                    chosen = reg_paths[:n] if registered else paths[:n]
                    label = f"{n} registered" if registered else f"{n} adapters"
                    if a.repeat > 1:
                        label += f" (repetition {rep + 1})"
                    cmd = loom_cmd(a, a.adapter_concurrency, chosen, round(lora_memory) if registered else 0)
                    res = bench_server(a, "loom", cmd, a.adapter_concurrency, pool, workdir,
                                       models=tuple(name for name, _ in chosen), label=label,
                                       warm_limit=a.adapter_concurrency if registered else None)
                    res.update(n_adapters=n, registered=registered, repetition=rep, lora_bits=a.lora_bits,
                               lora_memory_mib=round(lora_memory) if registered else None)
                    meta["adapter_runs"].append(res)
    finally:
        meta["loadavg_end"] = os.getloadavg()
        shutil.rmtree(workdir, ignore_errors=True)

    # Tables.
    out = [f"serving: threads={a.threads} duration={a.duration:g}s prompt={a.prompt_tokens} "
           f"max_tokens={a.max_tokens} ctx/seq={ctx_per_seq(a)} model={os.path.basename(a.model)}", ""]
    if meta["runs"]:
        rows = [[r["concurrency"], r["server"]] + result_cells(r) for r in meta["runs"]]
        out += [md_table(["conc", "server"] + METRIC_HEAD, rows), ""]
        by = {(r["concurrency"], r["server"]): r.get("output_tok_s") for r in meta["runs"]}
        if not a.no_loom and not a.no_llama:
            rrows = []
            for c in concs:
                lo, ll = by.get((c, "loom")), by.get((c, "llama.cpp"))
                rrows.append([c, fmt(lo), fmt(ll), fmt(lo / ll, 2) if lo and ll else "-"])
            out += [md_table(["conc", "loom tok/s", "llama.cpp tok/s", "loom/llama.cpp"], rrows), ""]
    if meta["adapter_runs"]:
        def base_of(rep):
            return next((r.get("output_tok_s") for r in meta["adapter_runs"]
                         if r["n_adapters"] == 1 and not r["registered"] and r["repetition"] == rep), None)
        rows = []
        no_lora = next((r for r in meta["runs"] if r["server"] == "loom"
                        and r["concurrency"] == a.adapter_concurrency), None)
        if no_lora:
            base1 = base_of(0)
            rows.append(["0 (base)", a.adapter_concurrency] + result_cells(no_lora)[:-1] +
                        [fmt(no_lora["output_tok_s"] / base1, 2) if base1 and no_lora.get("output_tok_s") else "-",
                         result_cells(no_lora)[-1]])
        for r in meta["adapter_runs"]:
            cells = result_cells(r)
            base1 = base_of(r["repetition"])
            r["vs_1_adapter"] = r["output_tok_s"] / base1 if base1 and r.get("output_tok_s") else None
            name = f"{r['n_adapters']} registered ({r['lora_memory_mib']} MiB, LRU)" if r["registered"] \
                else str(r["n_adapters"])
            if a.repeat > 1:
                name += f" #{r['repetition'] + 1}"
            rows.append([name, r["concurrency"]] + cells[:-1] + [fmt(r["vs_1_adapter"], 2), cells[-1]])
        bits = {32: "f32", 16: "bf16", 8: "int8", 4: "4-bit"}[a.lora_bits]
        where = ("all 7 projections" if a.adapter_targets == ALL_TARGETS else "+".join(a.adapter_targets))
        out += [f"loom multi-LoRA (r={a.adapter_rank}, {where}, {bits} factors, round-robin over "
                f"adapters):", "", md_table(["adapters", "conc"] + METRIC_HEAD[:-1] + ["vs 1 adapter", "note"], rows),
                ""]
        if a.repeat > 1:
            srows = []
            for key in dict.fromkeys((r["n_adapters"], r["registered"]) for r in meta["adapter_runs"]):
                rs = [r for r in meta["adapter_runs"] if (r["n_adapters"], r["registered"]) == key]
                toks = [r["output_tok_s"] for r in rs if r.get("output_tok_s")]
                ratios = [r["vs_1_adapter"] for r in rs if r.get("vs_1_adapter")]
                srows.append([f"{key[0]} registered (LRU)" if key[1] else key[0], len(rs),
                              f"{fmt(percentile(toks, 50))} ({fmt(min(toks))}-{fmt(max(toks))})" if toks else "-",
                              f"{fmt(percentile(ratios, 50), 2)} ({fmt(min(ratios), 2)}-{fmt(max(ratios), 2)})"
                              if ratios else "-"])
            out += [f"medians over {a.repeat} interleaved repetitions (range in brackets; each ratio within its "
                    f"repetition):", "", md_table(["adapters", "runs", "output tok/s", "vs 1 adapter"], srows), ""]
    text = "\n".join(out)
    print(text)

    os.makedirs(RESULTS_DIR, exist_ok=True)
    base = os.path.join(RESULTS_DIR, f"serve-{stamp}-t{a.threads}")
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    log(f"raw results: {os.path.relpath(base, ROOT)}.json / .md")


if __name__ == "__main__":
    main()
