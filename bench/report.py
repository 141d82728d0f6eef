#!/usr/bin/python3
"""Turns normcore_bench's Google Benchmark JSON into bench/RESULTS.md and a chart.

    /usr/bin/python3 bench/report.py --markdown bench/RESULTS.md \
        --png bench/results.png results_t1.json results_t2.json

One JSON file per thread count. From each benchmark (named op/impl/shape) the
median over repetitions is used. For every op the markdown has a table per
thread count: GB/s of the minimum memory traffic for each implementation, the
fraction of the memcpy roofline that normcore reaches, and normcore's speed
against each peer (peer time / normcore time: above 1 means normcore is
faster). The PNG shows GB/s per op and shape, one panel per op and thread
count, with the memcpy roofline as a line.
"""

import argparse
import collections
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys

OP_ORDER = [
    "LN_fwd", "LN_fwd_stats", "LN_bwd", "RMS_fwd", "RMS_bwd",
    "BN_train_nchw", "BN_eval_nchw", "BN_bwd_nchw",
    "BN_train_nhwc", "BN_eval_nhwc", "BN_bwd_nhwc",
    "ADD_LN_fwd", "ADD_RMS_fwd",
    "LN_fwd_bf16", "LN_bwd_bf16", "RMS_fwd_bf16", "RMS_bwd_bf16", "ADD_LN_fwd_bf16", "ADD_RMS_fwd_bf16",
    "LN_fwd_f16", "LN_bwd_f16", "RMS_fwd_f16", "RMS_bwd_f16", "ADD_LN_fwd_f16", "ADD_RMS_fwd_f16",
    "BN_train_nchw_bf16", "BN_eval_nchw_bf16", "BN_bwd_nchw_bf16",
    "BN_train_nhwc_bf16", "BN_eval_nhwc_bf16", "BN_bwd_nhwc_bf16",
]
OP_TITLE = {
    "LN_fwd": "LayerNorm forward",
    "LN_fwd_stats": "LayerNorm forward, saving mean/rstd",
    "LN_bwd": "LayerNorm backward (dx, dweight, dbias)",
    "RMS_fwd": "RMSNorm forward",
    "RMS_bwd": "RMSNorm backward (dx, dweight)",
    "BN_train_nchw": "BatchNorm forward, training, NCHW",
    "BN_eval_nchw": "BatchNorm forward, eval, NCHW",
    "BN_bwd_nchw": "BatchNorm backward, NCHW",
    "BN_train_nhwc": "BatchNorm forward, training, channels-last",
    "BN_eval_nhwc": "BatchNorm forward, eval, channels-last",
    "BN_bwd_nhwc": "BatchNorm backward, channels-last",
    "ADD_LN_fwd": "fused h = x + residual, y = LayerNorm(h), float",
    "ADD_RMS_fwd": "fused h = x + residual, y = RMSNorm(h), float",
}
for _p, _name in (("bf16", "bfloat16"), ("f16", "half")):
    for _op in ("LN_fwd", "LN_bwd", "RMS_fwd", "RMS_bwd", "ADD_LN_fwd", "ADD_RMS_fwd", "BN_train_nchw",
                "BN_eval_nchw", "BN_bwd_nchw", "BN_train_nhwc", "BN_eval_nhwc", "BN_bwd_nhwc"):
        OP_TITLE[f"{_op}_{_p}"] = OP_TITLE.get(_op, OP_TITLE.get(_op)) + f", {_name} storage" \
            if _op in OP_TITLE else _op
OP_TITLE.update({k: v.replace(", float,", ",") for k, v in OP_TITLE.items() if k.startswith("ADD_") and "storage" in v})
IMPL_ORDER = ["normcore", "normcore_1thread", "normcore_unfused", "reference", "eigen", "torch", "onednn",
              "memcpy"]
PEERS = ["normcore_1thread", "normcore_unfused", "reference", "eigen", "torch", "onednn"]
# Not peers for "normcore ÷ fastest peer": the reference path, and normcore's
# own unfused pair and 1-thread runs in a multi-thread run (each shown per op
# as its own ratio).
NOT_PEERS = {"reference", "normcore_unfused", "normcore_1thread"}
COLORS = {"normcore": "#d62728", "reference": "#7f7f7f", "eigen": "#2ca02c",
          "torch": "#ff7f0e", "onednn": "#1f77b4", "memcpy": "#000000",
          "normcore_unfused": "#e377c2", "normcore_1thread": "#8c564b"}


def shape_key(shape):
    return tuple(int(v) for v in shape.split("x"))


