"""matplotlib, when installed: plots are an optional extra (``pip install lserve[plot]``).

Every bench and tool writes its JSON first and its PNG through :func:`pyplot`, so a serving-only
install runs them all and just skips the pictures.
"""

from __future__ import annotations

import sys

PLOT_HINT = "install lserve[plot] for plots"

_warned = False


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None without matplotlib.

    Returns
    -------
    module or None
        None after printing :data:`PLOT_HINT` once per process to stderr (a bench that saves
        after every row would otherwise repeat it).
    """
    global _warned
    try:
        import matplotlib
    except ImportError:
        if not _warned:
            print(f"lserve: {PLOT_HINT}; the JSON is written without the PNG", file=sys.stderr)
            _warned = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
