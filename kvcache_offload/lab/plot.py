"""Hit rate against CPU-tier capacity as a PNG: one line per policy, Belady dashed on top.

matplotlib is an optional dependency (``pip install kvcache-offload[plot]``); it is imported
only when a plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["plot_hit_rates"]

Series = Mapping[str, Sequence[tuple[float, float]]]
"""Line name -> [(capacity, hit rate), ...]."""


def plot_hit_rates(
    panels: Mapping[str, Series],
    path: str | os.PathLike[str],
    xlabel: str = "CPU capacity (% of unique blocks)",
    ylabel: str = "block hit rate",
    title: str | None = None,
) -> None:
    """Draw one panel per trace (``panels``: trace name -> series) and save a PNG."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'kvcache-offload[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(panels)
    fig, axes = plt.subplots(
        1, max(1, len(names)), figsize=(6 * max(1, len(names)), 4.5), squeeze=False
    )
    for ax, name in zip(axes[0], names, strict=False):
        for label, points in panels[name].items():
            if not points:
                continue
            xs, ys = zip(*sorted(points), strict=True)
            is_bound = label.lower() == "belady"
            ax.plot(
                xs,
                [100 * y for y in ys],
                linestyle="--" if is_bound else "-",
                color="black" if is_bound else None,
                marker="o",
                markersize=3,
                label="Belady (optimal)" if is_bound else label,
            )
        xs_all = sorted({x for points in panels[name].values() for x, _ in points})
        if xs_all and xs_all[0] > 0 and xs_all[-1] / xs_all[0] >= 8:
            # Capacities usually grow geometrically (1, 2, 5, 10, 20 %): spread them evenly.
            ax.set_xscale("log")
            ax.set_xticks(xs_all)
            ax.set_xticklabels([f"{x:g}" for x in xs_all])
            ax.minorticks_off()
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{ylabel} (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
