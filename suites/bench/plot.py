"""PNG plots (matplotlib, Agg) from the benchmark scripts' JSON: ms vs tokens per backend
(bench_kernels), layer ms vs tokens per TP/CP (bench_layers), the breakdown bars (bench_breakdown), the
time against fla's layers (bench_vs_fla), the error vs decode step (bench_long_decode).

The scripts draw them with --plot DIR; to re-plot saved results (needs matplotlib, not torch):

    python suites/bench/plot.py results/kernels.json results/layers.json --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def tokens_label(T: int) -> str:
    """How tables and plots name a token count: 4096 -> '4k'."""
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def plot(payload: dict, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, bench = payload["rows"], payload["bench"]
    where = f"{payload['machine'].get('device')}, {payload['machine'].get('date', '')[:10]}"
    written = []

    def save(fig, name):
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def lines(ax, series, title):
        for label, points in series.items():
            points = sorted(p for p in points if p[1] is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        linestyle="--" if label.startswith("auto") else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms (fwd + bwd)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    if bench == "kernels":
        for shape, tp in sorted({(r["shape"], r["tp"]) for r in rows}):
            ops = sorted({r["op"] for r in rows if r["shape"] == shape and r["tp"] == tp})
            fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 3.8), squeeze=False)
            for ax, op in zip(axes[0], ops):
                series = {}
                for r in rows:
                    if (r["shape"], r["tp"], r["op"]) == (shape, tp, op):
                        series.setdefault(r["backend"], []).append((r["tokens"], r.get("ms")))
                lines(ax, series, f"{op} @ {shape}" + (f" tp{tp}" if tp > 1 else "") + f" ({where})")
            save(fig, f"kernels_{shape}" + (f"_tp{tp}" if tp > 1 else "") + ".png")
    elif bench == "layers":
        for shape in sorted({r["shape"] for r in rows}):
            fig, ax = plt.subplots(figsize=(6, 4))
            series = {}
            for r in rows:
                if r["shape"] == shape:
                    series.setdefault(f"tp{r['tp']} cp{r['cp']}", []).append((r["tokens"], r.get("ms")))
            lines(ax, series, f"layer {shape} ({where}), ms per rank")
            save(fig, f"layers_{shape}.png")
    elif bench == "breakdown":
        parts = payload.get("parts", [])
        ok = [r for r in rows if r.get("ms") is not None]
        if ok:
            fig, ax = plt.subplots(figsize=(8, 0.5 * len(ok) + 1.5))
            labels = [f"{r['shape']} {tokens_label(r['tokens'])} tp{r['tp']} cp{r['cp']}" for r in ok]
            left = [0.0] * len(ok)
            for part in parts + ["glue"]:
                widths = [max(r.get(part) or 0.0, 0.0) for r in ok]
                ax.barh(labels, widths, left=left, label=part)
                left = [a + b for a, b in zip(left, widths)]
            ax.set_xlabel("ms (fwd + bwd)")
            ax.set_title(f"one layer step ({where})", fontsize=9)
            ax.legend(fontsize=7, ncol=3)
            save(fig, "breakdown.png")
    elif bench == "vs_fla":
        ok = [r for r in rows if r.get("time_ratio") is not None]
        if ok:
            fig, ax = plt.subplots(figsize=(7, 0.4 * len(ok) + 1.5))
            labels = [f"{r['shape']} {tokens_label(r['tokens'])} ({r['step']})" for r in ok]
            ax.barh(labels, [r["time_ratio"] for r in ok])
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlim(min(0.8, min(r["time_ratio"] for r in ok) - 0.02), max(1.05, max(r["time_ratio"] for r in ok) + 0.02))
            ax.set_xlabel("time, ours / fla's layer (under 1: faster)")
            ax.set_title(f"against fla's own layers ({where})", fontsize=9)
            ax.invert_yaxis()
            save(fig, "vs_fla_" + "_".join(sorted({r["shape"] for r in ok})) + ".png")
    elif bench == "long_decode":
        fig, ax = plt.subplots(figsize=(10, 5.5))
        _long_decode_lines(ax, payload, plt.get_cmap("tab10").colors)
        ax.set_title(f"long decode, {payload['args']['dtype']} rank vs the float64 serial run ({where})", fontsize=9)
        save(fig, "long_decode.png")
    return written


def _long_decode_lines(ax, payload: dict, colors) -> None:
    """Error vs decode step, log-log: a colour per (family, field), planted runs dashed in their
    layer's colour, the bound black and dashed."""
    series = payload["series"]
    keys = list(dict.fromkeys((s["family"], s["field"]) for s in series))
    for s in series:
        points = [(t, e) for t, e in enumerate(s["errors"], 1) if e is not None and 0 < e < float("inf")]
        layer = s["variant"] == "layer"
        color = colors[keys.index((s["family"], s["field"])) % len(colors)]
        ax.plot([p[0] for p in points], [p[1] for p in points], color=color, linestyle="-" if layer else "--",
                linewidth=1.0,
                label=f"{s['family']} {s['field']}" + ("" if layer else f" ({s['variant']})"))
    bound, steps = payload["bound"], max(len(s["errors"]) for s in series)
    ts = range(1, steps + 1)
    ax.plot(ts, [bound["rtol"] * max(1.0, t / bound["warmup"]) ** bound["growth"] for t in ts], color="black",
            linestyle="--", linewidth=1.6,
            label=f"bound {bound['rtol']:g} x max(1, t/{bound['warmup']})^{bound['growth']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("decode step t")
    ax.set_ylabel("relative error vs float64")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="PNG plots from the benchmark scripts' JSON")
    parser.add_argument("files", nargs="+", metavar="FILE.json")
    parser.add_argument("--out", required=True, metavar="DIR")
    args = parser.parse_args(argv)
    for f in args.files:
        for path in plot(json.loads(Path(f).read_text()), args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