def load(path):
    """Returns (threads, context, {(op, impl, shape): entry})."""
    with open(path) as f:
        data = json.load(f)
    ctx = data.get("context", {})
    runs = collections.defaultdict(list)
    medians = {}
    errors = {}
    for b in data.get("benchmarks", []):
        name = b.get("run_name", b["name"])
        # op/impl/shape, then Google Benchmark's own suffixes
        # (/iterations:N, /real_time) which are dropped.
        parts = [p for p in name.split("/") if not re.match(r"^(iterations|repeats|min_time):|^real_time$", p)]
        if len(parts) != 3:
            continue
        key = tuple(parts)
        if b.get("error_occurred"):
            errors[key] = b.get("error_message", "error")
            continue
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                medians[key] = b
        else:
            runs[key].append(b)
    out = {}
    for key in set(runs) | set(medians) | set(errors):
        if key in errors:
            out[key] = {"error": errors[key]}
            continue
        if key in medians:
            b = medians[key]
            gbps = b["bytes_per_second"] / 1e9
            nspe = b.get("ns_per_elem", float("nan"))
            err = b.get("rel_err_out")
        else:
            rs = runs[key]
            gbps = statistics.median(r["bytes_per_second"] for r in rs) / 1e9
            nspe = statistics.median(r.get("ns_per_elem", float("nan")) for r in rs)
            err = rs[0].get("rel_err_out") if rs else None
        n = len(runs.get(key, [])) or 1
        out[key] = {"gbps": gbps, "ns_per_elem": nspe, "repetitions": n}
        if err is not None:
            out[key]["rel_err"] = err
    threads = int(ctx.get("threads", "0") or 0)
    return threads, ctx, out


def lscpu():
    info = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return info
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            info[k.strip()] = v.strip()
    return info


def isa_summary(flags):
    have = set(flags.split())
    wanted = ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile"]
    return " ".join(f for f in wanted if f in have) or "unknown"


def fmt_gbps(e):
    if e is None:
        return "–"
    if "error" in e:
        return "ERROR"
    return f"{e['gbps']:.1f}" + ("†" if "rel_err" in e else "")


def fmt_ratio(a, b):
    if a is None or b is None or "error" in a or "error" in b or b["gbps"] <= 0:
        return "–"
    return f"{a['gbps'] / b['gbps']:.2f}×"


def machine_section(ctxs, cxx_flags):
    cpu = lscpu()
    ctx = ctxs[0] if ctxs else {}
    lines = ["## Machine", ""]
    rows = [
        ("CPU", cpu.get("Model name", "unknown")),
        ("Cores / threads per core", f"{cpu.get('CPU(s)', '?')} / {cpu.get('Thread(s) per core', '?')}"),
        ("ISA (lscpu flags)", isa_summary(cpu.get("Flags", ""))),
        ("Caches", ", ".join(f"{k} {cpu[k]}" for k in ("L1d cache", "L2 cache", "L3 cache") if k in cpu) or "not reported by lscpu"),
        ("Caches, as normcore reads them", ctx.get("normcore_caches", "?")),
        ("Hypervisor", cpu.get("Hypervisor vendor", "none")),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Compiler", ctx.get("compiler", "unknown")),
        ("Flags (bench target)", ctx.get("cxx_flags", cxx_flags or "unknown")),
        ("normcore", f"{ctx.get('normcore_version', '?')}, built for {ctx.get('normcore_isa', '?')}, on an Eigen::ThreadPoolDevice when threads > 1 (the caller and a pool of threads - 1)"),
        ("Eigen", ctx.get("eigen_version", "?")),
        ("libtorch", ctx.get("libtorch", "not built")),
        ("oneDNN", ctx.get("onednn", "not built")),
        ("ATEN_CPU_CAPABILITY", ctx.get("ATEN_CPU_CAPABILITY", "?")),
        ("malloc tuning", ctx.get("malloc_tuning", "?")),
        ("Google Benchmark library build", ctx.get("library_build_type", "?")),
        ("Run", ctx.get("date", datetime.datetime.now().isoformat(timespec="seconds"))),
    ]
    lines.append("| | |")
    lines.append("|---|---|")
    for k, v in rows:
        lines.append(f"| {k} | {v} |")
    lines.append("")
    return lines


