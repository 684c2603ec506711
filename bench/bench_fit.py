#!/usr/bin/env python3
"""What LoRA-trains in a memory budget (default 24 GiB): loom against PEFT + transformers.

For each model shape (random weights: Llama-3.2-1B, Llama-3-8B) and each seq_len of a ladder, does one
LoRA step (r=16, alpha 32, all seven targets, batch 1, AdamW) fit in --budget-gib?

loom: the memory estimate `loom train` makes before its first step (train/memory.h; a run is refused
when it is above memory_limit), read from its `memory` log record with memory_limit set tiny (the run
stops right after the estimate, nothing is trained). Cases whose estimate is under --real-max-gib (and seq_len at most --real-max-seq) are
also run for real (--real-steps steps, memory_limit = the budget) and their peak RSS is reported beside
the estimate. The loom settings are options (--loom-set KEY=VALUE, repeatable; defaults: the memory
levers of issue 11), so the table can be rerun as features land. The model is a GGUF file
(models/random-<shape>.Q4_0.gguf by default: a q4_0 base).

PEFT: peak RSS (VmHWM, reset once the model is built, so the random initialisation's temporaries do
not count) of real steps of the same LoRA on a transformers LlamaForCausalLM built with random
weights in the same shape (no files), in two settings: its defaults (f32, no gradient checkpointing)
and its best memory settings on CPU (bf16 base weights, gradient checkpointing, non-reentrant). A
full model at every seq_len would not run on a 24 GiB machine, so PEFT is measured with the first
1 and 2 decoder layers (--peft-fit-layers) at two short seq_lens (--peft-fit-seqs) and its peak RSS extrapolated,
bilinearly in layers and tokens: RSS(L, S) = a + b S + L (c + d S) (activations and the loss's
logits grow with S; sdpa attention keeps no S x S matrix). Where the full model's extrapolated RSS
is under --real-max-gib it is also run for real, which checks the extrapolation. Every PEFT figure
says whether it is measured or extrapolated.

Usage: python3 bench/bench_fit.py [--models llama-3.2-1b,llama-3-8b] [--seqs 512,1024,...]
           [--loom build/loom] [--loom-set gradient_checkpointing=1 ...] [--real-max-gib 8]
           [--python .venv-ref/bin/python] [--no-peft] [--no-loom] [-t 2]
Results: a markdown table on stdout and bench/results/fit-<date>.{json,md}.
Run big cases one at a time on a shared machine: the script itself never runs two at once.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import make_data, memory_record, run_measured  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = float(1 << 30)

# scripts/make_random_model.py's shapes: hidden, layers, heads, kv_heads, head_dim, ffn, vocab, theta, tied.
SHAPES = {
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256,
                         theta=500000.0, tied=True),
    "llama-3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
                       theta=500000.0, tied=False),
    "smollm2-135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152,
                         theta=100000.0, tied=True),
}
LOOM_BEST = ["gradient_checkpointing=1", "activation_dtype=bf16", "optim.kind=adamw8bit", "backward=exact"]

PEFT_SIDE = r'''
import json, resource, sys, time
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
s = cfg["shape"]
dtype = torch.bfloat16 if cfg["bf16"] else torch.float32
torch.set_default_dtype(dtype)  # weights are created in it (no f32 copy first)
conf = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                   num_hidden_layers=cfg["layers"], num_attention_heads=s["heads"],
                   num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rope_theta=s["theta"],
                   max_position_embeddings=max(cfg["seq_len"], 2048), tie_word_embeddings=s["tied"],
                   rms_norm_eps=1e-5)
torch.manual_seed(0)
model = LlamaForCausalLM(conf)
if cfg["gc"]:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = get_peft_model(model, LoraConfig(r=cfg["r"], lora_alpha=2 * cfg["r"], lora_dropout=0.0,
                                         target_modules=cfg["targets"], task_type="CAUSAL_LM"))
model.train()
def vm_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
rss_loaded = vm_kib("VmRSS") / 1024.0
# The peak from here on: the training step's, not the random initialisation's temporaries.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
g = torch.Generator().manual_seed(1)
times = []
for step in range(cfg["steps"]):
    x = torch.randint(0, 49152, (1, cfg["seq_len"]), generator=g)
    t0 = time.perf_counter()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
print(json.dumps({"step_seconds": times, "loss": out.loss.item(), "rss_loaded_mib": rss_loaded,
                  "peak_step_mib": vm_kib("VmHWM") / 1024.0,
                  "torch": torch.__version__}))
'''


def log(msg):
    print(f"[fit] {msg}", file=sys.stderr, flush=True)


def loom_config(a, tmp, model, seq, steps, limit, tag):
    data = os.path.join(tmp, f"data-{seq}.jsonl")
    if not os.path.exists(data):
        make_data(data, steps + 4, seq)
    sets = {}
    for kv in a.loom_set:
        k, _, v = kv.partition("=")
        sets[k] = v
    optim = {"lr": "1e-4"}
    top = {}
    for k, v in sets.items():
        if k.startswith("optim."):
            optim[k[len("optim."):]] = v
        else:
            top[k] = v
    lines = [f"model: {model}", "data:", f"  train: {data}", "  format: text", f"  seq_len: {seq}",
             "lora:", f"  r: {a.rank}", f"  alpha: {2 * a.rank}", "  dropout: 0.0",
             f"  target_modules: [{', '.join(TARGETS)}]", "optim:"]
    lines += [f"  {k}: {v}" for k, v in optim.items()]
    lines += ["batch_size: 1", f"steps: {steps}", f"threads: {a.threads}", f"memory_limit: {limit}",
              "eval_interval: 0", f"output_dir: {os.path.join(tmp, 'out-' + tag)}", "overwrite: true"]
    lines += [f"{k}: {v}" for k, v in top.items()]
    path = os.path.join(tmp, f"loom-{tag}.yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def loom_case(a, tmp, name, model, seq):
    tag = f"{name}-{seq}"
    cfg = loom_config(a, tmp, model, seq, 1, "1MiB", tag + "-est")
    rc, out, err, peak, wall = run_measured([a.loom, "train", cfg, "--log-format", "json"])
    mem = memory_record(err)
    r = {"model": name, "seq_len": seq, "side": "loom", "settings": a.loom_set}
    if mem is None:
        r["error"] = err[-1500:]
        log(f"loom {tag}: no estimate (rc {rc}): {err[-300:]}")
        return r
    r["estimate_gib"] = mem["estimate"] / GIB
    r["arenas_gib"] = {k: v / GIB for k, v in mem["arenas"].items()}
    r["fits"] = r["estimate_gib"] <= a.budget_gib
    log(f"loom {tag}: estimate {r['estimate_gib']:.2f} GiB")
    if r["estimate_gib"] <= a.real_max_gib and seq <= a.real_max_seq:
        cfg = loom_config(a, tmp, model, seq, a.real_steps, f"{a.budget_gib}GiB", tag)
        rc, out, err, peak, wall = run_measured([a.loom, "train", cfg, "--log-format", "json"],
                                                timeout=a.real_timeout)
        r["real"] = {"rc": rc, "peak_rss_gib": peak / 1024.0, "wall_s": wall, "steps": a.real_steps}
        if rc != 0:
            r["real"]["error"] = err[-800:]
        log(f"loom {tag}: real run rc {rc}, peak RSS {peak / 1024.0:.2f} GiB, {wall:.0f} s")
    return r


# ------------------------------------------------------------------------------------------- PEFT

PEFT_MODES = {"default": dict(bf16=False, gc=False, label="PEFT defaults (f32, no checkpointing)"),
              "best": dict(bf16=True, gc=True, label="PEFT best (bf16 base, gradient checkpointing)")}


def peft_run(a, shape, mode, layers, seq, steps=1):
    m = PEFT_MODES[mode]
    cfg = {"threads": a.threads, "shape": shape, "layers": layers, "seq_len": seq, "bf16": m["bf16"],
           "gc": m["gc"], "r": a.rank, "targets": TARGETS, "steps": steps}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    rc, out, err, peak, wall = run_measured([a.python, "-c", PEFT_SIDE, json.dumps(cfg)], env,
                                            timeout=a.real_timeout)
    r = {"layers": layers, "seq_len": seq, "rc": rc, "process_peak_rss_gib": peak / 1024.0, "wall_s": wall}
    if rc == 0:
        r.update(json.loads([l for l in out.splitlines() if l.startswith("{")][-1]))
        r["peak_rss_gib"] = r["peak_step_mib"] / 1024.0  # VmHWM over the steps (reset after building the model)
    else:
        r["error"] = err[-800:]
    log(f"PEFT {mode} L={layers} S={seq}: rc {rc}, step peak {r.get('peak_rss_gib', float('nan')):.2f} GiB "
        f"(process {peak / 1024.0:.2f}), {wall:.0f} s")
    return r


def fit_bilinear(points):
    """RSS = a + b S + L (c + d S) through four measured (L, S, rss) points (L, S each two values)."""
    Ls = sorted({p[0] for p in points})
    Ss = sorted({p[1] for p in points})
    v = {(p[0], p[1]): p[2] for p in points}
    (L1, L2), (S1, S2) = Ls, Ss
    per_layer = {S: (v[(L2, S)] - v[(L1, S)]) / (L2 - L1) for S in Ss}  # c + d S
    fixed = {S: v[(L1, S)] - L1 * per_layer[S] for S in Ss}            # a + b S
    d = (per_layer[S2] - per_layer[S1]) / (S2 - S1)
    c = per_layer[S1] - d * S1
    b = (fixed[S2] - fixed[S1]) / (S2 - S1)
    a_ = fixed[S1] - b * S1
    return lambda L, S: a_ + b * S + L * (c + d * S), {"a": a_, "b": b, "c": c, "d": d}


def peft_cases(a, name, seqs):
    shape = SHAPES[name]
    rows = []
    for mode in a.peft_modes:
        pts, raw = [], []
        for L in a.peft_fit_layers:
            for S in a.peft_fit_seqs:
                r = peft_run(a, shape, mode, L, S)
                raw.append(r)
                if r["rc"] == 0:
                    pts.append((L, S, r["peak_rss_gib"]))
        if len(pts) < 4:
            rows.append({"model": name, "side": "peft", "mode": mode, "error": "fit runs failed", "fit_runs": raw})
            continue
        f, coef = fit_bilinear(pts)
        for S in seqs:
            est = f(shape["layers"], S)
            r = {"model": name, "seq_len": S, "side": "peft", "mode": mode, "extrapolated_gib": est,
                 "fits": est <= a.budget_gib, "fit": coef}
            if est <= a.real_max_gib and S <= a.real_max_seq:
                real = peft_run(a, shape, mode, shape["layers"], S)
                r["real"] = real
                if real["rc"] == 0:
                    r["fits"] = real["peak_rss_gib"] <= a.budget_gib
            rows.append(r)
        rows.append({"model": name, "side": "peft-fit", "mode": mode, "fit_runs": raw, "fit": coef})
    return rows


# ------------------------------------------------------------------------------------------- output

def cell_loom(r):
    if r is None:
        return "-"
    if "estimate_gib" not in r:
        return "error"
    s = f"{r['estimate_gib']:.1f}"
    real = r.get("real")
    if real and real["rc"] == 0:
        s += f" (RSS {real['peak_rss_gib']:.1f})"
    return ("**fits** " if r["fits"] else "no ") + s


def cell_peft(r):
    if r is None or "extrapolated_gib" not in r:
        return "-" if r is None else "error"
    real = r.get("real")
    if real and real["rc"] == 0:
        s = f"{real['peak_rss_gib']:.1f} measured"
    else:
        s = f"{r['extrapolated_gib']:.1f} extrap."
    return ("**fits** " if r["fits"] else "no ") + s


def tables(a, results, seqs):
    out = [f"LoRA r={a.rank} (all 7 targets), batch 1, one AdamW step; budget {a.budget_gib:g} GiB; GiB per case.",
           f"loom settings: {', '.join(a.loom_set) or 'defaults'}; base {a.loom_type} GGUF. "
           "loom: the estimate (peak RSS of a real run in parentheses); PEFT: peak RSS, measured or "
           "extrapolated from " + "/".join(map(str, a.peft_fit_layers)) + "-layer runs at seq_len " + ",".join(map(str, a.peft_fit_seqs)) + ".", ""]
    for name in a.models:
        head = ["seq_len", "loom"] + [PEFT_MODES[m]["label"] for m in a.peft_modes]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        largest = {}
        for S in seqs:
            lr = next((r for r in results if r["model"] == name and r["side"] == "loom" and r.get("seq_len") == S),
                      None)
            cells = [str(S), cell_loom(lr)]
            if lr and lr.get("fits"):
                largest["loom"] = S
            for m in a.peft_modes:
                pr = next((r for r in results if r["model"] == name and r["side"] == "peft" and r.get("mode") == m
                           and r.get("seq_len") == S), None)
                cells.append(cell_peft(pr))
                if pr and pr.get("fits"):
                    largest[m] = S
            lines.append("| " + " | ".join(cells) + " |")
        out += [f"{name}:", ""] + lines + [""]
        out.append(f"{name}: largest seq_len that fits: " +
                   ", ".join(f"{k} {v}" for k, v in largest.items()) + ("" if largest else "none"))
        out.append("")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("-r", "--rank", type=int, default=16)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/loom"))
    ap.add_argument("--loom-type", default="Q4_0", help="models/random-<shape>.<TYPE>.gguf")
    ap.add_argument("--loom-model", action="append", default=[], metavar="SHAPE=PATH",
                    help="the GGUF loom trains for SHAPE instead (e.g. one written with make_random_model.py "
                         "--context 131072, when the ladder goes past the default file's 8192)")
    ap.add_argument("--loom-set", action="append", default=None,
                    help=f"KEY=VALUE of the loom config (repeatable; default: {' '.join(LOOM_BEST)}); "
                         "'none' for loom's defaults")
    ap.add_argument("--real-max-gib", type=float, default=8.0,
                    help="run a case for real when its estimate / extrapolation is below this (this machine's RAM)")
    ap.add_argument("--real-max-seq", type=int, default=1024, help="and its seq_len at most this (run time)")
    ap.add_argument("--real-steps", type=int, default=1)
    ap.add_argument("--real-timeout", type=float, default=1800, help="seconds a real run may take")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv-ref/bin/python"))
    ap.add_argument("--peft-modes", default="default,best")
    ap.add_argument("--peft-fit-seqs", default="256,512")
    ap.add_argument("--peft-fit-layers", default="1,2",
                    help="the two layer counts PEFT is measured with (1,4 is steadier for 8B: the 1-to-2-layer "
                         "difference of one run is noisy)")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--no-loom", action="store_true")
    a = ap.parse_args()
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        if m not in SHAPES:
            raise SystemExit(f"--models: unknown shape '{m}' (known: {', '.join(SHAPES)})")
    seqs = [int(s) for s in a.seqs.split(",") if s]
    a.peft_fit_seqs = [int(s) for s in a.peft_fit_seqs.split(",") if s]
    if len(a.peft_fit_seqs) != 2:
        raise SystemExit("--peft-fit-seqs: give two seq_lens")
    a.peft_fit_layers = [int(s) for s in a.peft_fit_layers.split(",") if s]
    if len(a.peft_fit_layers) != 2 or min(a.peft_fit_layers) < 1:
        raise SystemExit("--peft-fit-layers: give two layer counts >= 1")
    a.peft_modes = [m for m in a.peft_modes.split(",") if m]
    for m in a.peft_modes:
        if m not in PEFT_MODES:
            raise SystemExit(f"--peft-modes: unknown mode '{m}' (known: {', '.join(PEFT_MODES)})")
    if a.loom_set is None:
        a.loom_set = list(LOOM_BEST)
    a.loom_set = [s for s in a.loom_set if s != "none"]
    if not a.no_loom and not os.access(a.loom, os.X_OK):
        raise SystemExit(f"{a.loom} not built (cmake --build build --target loom), or use --no-loom")

    tmp = tempfile.mkdtemp(prefix="loom_bench_fit_")
    results = []
    for name in a.models:
        if not a.no_loom:
            model = dict(kv.partition("=")[::2] for kv in a.loom_model).get(
                name, os.path.join(ROOT, "models", f"random-{name}.{a.loom_type}.gguf"))
            if not os.path.isfile(model):
                raise SystemExit(f"{model} missing: .venv-ref/bin/python scripts/make_random_model.py --shape {name} "
                                 f"--format gguf --type {a.loom_type.lower()}")
            for S in seqs:
                results.append(loom_case(a, tmp, name, model, S))
        if not a.no_peft:
            results += peft_cases(a, name, seqs)

    text = tables(a, results, seqs)
    print(text)
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    base = os.path.join(ROOT, "bench/results", f"fit-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "threads": a.threads,
            "budget_gib": a.budget_gib, "rank": a.rank, "loom_settings": a.loom_set, "loom_type": a.loom_type,
            "peft_fit_seqs": a.peft_fit_seqs, "seqs": seqs, "results": results}
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    log(f"raw results: {os.path.relpath(base, ROOT)}.json / .md")


if __name__ == "__main__":
    main()
