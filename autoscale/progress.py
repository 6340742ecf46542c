"""Progress bars on a terminal only.

Piped to a file (CI, nohup, Slurm), a tqdm bar is thousands of carriage-return frames in the log;
there the phase lines the commands print say the progress. Every bar autoscale draws is made by
:func:`progress_bar`, which draws only where :func:`draw_bars` says so.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["draw_bars", "progress_bar"]


def draw_bars(asked: bool = True, stream: Any = None) -> bool:
    """Whether to draw progress bars: where ``asked`` (no ``--quiet``) and their stream (stderr,
    where tqdm draws) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(asked and isatty is not None and isatty())


def progress_bar(total: int | None = None, asked: bool = True, **kwargs: Any):
    """A tqdm bar over ``total`` (tqdm's keyword arguments as they are), drawn only where
    :func:`draw_bars` says so (a disabled bar still counts, and costs nothing)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not draw_bars(asked), **kwargs)