def op_table(op, results, threads):
    keys = [k for k in results if k[0] == op]
    if not keys:
        return []
    shapes = sorted({k[2] for k in keys}, key=lambda s: (len(s.split("x")), shape_key(s)))
    impls = [i for i in IMPL_ORDER if any(k[1] == i for k in keys)]
    peers = [p for p in PEERS if p in impls]
    head = ["shape"] + [f"{i} GB/s" for i in impls]
    if "normcore" in impls:
        head += ["normcore / memcpy"] + [f"÷ {p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in shapes:
        e = {i: results.get((op, i, s)) for i in impls}
        row = [s] + [fmt_gbps(e[i]) for i in impls]
        if "normcore" in impls:
            nc, cp = e["normcore"], e.get("memcpy")
            if nc and cp and "error" not in nc and "error" not in cp and cp["gbps"] > 0:
                row.append(f"{100 * nc['gbps'] / cp['gbps']:.0f}%")
            else:
                row.append("–")
            row += [fmt_ratio(nc, e[p]) for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary_table(per_threads):
    """normcore ÷ the fastest peer, per op and shape, for each thread count."""
    lines = ["| op | shape | " + " | ".join(f"{t} thr: normcore ÷ fastest peer" for t, _ in per_threads) + " |",
             "|---|---|" + "---|" * len(per_threads)]
    all_keys = set()
    for _, res in per_threads:
        all_keys |= {(k[0], k[2]) for k in res if k[1] == "normcore"}
    for op in OP_ORDER:
        for s in sorted({k[1] for k in all_keys if k[0] == op},
                        key=lambda s: (len(s.split("x")), shape_key(s))):
            cells = []
            for _, res in per_threads:
                nc = res.get((op, "normcore", s))
                best = None
                for p in PEERS:
                    if p in NOT_PEERS:
                        continue
                    e = res.get((op, p, s))
                    if e and "error" not in e and (best is None or e["gbps"] > best[1]["gbps"]):
                        best = (p, e)
                if nc and best and "error" not in nc:
                    cells.append(f"{nc['gbps'] / best[1]['gbps']:.2f}× vs {best[0]}")
                else:
                    cells.append("–")
            lines.append(f"| {op} | {s} | " + " | ".join(cells) + " |")
    return lines


# normcore::detail::kMinElementsPerThread: smaller calls run on the calling
# thread whatever the device.
TINY_ELEMENTS = 32768


def same_process_threads_table(per_threads):
    """normcore on N threads ÷ normcore on the calling thread alone
    (normcore_1thread), both timed in the N-thread run, on every shape that
    has both."""
    lines, tiny, large = [], [], []
    for t, res in per_threads:
        for op in OP_ORDER:
            for s in sorted({k[2] for k in res if k[0] == op and k[1] == "normcore_1thread"},
                            key=lambda s: (len(s.split("x")), shape_key(s))):
                nc, one = res.get((op, "normcore", s)), res.get((op, "normcore_1thread", s))
                if not nc or not one or "error" in nc or "error" in one:
                    continue
                ratio = nc["gbps"] / one["gbps"]
                dims = shape_key(s)
                if math.prod(dims) < TINY_ELEMENTS:
                    tiny.append(ratio)
                elif op.startswith("BN_") or dims[0] >= 512:
                    large.append(ratio)
                lines.append(f"| {t} | {op} | {s} | {fmt_gbps(one)} | {fmt_gbps(nc)} | {ratio:.2f}× |")
    if not lines:
        return []

    counts = []
    if large:
        counts.append(f"at least 512 rows (and every BatchNorm shape): {sum(r >= 1.7 for r in large)} of "
                      f"{len(large)} cells at 1.7× or more, median {statistics.median(large):.2f}×")
    if tiny:
        counts.append(f"under {TINY_ELEMENTS} elements: {sum(r >= 1.0 for r in tiny)} of {len(tiny)} cells at 1× or "
                      f"more, from {min(tiny):.2f}× to {max(tiny):.2f}×")
    return ["## Threads, in one process", "",
            "normcore on a device of N threads against normcore on the calling thread alone "
            "(`normcore_1thread`), both timed in the N-thread run, and the speed ratio (1-thread "
            f"time ÷ N-thread time; 1× or more is never slower). Shapes under {TINY_ELEMENTS} elements run on "
            "the calling thread with or without a device. Timed in one process, these ratios do not "
            "carry the drift between the 1- and N-thread processes that the per-op tables' "
            "1-thread and 2-thread columns do.", "",
            "Shapes of " + "; shapes ".join(counts) + ".", "",
            "| threads | op | shape | 1 thread GB/s | N threads GB/s | N threads ÷ 1 thread |",
            "|---|---|---|---|---|---|"] + lines + [""]


def write_markdown(path, per_threads, ctxs, cxx_flags, png_name):
    out = ["# normcore benchmark results", "",
           "Generated by `bench/report.py` from the Google Benchmark JSON of "
           "`cmake --workflow --preset bench`; do not edit by hand.", "",
           "GB/s counts the minimum memory traffic only (forward: read x, write y; backward: read x "
           "and dy, write dx; parameters and statistics not counted). Each number is the median over "
           "the repetitions. `normcore / memcpy` is the fraction of the copy roofline (a memcpy moving "
           "the same bytes). `÷ peer` is normcore's speed relative to that peer (peer time / normcore "
           "time: above 1× normcore is faster). In the 2-thread tables every implementation uses 2 "
           "threads (normcore an Eigen::ThreadPoolDevice of 2 threads: the calling thread and a pool "
           "of 1; the Eigen baseline a pool of 2, its calling thread waiting; libtorch and oneDNN "
           "OpenMP; the memcpy an OpenMP split). "
           "The machine is a shared 2-core VM (another build may be running), so small differences are "
           "noise, and the 2-thread numbers of small shapes mostly measure thread wake-up latency.", "",
           "Ops ending in `_bf16` / `_f16` store activations and parameters in bfloat16 / half (arithmetic "
           "in float); GB/s counts 2 bytes per value. `ADD_*` ops are the fused residual norms (read x and "
           "the residual, write h and y); `normcore_unfused` is the unfused pair (one vectorized add pass, "
           "then the norm). † marks a peer whose 16-bit results missed the verification tolerance (timed "
           "anyway; see `normcore_bench --verify`).", ""]
    out += machine_section(ctxs, cxx_flags)
    out += ["## Summary: normcore ÷ the fastest peer (torch, oneDNN, Eigen)", ""]
    out += summary_table(per_threads)
    out += [""] + same_process_threads_table(per_threads)
    out += [f"![GB/s per op and shape]({png_name})", ""]
    for op in OP_ORDER:
        sections = []
        for t, res in per_threads:
            tbl = op_table(op, res, t)
            if tbl:
                sections += [f"**{t} thread{'s' if t != 1 else ''}**", ""] + tbl + [""]
        if sections:
            out += [f"## {op}: {OP_TITLE.get(op, op)}", ""] + sections
    errors = [(t, k, e["error"]) for t, res in per_threads for k, e in res.items() if "error" in e]
    if errors:
        out += ["## Errors", ""]
        out += [f"- {t} thread(s), {'/'.join(k)}: {msg}" for t, k, msg in sorted(errors)]
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))


