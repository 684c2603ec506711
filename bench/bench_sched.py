#!/usr/bin/env python3
"""Hardware-aware scheduling: `loom serve --itl-target-ms` against fixed token budgets.

Runs with plain python3 (standard library only) and reuses bench_serve.py's load generator.
See bench/README.md ("Serving: hardware-aware budgets").

For each CPU class asked for (LOOM_CPU masks: native, avx512, avx2) and each server setting
(fixed --max-batch-tokens budgets, then --itl-target-ms targets) the script starts `loom serve`
with --max-seqs C, warms it up (which also measures the step cost once per class; it is cached
in a scratch folder), then runs C streaming clients for --duration seconds. Prompts are long
(--prompt-tokens, default 512) against short answers (--max-tokens, default 64), so prompts are
prefilled while other sequences decode: the case where the budget decides the inter-token latency.

Reported per run: output tokens/s, TTFT p50/p99, ITL p50/p99/max, and goodput against each
target: the output tokens/s of requests whose time per output token after the first (TPOT,
DistServe's SLO) is within the target. The trade-off curve is throughput against ITL p99 over the
settings. Raw results go to bench/results/sched-<date>-t<T>.json, the tables to .md and stdout.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve as bs  # noqa: E402


def loom_sched_cmd(a, conc, setting, cache_dir):
    base = bs.loom_cmd(a, conc)

    def make(port):
        cmd = base(port) + ["--step-cost-cache", cache_dir]
        if setting["kind"] == "fixed":
            cmd += ["--max-batch-tokens", str(setting["value"])]
        else:
            cmd += ["--itl-target-ms", str(setting["value"])]
        return cmd
    return make


def goodput(res, target_ms, duration):
    """Output tokens/s of the requests whose TPOT (mean ITL after the first token) <= target."""
    ok = 0
    for r in res.get("_records", []):
        if "error" in r or len(r["chunk_times"]) < 2:
            continue
        tpot = (r["chunk_times"][-1] - r["chunk_times"][0]) / (len(r["chunk_times"]) - 1)
        if tpot * 1000.0 <= target_ms:
            ok += r["tokens"]
    return ok / res["wall_s"] if res.get("wall_s") else None


def run_setting(a, conc, setting, pool, workdir, cache_dir):
    """bench_serve.bench_server with the raw records kept (for goodput and ITL max)."""
    records_box = {}
    real_run_load = bs.run_load

    def run_load_keep(*args, **kw):
        out = real_run_load(*args, **kw)
        records_box["records"] = out[0]
        return out
    bs.run_load = run_load_keep
    try:
        res = bs.bench_server(a, "loom", loom_sched_cmd(a, conc, setting, cache_dir), conc, pool, workdir,
                              label=f"{setting['kind']} {setting['value']}")
    finally:
        bs.run_load = real_run_load
    res["setting"] = setting
    recs = records_box.get("records", [])
    res["_records"] = recs
    itl = [x for r in recs if "error" not in r for x in r["itl"]]
    res["itl_max_ms"] = max(itl) * 1000.0 if itl else None
    res["step_cost_log"] = [ln for ln in res.get("log_tail", "").splitlines() if "step cost" in ln or "itl-target" in ln]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16, help="clients (and --max-seqs)")
    ap.add_argument("--duration", type=float, default=30, help="seconds of load per run")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fixed", default="64,256,512", help="comma list of fixed --max-batch-tokens (256 is the default)")
    ap.add_argument("--targets", default="50,100,200", help="comma list of --itl-target-ms")
    ap.add_argument("--classes", default="native,avx2", help="comma list of LOOM_CPU values (native: unmasked)")
    ap.add_argument("--loom", default=bs.DEFAULT_LOOM)
    ap.add_argument("-m", "--model", default=bs.DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--loom-arg", action="append", default=[])
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each run wait up to this long for the machine to be idle")
    a = ap.parse_args()
    # What bench_serve's helpers read.
    a.no_loom, a.no_llama = False, True
    a.llama_server = bs.DEFAULT_LLAMA
    a.max_loras = 0
    targets = [float(x) for x in a.targets.split(",") if x]
    settings = ([{"kind": "fixed", "value": int(x)} for x in a.fixed.split(",") if x] +
                [{"kind": "target", "value": t} for t in targets])
    pool = bs.build_prompt_pool(a)
    results = []
    with tempfile.TemporaryDirectory(prefix="loom-bench-sched-") as workdir:
        for cls in [c for c in a.classes.split(",") if c]:
            if cls == "native":
                os.environ.pop("LOOM_CPU", None)
            else:
                os.environ["LOOM_CPU"] = cls
            cache_dir = os.path.join(workdir, f"step-cost-{cls}")
            for s in settings:
                res = run_setting(a, a.concurrency, s, pool, workdir, cache_dir)
                res["cpu_class"] = cls
                for t in targets:
                    res[f"goodput_{t:g}"] = goodput(res, t, a.duration)
                results.append(res)
    os.environ.pop("LOOM_CPU", None)

    head = ["class", "setting", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "ITL max ms"] + \
           [f"goodput @{t:g} ms" for t in targets]
    rows = []
    for r in results:
        s = r["setting"]
        name = f"--max-batch-tokens {s['value']}" if s["kind"] == "fixed" else f"--itl-target-ms {s['value']:g}"
        rows.append([r["cpu_class"], name, bs.fmt(r.get("output_tok_s")), bs.fmt(r.get("ttft_p50_ms"), 0),
                     bs.fmt(r.get("ttft_p99_ms"), 0), bs.fmt(r.get("itl_p50_ms")), bs.fmt(r.get("itl_p99_ms")),
                     bs.fmt(r.get("itl_max_ms"))] + [bs.fmt(r.get(f"goodput_{t:g}")) for t in targets])
    table = bs.md_table(head, rows)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    intro = (f"# loom serve: fixed budgets vs --itl-target-ms\n\n{cpu}, {a.threads} threads, {a.concurrency} clients, "
             f"prompts {a.prompt_tokens} tokens, {a.max_tokens} generated, {a.duration:g} s per run, "
             f"{os.path.basename(a.model)}\n\n")
    print(intro + table)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = os.path.join(bs.RESULTS_DIR, f"sched-{stamp}-t{a.threads}")
    os.makedirs(bs.RESULTS_DIR, exist_ok=True)
    for r in results:
        r.pop("_records", None)
        r.pop("request_log", None)
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(a), "results": results}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(intro + table + "\n")
    bs.log(f"wrote {out}.json and .md")


if __name__ == "__main__":
    main()
