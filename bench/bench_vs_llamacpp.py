#!/usr/bin/env python3
"""Speed comparison of loom against llama.cpp (prompt processing and generation tokens/s).

Runs with plain python3 (standard library only). Needs llama.cpp's tools from
scripts/build_llamacpp and loom built in build/. See bench/README.md.

For each model type (Q4_1 = the default model, plus Q4_K_M, Q6_K, Q8_0 and F16 made from it with
llama-quantize --allow-requantize) it runs

    llama-bench -m F -t T -p P -n N -r R -o json
    build/loom bench -m F -t T -p P -n N -r R --json

and prints a table. loom's `bench --json` must print one JSON object on stdout (it may be
the last line, after other output) with at least:

    {"pp_tokens_per_s": <float>, "tg_tokens_per_s": <float>}

(optional: "pp_samples_tokens_per_s"/"tg_samples_tokens_per_s": per-repetition lists, used by
--stat best; "pp_stddev"/"tg_stddev").

pp = processing a P-token prompt in one batch, tg = generating N tokens one at a time,
both averaged over R repetitions - the same tests llama-bench calls ppP and tgN; with -d D
both start after D tokens already in the context (llama-bench's "tgN @ dD").
If loom fails or prints no such object, its column shows the reason and the run goes on.
Raw results go to bench/results/ (gitignored).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_LLAMA_BIN = os.path.join(ROOT, "third_party", "llama.cpp", "bin")
DEFAULT_LOOM = os.path.join(ROOT, "build", "loom")
RESULTS_DIR = os.path.join(ROOT, "bench", "results")


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(cmd, timeout):
    """Runs cmd, returns (returncode, stdout, stderr); never raises for a failing command."""
    log(" ".join(cmd))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except FileNotFoundError as e:
        return 127, "", str(e)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout} s"


def variant_path(base, qtype):
    """SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q8_0-from-Q4_1.gguf, next to it."""
    stem = os.path.basename(base)
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    name, _, src_type = stem.rpartition(".")
    if not name:
        name, src_type = stem, "base"
    return os.path.join(os.path.dirname(base), f"{name}.{qtype}-from-{src_type}.gguf")


def derived_model(base, qtype, llama_bin, timeout):
    """Makes (once) a qtype GGUF from the base model with llama-quantize --allow-requantize.

    The result carries the base model's Q4_1 rounding; that is fine for speed comparison."""
    out = variant_path(base, qtype)
    if os.path.exists(out) and os.path.getsize(out) > 0:
        return out
    quant = os.path.join(llama_bin, "llama-quantize")
    tmp = out + ".tmp"
    rc, so, se = run([quant, "--allow-requantize", base, tmp, qtype], timeout)
    if rc != 0:
        raise SystemExit(f"llama-quantize failed making {out} (rc {rc}):\n{(so + se)[-3000:]}")
    os.replace(tmp, out)
    return out


