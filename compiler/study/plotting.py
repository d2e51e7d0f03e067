"""What every plot of the study's report shares: matplotlib without a display, legends only where
something is labelled, and one way to lay out, write and close a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend(ax: Any) -> None:
    """A small legend, when the axes have labelled artists."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def save(plt: Any, fig: Any, path: Path) -> None:
    """Lay out, write and close one figure (every plot of the report ends so)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
