"""`rlhf report RUN_DIR`: figures of how a fault propagated, written to RUN_DIR/report/.

    rlhf report runs/scenario2                     propagation.png, target_metrics.png
    rlhf report --matrix out/scenarios.csv -o out  gap_by_scenario.png (RL vs SFT per scenario)

propagation.png   x: seconds since the fault's onset; y: one row per process. The fault's
                  injections (red triangles), every ERROR line (black x), the error the user sees
                  (the controller's "run failed", a star) and the last error line of the controller
                  (a square), the root cause `rlhf diagnose` names from the evidence alone (a green
                  diamond) and arrows along its propagation chain, root cause → … → surfaced error.
target_metrics.png  the faulted process's CPU (own, its children's, its threads' run-queue wait), RSS
                  and the system CPU, with the fault onset and the surfaced error marked; without
                  a fault, rank 0's process. A run with no failure says so instead of an empty plot.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import sys
import textwrap
from typing import Any

from rlhf.analysis import DIAGNOSIS, _stamp, injections, measure_run, read_markers
from rlhf.diagnosis import diagnose


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("rlhf report needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _caption(text: str, width: int = 120) -> str:
    """A legend entry a reader can read whole: URLs dropped, wrapped onto at most two lines."""
    text = re.sub(r" ?\(https?://[^)]*\)", "", text).strip()
    lines = textwrap.wrap(text, width)
    if len(lines) > 2:
        lines = [lines[0], textwrap.shorten(" ".join(lines[1:]), width, placeholder=" …")]
    return "\n".join(lines)


def _legend_below(fig: Any, ax: Any, lines: int) -> None:
    """The legend under the x-axis label, never over it (the figure grows to hold it when saved)."""
    fig.tight_layout()
    axes_h = ax.get_position().height * fig.get_size_inches()[1]  # inches
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55 / axes_h), fontsize=8, frameon=False, ncol=1)


def _outcome(run_dir: str) -> str:
    """'the run finished its 4 steps; eval accuracy 0.227 → 0.488' (summary.json), or ''."""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
            summary = json.load(fh)
    except (OSError, ValueError):
        return ""
    before, after = summary.get("eval_accuracy_before"), summary.get("eval_accuracy_after")
    acc = f"; eval accuracy {before:.3f} → {after:.3f}" if isinstance(before, float) and isinstance(after, float) else ""
    return f"the run finished its {summary.get('steps', '?')} steps{acc}"


def _events(run_dir: str) -> tuple[float | None, list[dict], dict[str, list[float]], tuple[float, str] | None,
                                   tuple[float, str] | None]:
    injects = injections(run_dir)
    errors: dict[str, list[float]] = {}
    surfaced = last = None
    for log in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log"))):
        proc = os.path.basename(log)[:-4]
        with open(log, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if " ERROR " not in line or DIAGNOSIS in line or (t := _stamp(line)) is None:
                    continue
                errors.setdefault(proc, []).append(t)
                if proc in ("controller-0", "trainer-0"):
                    if "run failed" in line and surfaced is None:
                        surfaced = (t, line.split(": ", 1)[-1])
                    last = (t, line.split(": ", 1)[-1])
    onset = injects[0]["time"] if injects else None
    return onset, injects, errors, surfaced, last


def propagation_figure(run_dir: str, out: str) -> str:
    plt = _plt()
    onset, injects, errors, surfaced, last = _events(run_dir)
    t0 = onset if onset is not None else min((t for ts in errors.values() for t in ts), default=0.0)
    ctrl = "trainer-0" if os.path.exists(os.path.join(run_dir, "logs", "trainer-0.log")) else "controller-0"
    diag = diagnose(run_dir)
    hop_procs = ({diag.root.process} | {e.reporter for e in diag.chain}) if diag.root is not None else set()
    procs = sorted({f"{m['role']}-{m['rank']}" for m in injects} | set(errors) | {ctrl} | hop_procs, key=_order)
    y = {p: i for i, p in enumerate(procs)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * len(procs)))
    colors = ["crimson", "mediumvioletred", "firebrick", "deeppink"]
    names = list(dict.fromkeys(m["fault"] for m in injects))
    for m in injects:
        row = f"{m['role']}-{m['rank']}"
        color = colors[names.index(m["fault"]) % len(colors)]
        ax.scatter(m["time"] - t0, y[row], marker="v", s=140, color=color, zorder=3)
    for i, name in enumerate(names):  # label each fault once, at its first injection; stacked, so none overlap
        m = next(x for x in injects if x["fault"] == name)
        ax.annotate(f"{name} ({m['kind']})", (m["time"] - t0, y[f"{m['role']}-{m['rank']}"]), textcoords="offset points",
                    xytext=(4, 9 - 11 * i), fontsize=8, color=colors[i % len(colors)])
    for proc, ts in errors.items():
        ax.scatter([t - t0 for t in ts], [y[proc]] * len(ts), marker="x", s=60, color="black", zorder=3)
    if surfaced is not None:
        ax.scatter(surfaced[0] - t0, y[ctrl], marker="*", s=320, color="darkorange", zorder=4,
                   label=_caption(f"surfaced: {surfaced[1]}"))
    if last is not None and (surfaced is None or last[0] != surfaced[0]):
        ax.scatter(last[0] - t0, y[ctrl], marker="s", s=90, facecolors="none", edgecolors="purple", zorder=4,
                   label=_caption(f"last error line: {last[1]}"))
    arrow = dict(arrowstyle="->", color="gray", lw=1.2)
    # the arrows follow the diagnosis (the evidence alone), hop by hop, from its root cause to where the run
    # surfaced it; the fault markers (triangles) are drawn beside it as the answer key, never as its start
    if diag.root is not None:
        r = diag.root
        ax.scatter(r.time - t0, y[r.process], marker="D", s=150, facecolors="none", edgecolors="green", lw=2, zorder=5,
                   label=_caption(f"root cause (rlhf diagnose): {r.process}, {r.stage}, {r.category}: {r.summary}"))
        hops = [(r.time, r.process)] + [(e.time, e.reporter) for e in diag.chain[1:] if e.reporter in y]
        for (ta, pa), (tb, pb) in zip(hops, hops[1:]):
            if (ta, pa) != (tb, pb):
                ax.annotate("", xy=(tb - t0, y[pb]), xytext=(ta - t0, y[pa]), arrowprops=arrow)
    ax.set_yticks(range(len(procs)))
    ax.set_yticklabels(procs)
    ax.set_ylim(-0.7, len(procs) - 0.3)
    ax.set_xlabel("seconds since the fault's onset" if onset is not None else "seconds")
    ax.grid(axis="x", alpha=0.3)
    name = os.path.basename(os.path.normpath(run_dir))
    if diag.root is None and not errors:  # nothing failed: say so instead of an empty plot
        outcome = _outcome(run_dir) or "no error line in any log"
        ax.text(0.5, 0.5, f"no failure: {outcome}" + (f"\n({len(injects)} fault injection(s), none surfaced as an "
                                                     "error)" if injects else ""),
                transform=ax.transAxes, ha="center", va="center", fontsize=12, color="darkgreen",
                bbox=dict(boxstyle="round", facecolor="honeydew", edgecolor="darkgreen"))
        ax.set_title(f"{name}: no failure", fontsize=11)
        ax.set_xticks([])
        ax.set_xlabel("")
    else:
        row = measure_run(run_dir)
        ax.set_title(f"{name}: fault in {row['fault_stage'] or '?'} ({row['target'] or '?'}), surfaced in "
                     f"{row['error_stage'] or '?'}" if injects else f"{name}: root cause and propagation", fontsize=11)
    if surfaced is not None or last is not None or diag.root is not None:
        _legend_below(fig, ax, 3)
    else:
        fig.tight_layout()
    path = os.path.join(out, "propagation.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _order(proc: str) -> tuple[int, str]:
    rank = {"controller": 0, "trainer": 0, "metaserver": 1, "scheduler": 2, "train": 3, "rollout": 4, "reward": 5, "env": 6}
    return rank.get(proc.split("-")[0], 9), proc


def metrics_figure(run_dir: str, out: str) -> str | None:
    """The faulted process's resources; without a fault, rank 0's process (controller, MetaServer, train-0)."""
    plt = _plt()
    onset, injects, _errors, surfaced, _last = _events(run_dir)
    target = f"{injects[0]['role']}-{injects[0]['rank']}" if injects else "train-0"
    name = "train-0" if target == "controller-0" else target
    path = os.path.join(run_dir, "metrics", f"{name}.csv")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return None

    def col(key: str) -> list[float]:
        return [float(r.get(key) or 0) for r in rows]

    t0 = onset if onset is not None else float(rows[0]["time"])
    t = [float(r["time"]) - t0 for r in rows]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    a1.plot(t, col("cpu_percent"), label=f"{name} CPU %")
    a1.plot(t, col("children_cpu_percent"), label="its children's CPU % (helpers it started, fault burners)")
    a1.plot(t, [v * (os.cpu_count() or 1) for v in col("system_cpu_percent")], alpha=0.5,
            label="whole machine CPU % (x cores)")
    if "cpu_wait_percent" in rows[0]:
        a1.plot(t, col("cpu_wait_percent"), ls=":", color="black", label="its threads' run-queue wait, % of time")
    a2.plot(t, [int(r["rss_bytes"]) / 2**20 for r in rows], color="teal", label=f"{name} RSS (MiB)")
    device = _device_usage(run_dir, injects[0]["fault"]) if injects else []
    if device:  # the emulated device budget, from the fault's own verify markers
        a3 = a2.twinx()
        a3.plot([d[0] - t0 for d in device], [d[1] for d in device], "o-", color="slateblue",
                label="device memory used, MiB (emulated budget)")
        a3.set_ylabel("device MiB (emulated)", color="slateblue")
        a3.legend(fontsize=8, loc="lower right")
    for ax in (a1, a2):
        if onset is not None:
            ax.axvline(0.0, color="crimson", ls="--", label="fault onset")
        if surfaced is not None:
            ax.axvline(surfaced[0] - t0, color="darkorange", ls="-.", label="surfaced error")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    a1.set_ylabel("CPU %")
    a2.set_ylabel("MiB")
    a2.set_xlabel("seconds since the fault's onset" if onset is not None else "seconds since the first sample")
    a1.set_title(f"{name}: the faulted process ({injects[0]['fault']}, {injects[0]['kind']})" if injects else
                 f"{name}: rank 0's process (controller, MetaServer, train-0); no fault injected", fontsize=11)
    fig.tight_layout()
    out_path = os.path.join(out, "target_metrics.png")
    fig.savefig(out_path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out_path


def _device_usage(run_dir: str, fault: str) -> list[tuple[float, float]]:
    return [(m["time"], float(m["details"]["used_mb"])) for m in read_markers(run_dir)
            if m["fault"] == fault and m["event"] == "verify" and "used_mb" in m["details"]]


def matrix_figure(csv_path: str, out: str) -> str:
    plt = _plt()
    with open(csv_path, encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    scenarios = sorted({r["scenario"] for r in rows}, key=lambda s: (len(s), s))
    modes = sorted({r["mode"] for r in rows})
    fig, ax = plt.subplots(figsize=(2 + 1.3 * len(scenarios), 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        values = []
        for s in scenarios:
            match = [r for r in rows if r["scenario"] == s and r["mode"] == mode and r["surfaced_error_time_s"] != ""]
            values.append(float(match[0]["surfaced_error_time_s"]) if match else 0.0)
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(scenarios))]
        ax.bar(xs, values, width, label=mode.upper())
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels([f"scenario {s}" for s in scenarios])
    ax.set_ylabel("seconds from fault onset to the surfaced error")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "gap_by_scenario.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_figures(run_dir: str) -> list[str]:
    """A run's figures into <run-dir>/report (what `rlhf report RUN_DIR` draws): the trackers log them at the end."""
    out = os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    written = [propagation_figure(run_dir, out)]
    m = metrics_figure(run_dir, out)
    return written + ([m] if m else [])


def report_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf report", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="a run directory")
    parser.add_argument("--matrix", help="a scenarios.csv from benchmarks/scenarios.py")
    parser.add_argument("-o", "--output", help="directory for the figures (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    if not args.run_dir and not args.matrix:
        parser.error("give a run directory or --matrix scenarios.csv")
    written = []
    if args.run_dir:
        if not os.path.isdir(os.path.join(args.run_dir, "logs")):
            print(f"rlhf report: {args.run_dir} is not a run directory (no logs/)", file=sys.stderr)
            return 2
        out = args.output or os.path.join(args.run_dir, "report")
        os.makedirs(out, exist_ok=True)
        written.append(propagation_figure(args.run_dir, out))
        m = metrics_figure(args.run_dir, out)
        if m:
            written.append(m)
    if args.matrix:
        out = args.output or os.path.dirname(os.path.abspath(args.matrix))
        os.makedirs(out, exist_ok=True)
        written.append(matrix_figure(args.matrix, out))
    for p in written:
        print(p)
    return 0
