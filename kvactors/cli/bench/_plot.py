"""The ``kvactors bench`` figure: GB/s, per-call ratios on CPU, kvactors over LMCache's own
MLU/MUSA ops. matplotlib is optional (``pip install kvactors[bench]``), always with Agg."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvactors.errors import MissingDependencyError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvactors.cli.bench.percall import PercallRow
    from kvactors.cli.bench.transfer import TransferRow
    from kvactors.cli.bench.vendor import VendorRow

__all__ = ("plot",)


def plot(
    t: Sequence[TransferRow],
    pc: Sequence[PercallRow],
    vendor_rows: Sequence[VendorRow],
    m: dict[str, Any],
    path: str,
) -> None:
    """Write the figure of one run (its rows and ``meta``) to ``path`` (PNG);
    MissingDependencyError without matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            "the bench plot needs matplotlib: pip install 'kvactors[bench]'", package="matplotlib"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vendor = {(r.vendor, r.layout, r.direction, r.contender): r.host_us for r in vendor_rows}
    keys = [k[:3] for k in vendor if k[3] == "kvactors"]
    panels = [
        ("GB/s", [f"{r.layout}\n{r.direction}" for r in t], None,
         {n: [r.gbps.get(n, 0.0) for r in t] for n in ("kvactors", "raw", "lmcache")}),
        ("per call on CPU, ratio", [f"{r.model} {r.layout}\n{r.direction}" for r in pc], 1.0,
         {"kvactors / torch, 1 caller": [r.vs_torch["1"] for r in pc],
          "kvactors / torch, 4 callers": [r.vs_torch["4"] for r in pc],
          "kvactors calls/s, 4 callers / 1": [r.scaling["kvactors"] for r in pc]}),
        ("fake vendors, ratio", [f"{v} {lay}\n{d}" for v, lay, d in keys], 0.5,
         {f"kvactors / LMCache host us, {n} thread(s)":
          [vendor[(*k, "kvactors")][n] / vendor[(*k, "lmcache")][n] for k in keys] for n in "14"}),
    ]  # fmt: skip
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for ax, (ylabel, labels, line, series) in zip(axes[:, 0], panels, strict=True):
        width = 0.8 / len(series)
        for i, (name, vals) in enumerate(series.items()):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
            ax.bar(xs, vals, width, label=name)
        if line is not None:
            ax.axhline(line, color="grey", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=6.5)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"kvactors bench{' --quick' if m.get('quick') else ''}: {m.get('cpus')} CPUs, "
        f"torch {m.get('torch')}, {m.get('when')} (ratios from one run)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
