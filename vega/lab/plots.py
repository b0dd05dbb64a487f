"""PNG plots of a run report (``vega.lab.report``): rates, latency, queue depth, batches.

``write_plots(report, out_dir)`` draws each plot that has data into ``out_dir``
(rates.png, latency.png, queue.png, batches.png) and returns the files written.
matplotlib is the ``plots`` extra and is imported only here, only when plotting:
without it, plots are skipped with a warning and the run's JSON report stands alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("vega.lab.plots")

CLASS_COLORS = {"critical": "tab:red", "normal": "tab:blue", "sheddable": "tab:green"}


def _outcome_color(label: str, index: int) -> str:
    if label == "200":
        return "tab:green"
    if label.startswith("429"):
        return ("tab:orange", "gold", "chocolate", "sandybrown", "peru")[index % 5]
    if label.startswith("503"):
        return "tab:purple"
    if label.startswith("504"):
        return "darkred"
    if label.startswith("no answer"):
        return "grey"
    return "black"


def write_plots(report: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """PNG plots of ``report`` into ``out_dir``; returns the files written (none, with a
    warning, where matplotlib, the ``plots`` extra, is not installed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("plots skipped: matplotlib is not installed (pip install 'vega[plots]')")
        return []

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("rates.png", _plot_rates), ("latency.png", _plot_latency),
                       ("queue.png", _plot_queue), ("batches.png", _plot_batches)):
        fig = Figure(figsize=(11, 6), layout="constrained")
        if draw(fig, report):
            fig.savefig(out / name, dpi=100)
            written.append(out / name)
    return written


def _title(fig: Any, report: Mapping[str, Any], what: str) -> None:
    meta = report.get("meta", {})
    where = " ".join(str(meta[k]) for k in ("mode", "profile", "url") if meta.get(k))
    fig.suptitle(f"{what} — {where}" if where else what)


def _plot_rates(fig: Any, report: Mapping[str, Any]) -> bool:
    tl = report["timeline"]
    if not tl["t"]:
        return False
    ax = fig.subplots()
    t = tl["t"]
    labels = list(tl["answered"])
    labels.sort(key=lambda k: (k != "200", k))
    if labels:
        ax.stackplot(t, [tl["answered"][k] for k in labels], step="post",
                     labels=[f"answered {k}" for k in labels],
                     colors=[_outcome_color(k, i) for i, k in enumerate(labels)], alpha=0.75)
    ax.step(t, tl["offered"], where="post", color="black", linewidth=1.5, label="offered")
    ax.step(t, tl["goodput"], where="post", color="navy", linestyle="--", linewidth=1.5,
            label="goodput (200 within deadline)")
    ax.set_xlabel(f"time since start (s), bins of {tl['bin_s']}s")
    ax.set_ylabel("requests / s")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    _title(fig, report, "Offered vs answered rate by outcome")
    return True


def _plot_latency(fig: Any, report: Mapping[str, Any]) -> bool:
    series = report["timeline"]["latency_ms"]
    if not series:
        return False
    t = report["timeline"]["t"]
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (p, by_q) in zip(axes, series.items()):
        for (q, values), style in zip(by_q.items(), ("-", "--", ":")):
            ys = [math.nan if v is None else v for v in values]
            ax.plot(t, ys, linestyle=style, color=CLASS_COLORS.get(p, "black"), label=q)
        for d in report["classes"].get(p, {}).get("deadline_ms", [])[:1]:
            ax.axhline(d, color="grey", linewidth=0.8, label=f"deadline {d:g} ms")
        if any(v for values in by_q.values() for v in values if v):
            ax.set_yscale("log")
        ax.set_ylabel(f"{p}\nms")
        ax.legend(loc="upper left", fontsize="small")
        ax.grid(alpha=0.3, which="both")
    axes[-1].set_xlabel("scheduled send time (s); latency of 200s, from scheduled send")
    _title(fig, report, "Latency percentiles per class")
    return True


def _plot_queue(fig: Any, report: Mapping[str, Any]) -> bool:
    queue = report.get("queue")
    if not queue or not queue["t"]:
        return False
    ax = fig.subplots()
    for p, values in queue["depth"].items():
        ax.step(queue["t"], values, where="post", color=CLASS_COLORS.get(p, "black"), label=p)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("queued items")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    _title(fig, report, "Queue depth per class (polled /v1/status)")
    return True


def _plot_batches(fig: Any, report: Mapping[str, Any]) -> bool:
    batches = report.get("batches") or {}
    shown = [(k, batches[k]) for k in ("size", "padding") if batches.get(k)]
    if not shown:
        return False
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    titles = {"size": "batch size (items, ≤ bound)", "padding": "padding ratio (≤ bound)"}
    for ax, (key, dist) in zip(axes, shown):
        ax.bar(range(len(dist["counts"])), dist["counts"], color="tab:blue")
        ax.set_xticks(range(len(dist["le"])), dist["le"], rotation=45, fontsize="small")
        mean = dist["sum"] / dist["count"] if dist["count"] else 0.0
        ax.set_title(f"{titles[key]}: {int(dist['count'])} batches, mean {mean:.3g}")
        ax.set_ylabel("batches")
        ax.grid(alpha=0.3, axis="y")
    _title(fig, report, "Batches formed during the run (/metrics before/after)")
    return True
