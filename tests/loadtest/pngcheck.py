"""Is a PNG a plot with data on it? Axes, ticks and labels are drawn in grays; every data series
(lines, bars, markers) in a color. So: a PNG whose share of clearly colored pixels is above a
floor has data drawn on it, while an empty figure (or one with only a message) has none."""
from __future__ import annotations

import pathlib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def colored_share(path: pathlib.Path) -> float:
    """Share of pixels whose channels differ by more than 0.15 (not white, black or gray)."""
    import matplotlib.image

    img = matplotlib.image.imread(str(path))[..., :3]
    spread = img.max(axis=-1) - img.min(axis=-1)
    return float((spread > 0.15).mean())


def assert_plot_with_data(path: pathlib.Path, floor: float = 0.002) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    share = colored_share(path)
    assert share > floor, f"{path}: {share:.4f} of its pixels are colored: no data drawn?"
