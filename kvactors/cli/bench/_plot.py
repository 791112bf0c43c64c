"""The ``kvactors bench`` plot: kernel GB/s per layout and direction, and through the runtime.

matplotlib is optional (``pip install kvactors[bench]``) and always used with the Agg
backend, so the plot renders on headless hosts and never opens a window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvactors.errors import MissingDependencyError

if TYPE_CHECKING:
    from kvactors.cli.bench._report import BenchReport

__all__ = ("plot",)

_SHORT = {"nhd_separate": "nhd-sep"}
_COLORS = {
    "kvactors": "#1f77b4",
    "raw copy": "#7f7f7f",
    "LMCache torch path": "#d62728",
    "kvactors, plan reused": "#aec7e8",
}


def plot(report: BenchReport, path: str) -> None:
    """Write the figure for ``report`` to ``path`` (PNG).

    Raises:
        MissingDependencyError: matplotlib is not installed (an ImportError).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            "the bench plot needs matplotlib: pip install 'kvactors[bench]'", package="matplotlib"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r
        for r in report.transfer
        if r.threads == min((x.threads for x in report.transfer), default=1)
    ]
    fig = plt.figure(figsize=(12, 6.5), dpi=110)
    grid = fig.add_gridspec(1, 2, width_ratios=[3.3, 1], wspace=0.22)
    ax = fig.add_subplot(grid[0, 0])
    labels = []
    for r in rows:
        note = f"{r.vs_raw:.0%} raw"
        if r.vs_lmcache is not None:
            note += f"\n{r.vs_lmcache:.1f}x LMC"
        labels.append(f"{_SHORT.get(r.layout, r.layout)}\n{r.direction}\n{note}")
    series: dict[str, list[float]] = {
        "kvactors": [r.kvactors_gbps for r in rows],
        "kvactors, plan reused": [r.reused_gbps or 0.0 for r in rows],
        "raw copy": [r.raw_gbps for r in rows],
    }
    if any(r.lmcache_gbps is not None for r in rows):
        series["LMCache torch path"] = [r.lmcache_gbps or 0.0 for r in rows]
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, vals, width, label=name, color=_COLORS[name])
    ax.set_xticks(range(len(rows)), labels, fontsize=7.5)
    ax.set_ylabel("GB/s (median of interleaved repetitions)")
    thr = rows[0].threads if rows else 1
    ax.set_title(
        f"KV gather (device->host) / scatter (host->device), {thr} thread, same operands, one run",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", ncols=len(series))
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)

    side = fig.add_subplot(grid[0, 1])
    if report.runtime:
        names = [f"{r.direction}" for r in report.runtime]
        xs = list(range(len(names)))
        side.bar(
            [x - 0.2 for x in xs],
            [r.runtime_gbps for r in report.runtime],
            0.4,
            label="through Runtime",
            color=_COLORS["kvactors"],
        )
        side.bar(
            [x + 0.2 for x in xs],
            [r.raw_gbps for r in report.runtime],
            0.4,
            label="raw copy",
            color=_COLORS["raw copy"],
        )
        side.set_xticks(
            xs,
            [f"{n}\n{rr.vs_raw:.0%} raw" for n, rr in zip(names, report.runtime, strict=True)],
            fontsize=8,
        )
        sim = " (simulated)" if report.runtime[0].simulated else ""
        side.set_title(f"NHD through the actors, {report.runtime[0].device}{sim}", fontsize=9)
        top = max(max(rr.runtime_gbps, rr.raw_gbps) for rr in report.runtime)
        side.set_ylim(0, top * 1.35)
        side.legend(fontsize=7, loc="upper center", ncols=2)
        side.grid(axis="y", alpha=0.3)
    else:
        side.axis("off")
    meta = report.meta
    fig.suptitle(
        f"kvactors bench{' --quick' if meta.get('quick') else ''}: "
        f"{meta.get('cpus')} CPUs, torch {meta.get('torch')}, {meta.get('when')}",
        fontsize=11,
    )
    fig.subplots_adjust(left=0.06, right=0.98, top=0.9, bottom=0.16)
    fig.savefig(path)
    plt.close(fig)
