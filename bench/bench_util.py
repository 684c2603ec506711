"""Helpers the training benchmarks share: run a command measuring its peak RSS, make long text rows,
steady-state tokens/s, and read loom's `memory` record from its JSON log lines."""
import json
import os
import random
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_measured(cmd, env=None, timeout=None):
    """Runs cmd (killed after `timeout` seconds when given); returns (returncode, stdout, stderr,
    peak RSS of that process in MiB, wall seconds)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # wait4: this child's own rusage (ru_maxrss in KiB on Linux)
            pid, status, usage = os.wait4(p.pid, 0 if deadline is None else os.WNOHANG)
            if pid != 0:
                break
            if time.monotonic() > deadline:
                p.kill()
                pid, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.2)
        rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read(), usage.ru_maxrss / 1024.0, time.perf_counter() - t0


def make_data(path, n_rows, seq_len):
    """Long English-like texts (every one well over seq_len tokens)."""
    rng = random.Random(0)
    words = []
    for name in ("README.md", "docs/architecture.md", "docs/training.md"):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            words += f.read().split()
    with open(path, "w") as f:
        for _ in range(n_rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(2 * seq_len))}) + "\n")


def steady_tokens_per_s(step_seconds, tokens_per_step):
    """Tokens/s over the steps after the first (warm-up)."""
    rest = step_seconds[1:] if len(step_seconds) > 1 else step_seconds
    return tokens_per_step * len(rest) / sum(rest)


def memory_record(stderr_text):
    """The `memory` record (its loom.memory object) of `loom train --log-format json`, or None."""
    for line in stderr_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if j.get("event", {}).get("action") == "memory" and "memory" in j.get("loom", {}):
            return j["loom"]["memory"]
    return None
