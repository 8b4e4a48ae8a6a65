"""PNG plots of the cluster benchmark's summary.json files (throughput, time, CTTab, accuracy).

    python -m slimgc_mx.bench.plots --out docs/figures results/cluster/*/summary.json
Throughput summaries give throughput_F.png, time_F.png, wire_F.png and cttab_F.png, F being
the summary's result folder (e.g. vgg-2w-1gbit); accuracy summaries one accuracy_*.png, with
summaries of the same model, dataset and worker count drawn in one panel (a configuration
that several of them ran is drawn from the last one given).
"""
import argparse
import json
import os
import sys

DESCRIPTION = "plot cluster benchmark summaries (PNG)"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(summary):
    bw = summary.get("bandwidth") or "loopback, no limit"
    return "%s, %d workers + %d servers, %s" % (summary["model"], summary["workers"],
                                                 summary["servers"], bw)


def load(path):
    """A summary.json with its derived fields recomputed by the current definitions."""
    with open(path) as f:
        summary = json.load(f)
    summary["name"] = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if summary.get("mode") != "accuracy":
        from .cluster import add_derived
        add_derived(summary)
    return summary


def _save(fig, path):
    """Lay out, write the PNG and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def _label_configs(ax, rows, summary, ylabel):
    """Configuration names under the bars, the y label, the title and the legend."""
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["config"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(_title(summary), fontsize=9)
    ax.legend(fontsize=7)


def _ok(summary):
    return [r for r in summary["results"] if r.get("ok")]


def is_baseline(config):
    """True for the configurations SlimGC is compared against (drawn grey): MXNet's own,
    Horovod's, PyTorch's (DDP and its hooks) and the no-communication runs."""
    return (config in ("fp32", "mxnet-2bit", "no-comm")
            or config.startswith(("horovod-", "torch-")))


def throughput(summary, path):
    """Fig. 12: samples/s per worker normalized to mxnet-2bit (absolute value on each bar)."""
    plt = _plt()
    rows = _ok(summary)
    base = next((r["samples_per_s_per_worker"] for r in rows if r["config"] == "mxnet-2bit"), None)
    if not rows or not base:
        return False
    names = [r["config"] for r in rows]
    vals = [r["samples_per_s_per_worker"] / base for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    colors = ["#888888" if is_baseline(n) else "#2b6cb0" for n in names]
    spread = [[r["samples_per_s_per_worker"] - min(r.get("samples_per_s_runs") or [0]),
               max(r.get("samples_per_s_runs") or [0]) - r["samples_per_s_per_worker"]]
              for r in rows]
    err = None
    if any(r.get("samples_per_s_runs") for r in rows):  # min-max over the repeated runs
        err = [[max(0.0, lo) / base for lo, _ in spread], [max(0.0, hi) / base for _, hi in spread]]
    bars = ax.bar(range(len(rows)), vals, color=colors, yerr=err, capsize=3)
    for i, (b, r) in enumerate(zip(bars, rows)):
        top = b.get_height() + (err[1][i] if err else 0.0)  # above the error bar
        ax.text(b.get_x() + b.get_width() / 2, top, "%.1f" % r["samples_per_s_per_worker"],
                ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("throughput / mxnet-2bit")
    ax.set_title(_title(summary) + "\n(label: samples/s per worker)", fontsize=9)
    _save(fig, path)
    return True


def time_split(summary, path):
    """Fig. 13: step = compute + exposed; beside it the wire time + compression and what was hidden."""
    plt = _plt()
    rows = [r for r in _ok(summary) if r.get("time_composition_s") and r["config"] != "no-comm"]
    if not rows:
        return False
    tc = [r["time_composition_s"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows)), 4))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [t["compute"] for t in tc], w, label="compute (no-comm step)",
           color="#4a5568")
    ax.bar([i - w / 2 for i in x], [t["exposed"] for t in tc], w, bottom=[t["compute"] for t in tc],
           label="exposed comm.+compression", color="#e53e3e")
    wire_t = [t["wire"] or 0.0 for t in tc]
    ax.bar([i + w / 2 for i in x], wire_t, w, label="wire time at line rate", color="#3182ce")
    ax.bar([i + w / 2 for i in x], [t["compression"] for t in tc], w, bottom=wire_t,
           label="compression (kvstore timer)", color="#d69e2e")
    for i, t, wt in zip(x, tc, wire_t):
        if t["overlap"]:
            ax.text(i + w / 2, wt + t["compression"], "hidden %.2f" % t["overlap"],
                    ha="center", va="bottom", fontsize=6)
    _label_configs(ax, rows, summary, "seconds per step")
    _save(fig, path)
    return True


def wire(summary, path):
    """Bytes on the wire per step per worker (interface counters), both directions."""
    plt = _plt()
    rows = [r for r in _ok(summary) if r.get("wire_bytes_per_step_per_worker")
            and r["config"] != "no-comm"]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    tx = [r["wire_bytes_per_step_per_worker"]["tx"] / 1e6 for r in rows]
    rx = [r["wire_bytes_per_step_per_worker"]["rx"] / 1e6 for r in rows]
    ax.bar(range(len(rows)), tx, label="sent (tx)", color="#2f855a")
    ax.bar(range(len(rows)), rx, bottom=tx, label="received (rx)", color="#9ae6b4")
    ax.set_yscale("log")
    _label_configs(ax, rows, summary, "MB per step per worker (log)")
    _save(fig, path)
    return True


def cttab(summary, path, config=None):
    """Fig. 6: t_c vs t_c^q + t_p^q per tensor size, with the chosen threshold."""
    plt = _plt()
    rows = [r for r in _ok(summary) if r.get("cttab")]
    if config:
        rows = [r for r in rows if r["config"] == config]
    rows = sorted(rows, key=lambda r: not r["config"].endswith("2bit-full"))
    if not rows:
        return False
    r = rows[0]
    tab = r["cttab"]
    sizes = [t["size"] for t in tab]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(sizes, [t["t_c"] * 1e3 for t in tab], "o-", label="t_c (full precision)")
    ax.plot(sizes, [t["t_c_q"] * 1e3 for t in tab], "s-", label="t_c^q (compressed transfer)")
    ax.plot(sizes, [t["t_q"] * 1e3 for t in tab], "^-", label="t^q = t_c^q + t_p^q")
    if all("fit_t_c" in t for t in tab):  # the fitted link the 'fit' rule decides on
        ax.plot(sizes, [t["fit_t_c"] * 1e3 for t in tab], "--", color="C0", label="t_c fitted")
        ax.plot(sizes, [t["fit_t_q"] * 1e3 for t in tab], "--", color="C2", label="t^q fitted")
    ct = r.get("comm_threshold_bytes")
    if ct:
        ax.axvline(ct, color="r", ls="--", label="BestCT %s" % _bytes(ct))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("ms per transfer (median over warm-up)")
    ax.set_title("CTTab, %s: %s" % (r["config"], _title(summary)), fontsize=8)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True


def accuracy_panels(summaries):
    """Group accuracy summaries by (model, dataset, workers): runs of one setup share a panel.

    Within a panel a configuration's curve comes from the last summary that ran it, so a
    rerun of some configurations is drawn next to the baselines of the first run.
    """
    panels = {}
    for summary in summaries:
        key = (summary["model"], summary["dataset"], summary["workers"])
        panels.setdefault(key, []).append(summary)
    return list(panels.values())


def accuracy(summaries, path):
    """Fig. 9: test accuracy per epoch, mean over seeds with min-max band, per configuration."""
    plt = _plt()
    panels = accuracy_panels(summaries)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    drew = False
    for ax, group in zip(axes[0], panels):
        summary = group[0]
        by = {}
        for s in group:  # a later summary's runs replace an earlier one's of the same config
            mine = {}
            for r in _ok(s):
                if r.get("history"):
                    mine.setdefault(r["config"], []).append([h["test_acc"] for h in r["history"]])
            by.update(mine)
        for name, curves in by.items():
            n = min(len(c) for c in curves)
            cols = [[c[e] for c in curves] for e in range(n)]
            mean = [sum(v) / len(v) for v in cols]
            ep = list(range(1, n + 1))
            line, = ax.plot(ep, mean, label="%s (%d seeds)" % (name, len(curves)))
            ax.fill_between(ep, [min(v) for v in cols], [max(v) for v in cols],
                            color=line.get_color(), alpha=0.15)
            drew = True
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title("%s on %s, %d workers (%s)" % (
            summary["model"], summary["dataset"], summary["workers"],
            " + ".join(s.get("name", "") for s in group)), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def accuracy_markdown(summary):
    """Markdown table of one accuracy summary: final test accuracy per seed, mean, spread, BestCT."""
    by = {}
    for r in summary["results"]:
        by.setdefault(r["config"], []).append(r)
    out = ["**%s** (`%s`)" % (summary.get("name", summary["model"]), " ".join(summary["command"])),
           "", "| config | final test acc per seed | mean | min-max | BestCT per seed |",
           "|---|---|---|---|---|"]
    for name, runs in by.items():
        accs = [_first_acc(r) for r in runs]
        good = [a for a in accs if a is not None]
        cts = ["-" if r["config"] in ("fp32", "mxnet-2bit", "no-comm") else
               (_bytes(r["comm_threshold_bytes"]) if r.get("comm_threshold_bytes") is not None
                else "never" if r.get("comm_threshold_phase") == "trained" else "fixed")
               for r in runs]
        out.append("| %s | %s | %s | %s | %s |" % (
            name, " / ".join("failed" if a is None else "%.3f" % a for a in accs),
            "%.3f" % (sum(good) / len(good)) if good else "-",
            "%.3f-%.3f" % (min(good), max(good)) if good else "-", " / ".join(cts)))
    return "\n".join(out)


def _first_acc(record):
    """Final test accuracy of a run (every worker evaluates the same global weights)."""
    accs = [a for a in (record.get("final_test_acc") or {}).values() if a is not None]
    return accs[0] if record.get("ok") and accs else None


def markdown(summary):
    """Markdown tables of one throughput summary: speed, wire bytes, time composition."""
    rows = summary["results"]
    fp32 = next((r for r in rows if r["config"] == "fp32" and r.get("ok")), None)
    fp32_wire = ((fp32 or {}).get("wire_bytes_per_step_per_worker") or {}).get("total")
    out = ["**%s** (`%s`)" % (_title(summary), " ".join(summary["command"])), "",
           "| config | samples/s per worker | x mxnet-2bit | x fp32 | x no-comm | wire MB/step/worker "
           "(tx+rx) | wire / fp32 | step s | compute | exposed | wire at line rate | compression | "
           "overlap | blocked | BestCT |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if summary.get("repeats"):
        out[0] += (" Each row: the median of %d interleaved runs; samples/s of every run in "
                   "the second column's brackets." % summary["repeats"])
    for r in rows:
        if not r.get("ok"):
            out.append("| %s | failed (exit %s) |" % (r["config"], r.get("status")) + " |" * 13)
            continue
        vs = r.get("vs") or {}
        w = (r.get("wire_bytes_per_step_per_worker") or {}).get("total")
        tc = r.get("time_composition_s") or {}
        ct = r.get("comm_threshold_bytes")
        phase = r.get("comm_threshold_phase")

        def f(x, spec="%.2f"):
            return "-" if x is None else spec % x
        out.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["config"], f(r.get("samples_per_s_per_worker"), "%.1f") + _runs(r),
            f(vs.get("mxnet-2bit")),
            f(vs.get("fp32")), f(vs.get("no-comm")), f(w / 1e6 if w is not None else None, "%.3g"),
            f(w / fp32_wire if w is not None and fp32_wire else None, "%.3f"),
            f(r["step_s"]["median"], "%.3f"), f(tc.get("compute"), "%.3f"),
            f(tc.get("exposed"), "%.3f"), f(tc.get("wire"), "%.3f"),
            f(tc.get("compression"), "%.3f"), f(tc.get("overlap"), "%.3f"),
            f(tc.get("blocked"), "%.3f"),
            (_bytes(ct) if ct is not None else ("never" if phase == "trained" else "-"))))
    return "\n".join(out)


def _runs(row):
    runs = row.get("samples_per_s_runs")
    return " [%s]" % ", ".join("%.1f" % v for v in runs) if runs and len(runs) > 1 else ""


def _bytes(n):
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return "%.1f %s" % (n / size, unit)
    return "%d B" % n


def main(argv=None, prog="python -m slimgc_mx.bench.plots"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("summaries", nargs="+", help="summary.json files of the cluster benchmark")
    p.add_argument("--out", default="docs/figures", help="folder for the PNGs (default: %(default)s)")
    p.add_argument("--markdown", action="store_true",
                   help="print the throughput summaries as markdown tables instead of plotting")
    opts = p.parse_args(argv)
    if opts.markdown:
        for s in opts.summaries:
            summary = load(s)
            print((accuracy_markdown(summary) if summary.get("mode") == "accuracy"
                   else markdown(summary)) + "\n")
        return 0
    os.makedirs(opts.out, exist_ok=True)
    acc = []
    for s in opts.summaries:
        summary = load(s)
        if summary.get("mode") == "accuracy":
            acc.append(summary)
            continue
        name = summary["name"]
        for kind, fn in (("throughput", throughput), ("time", time_split), ("wire", wire),
                         ("cttab", cttab)):
            path = os.path.join(opts.out, "%s_%s.png" % (kind, name))
            if fn(summary, path):
                print("wrote %s" % path)
    if acc:
        path = os.path.join(opts.out, "accuracy_%s.png" % "_".join(s["name"] for s in acc))
        if accuracy(acc, path):
            print("wrote %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
