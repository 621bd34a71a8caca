"""What the package draws on a terminal or in a notebook: the class of its progress bars.

A leaf, importing nothing of the package: the progress callbacks and the loop (a resume that replays a stream) draw
their bars with the same class.
"""

from __future__ import annotations

import sys

_TQDM_CLASS = None


def progress_bar_class() -> type:
    """tqdm's widget bar in a notebook that has ipywidgets, its text bar everywhere else.

    ``tqdm.auto`` alone warns ("IProgress not found") in a notebook without ipywidgets; the text bar shows the
    same there. Chosen once, at the first bar. ipywidgets is imported only inside a Jupyter kernel (``ipykernel``
    already imported): in a script, importing it (and IPython with it) would cost about 0.1 s at every run's start,
    for a bar it cannot draw.
    """
    global _TQDM_CLASS
    if _TQDM_CLASS is None:
        from tqdm.std import tqdm as chosen

        if "ipykernel" in sys.modules:  # a notebook, or a process notebook_launcher forked from one
            try:
                import ipywidgets  # noqa: F401  (only whether it imports)
                from tqdm.auto import tqdm as chosen
            except ImportError:
                pass
        _TQDM_CLASS = chosen
    return _TQDM_CLASS