def llama_bench(llama_bin, model, a):
    cmd = [os.path.join(llama_bin, "llama-bench"), "-m", model, "-t", str(a.threads),
           "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "-o", "json"]
    if a.depth:
        cmd += ["-d", str(a.depth)]
    rc, so, se = run(cmd, a.timeout)
    res = {"cmd": cmd, "rc": rc, "stdout": so, "stderr_tail": se[-4000:], "pp": None, "tg": None}
    if rc != 0:
        res["error"] = f"llama-bench rc {rc}"
        return res
    try:
        rows = json.loads(so)
    except json.JSONDecodeError as e:
        res["error"] = f"llama-bench printed no JSON ({e})"
        return res
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            res["pp"] = {"avg": row["avg_ts"], "stddev": row.get("stddev_ts"),
                         "best": max(row.get("samples_ts") or [row["avg_ts"]])}
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            res["tg"] = {"avg": row["avg_ts"], "stddev": row.get("stddev_ts"),
                         "best": max(row.get("samples_ts") or [row["avg_ts"]])}
        res.setdefault("build_commit", row.get("build_commit"))
        res.setdefault("cpu_info", row.get("cpu_info"))
    return res


def parse_loom_json(stdout):
    """Finds the JSON object loom printed: the whole stdout, else the last line that parses."""
    text = stdout.strip()
    candidates = [text] + [ln.strip() for ln in reversed(text.splitlines())]
    for c in candidates:
        if c.startswith("{"):
            try:
                obj = json.loads(c)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def loom_bench(loom, model, a):
    cmd = [loom, "bench", "-m", model, "-t", str(a.threads), "-p", str(a.prompt),
           "-n", str(a.gen), "-r", str(a.reps), "--json"]
    if a.depth:
        cmd += ["-d", str(a.depth)]
    res = {"cmd": cmd, "pp": None, "tg": None}
    if not os.access(loom, os.X_OK):
        res["error"] = f"{os.path.relpath(loom, ROOT)} not built"
        return res
    rc, so, se = run(cmd, a.timeout)
    res.update({"rc": rc, "stdout": so, "stderr_tail": se[-4000:]})
    if rc != 0:
        last = (se.strip().splitlines() or ["?"])[-1]
        res["error"] = f"loom rc {rc}: {last[:120]}"
        return res
    obj = parse_loom_json(so)
    if obj is None:
        res["error"] = "loom printed no JSON object"
        return res
    res["json"] = obj
    for key, test in (("pp_tokens_per_s", "pp"), ("tg_tokens_per_s", "tg")):
        v = obj.get(key)
        if isinstance(v, (int, float)):
            samples = obj.get(f"{test}_samples_tokens_per_s")
            best = max(samples) if isinstance(samples, list) and samples else float(v)
            res[test] = {"avg": float(v), "stddev": obj.get(f"{test}_stddev"), "best": best}
        else:
            res.setdefault("error", f"loom JSON lacks numeric '{key}'")
    return res


def median_result(rounds, side, test, stat):
    """The program's figure for a test: the median over the rounds that have it."""
    vals = [r[side][test][stat] for r in rounds if r[side] and r[side][test]]
    return {stat: statistics.median(vals)} if vals else None


def round_ratios(rounds, test, stat):
    """loom / llama.cpp within each round (both programs ran back to back)."""
    out = []
    for r in rounds:
        lr = r["llama"][test] if r["llama"] else None
        mr = r["loom"][test] if r["loom"] else None
        if lr and mr and lr[stat] > 0:
            out.append(mr[stat] / lr[stat])
    return out


def fmt_ts(r, stat):
    return f"{r[stat]:.2f}" if r else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens for pp test")
    ap.add_argument("-n", "--gen", type=int, default=128, help="generated tokens for tg test")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-d", "--depth", type=int, default=0,
                    help="tokens already in the context before each test (llama-bench's -d): "
                         "decode at depth attends over them")
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="base (Q4_1) GGUF")
    ap.add_argument("--types", default="Q4_1,Q4_K_M,Q6_K,Q8_0,F16",
                    help="comma list; Q4_1 = the base model, others are made from it")
    ap.add_argument("--extra-models", default="",
                    help="comma list of more GGUF files run as they are (e.g. K-quant mixes of a model "
                         "whose widths are multiples of 256: SmolLM2's 576 makes llama-quantize fall back "
                         "to q5_0/q8_0 for most of its 'K' files)")
    ap.add_argument("--llama-bin", default=DEFAULT_LLAMA_BIN)
    ap.add_argument("--loom", default=DEFAULT_LOOM)
    ap.add_argument("--no-llama", action="store_true", help="skip llama-bench runs")
    ap.add_argument("--no-loom", action="store_true", help="skip loom runs")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per command")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the two programs this many times in turn per model; the table gives each "
                         "one's median and the median (min-max) of the per-round ratios")
    ap.add_argument("--stat", choices=("avg", "best"), default="avg",
                    help="avg of the repetitions (default) or the fastest one, which is less "
                         "disturbed by other load on a shared machine")
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {a.rounds}")

    if not os.path.isfile(a.model):
        raise SystemExit(f"model {a.model} not found; run scripts/fetch_model")
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    # llama-quantize only for variants not made yet (an AVX2-only --llama-bin may have just llama-bench).
    missing = [t for t in types if t != "Q4_1" and not os.path.exists(variant_path(a.model, t))]
    tools = ([] if a.no_llama else ["llama-bench"]) + (["llama-quantize"] if missing else [])
    for tool in tools:
        if not os.access(os.path.join(a.llama_bin, tool), os.X_OK):
            raise SystemExit(f"no {tool} in {a.llama_bin}; run scripts/build_llamacpp")

    models = []
    for t in types:
        path = a.model if t == "Q4_1" else derived_model(a.model, t, a.llama_bin, a.timeout)
        models.append((t, path))
    for path in (m.strip() for m in a.extra_models.split(",") if m.strip()):
        if not os.path.isfile(path):
            raise SystemExit(f"--extra-models: {path} not found")
        models.append((os.path.basename(path).removesuffix(".gguf"), path))

    results = []
    for t, path in models:
        entry = {"type": t, "model": os.path.relpath(path, ROOT), "rounds": []}
        # Rounds alternate the two programs, so a drift in the machine's speed hits both.
        for _ in range(a.rounds):
            entry["rounds"].append({"llama": None if a.no_llama else llama_bench(a.llama_bin, path, a),
                                    "loom": None if a.no_loom else loom_bench(a.loom, path, a)})
        entry["llama"], entry["loom"] = entry["rounds"][-1]["llama"], entry["rounds"][-1]["loom"]
        results.append(entry)

    # Table.
    rows = []
    for e in results:
        at = f" @ d{a.depth}" if a.depth else ""
        for test, label in (("pp", f"pp{a.prompt}{at}"), ("tg", f"tg{a.gen}{at}")):
            if (a.prompt if test == "pp" else a.gen) == 0:
                continue  # a test that was not run (-p 0 or -n 0)
            lr = median_result(e["rounds"], "llama", test, a.stat)
            mr = median_result(e["rounds"], "loom", test, a.stat)
            ratios = round_ratios(e["rounds"], test, a.stat)
            ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
            if len(ratios) > 1:
                ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
            note = "; ".join(e[side]["error"] for side in ("llama", "loom")
                             if e[side] and e[side].get("error") and not e[side][test])
            # Decode against the bandwidth floor: weight bytes per token x tokens/s over the
            # read bandwidth loom measured in its run (the same file for both programs).
            lf = mf = "-"
            lj = (e["loom"] or {}).get("json") or {}
            if test == "tg" and lj.get("read_gbps") and lj.get("weight_bytes_per_token"):
                # Against the best pass, and against the median pass where loom reported it.
                gbps = [lj["read_gbps"]] + ([lj["read_gbps_median"]] if lj.get("read_gbps_median") else [])

                def floor(r):
                    return " / ".join(f"{100 * r[a.stat] * lj['weight_bytes_per_token'] / (g * 1e9):.0f}%"
                                      for g in gbps) if r else "-"
                lf, mf = floor(lr), floor(mr)
            rows.append((e["type"], label, fmt_ts(lr, a.stat), fmt_ts(mr, a.stat), ratio, lf, mf, note))
    head = ("model", "test", "llama.cpp t/s", "loom t/s", "loom/llama.cpp", "llama.cpp floor (best / median)",
            "loom floor (best / median)", "note")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    table = "\n".join(lines)
    print(f"threads={a.threads} p={a.prompt} n={a.gen} r={a.reps} stat={a.stat} rounds={a.rounds}")
    print(table)

    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(RESULTS_DIR, f"{stamp}-t{a.threads}")
    meta = {"date": stamp, "threads": a.threads, "prompt": a.prompt, "gen": a.gen, "reps": a.reps,
            "stat": a.stat, "rounds": a.rounds, "loadavg": os.getloadavg(),
            "host": platform.node(), "nproc": os.cpu_count(), "results": results}
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"threads={a.threads} p={a.prompt} n={a.gen} r={a.reps} stat={a.stat} rounds={a.rounds}\n\n{table}\n")
    log(f"raw results: {os.path.relpath(base, ROOT)}.json / .md")


if __name__ == "__main__":
    main()