def write_png(path, per_threads):
    """The figure; without matplotlib, none (returns False)."""
    try:
        import matplotlib
    except ImportError:
        print(f"report.py: matplotlib is not installed (Debian: python3-matplotlib); "
              f"{path} not written", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OP_ORDER if any(k[0] == op for _, res in per_threads for k in res)]
    if not ops:
        return False
    ncols = len(per_threads)
    fig, axes = plt.subplots(len(ops), ncols, figsize=(7.5 * ncols, 2.8 * len(ops)), squeeze=False)
    for col, (t, res) in enumerate(per_threads):
        for row, op in enumerate(ops):
            ax = axes[row][col]
            keys = [k for k in res if k[0] == op and "error" not in res[k]]
            shapes = sorted({k[2] for k in keys}, key=lambda s: (len(s.split("x")), shape_key(s)))
            impls = [i for i in IMPL_ORDER if i != "memcpy" and any(k[1] == i for k in keys)]
            width = 0.8 / max(1, len(impls))
            for j, impl in enumerate(impls):
                xs, ys = [], []
                for x, s in enumerate(shapes):
                    e = res.get((op, impl, s))
                    if e and "error" not in e:
                        xs.append(x - 0.4 + width * (j + 0.5))
                        ys.append(e["gbps"])
                ax.bar(xs, ys, width, label=impl, color=COLORS.get(impl))
            for x, s in enumerate(shapes):
                e = res.get((op, "memcpy", s))
                if e and "error" not in e:
                    ax.hlines(e["gbps"], x - 0.45, x + 0.45, colors="black", linestyles="dashed",
                              label="memcpy" if x == 0 else None)
            ax.set_yscale("log")
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=7, rotation=20)
            ax.set_ylabel("GB/s")
            ax.set_title(f"{op} — {t} thread{'s' if t != 1 else ''}", fontsize=9)
            ax.grid(axis="y", which="both", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="Google Benchmark JSON, one per thread count")
    ap.add_argument("--markdown", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--cxx-flags", default="")
    args = ap.parse_args()
    per_threads, ctxs = [], []
    for p in args.json:
        t, ctx, res = load(p)
        per_threads.append((t, res))
        ctxs.append(ctx)
    per_threads.sort(key=lambda x: x[0])
    write_markdown(args.markdown, per_threads, ctxs, args.cxx_flags, os.path.basename(args.png))
    if write_png(args.png, per_threads):
        print(f"report.py: wrote {args.markdown} and {args.png}")
    else:
        print(f"report.py: wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
