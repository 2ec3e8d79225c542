"""A progress bar while a large model file is read: tqdm on stderr, only on a terminal.

Small files (the default SmolLM2, ~100 MB) load in a second or two and get no bar; past
``LARGE_FILE_BYTES`` a load takes long enough that a silent process looks hung. The bar counts
bytes of tensor data as they are read (dequantized or copied), goes to stderr, and is drawn
only when stderr is a TTY (tqdm's ``disable=None``), so server logs and tests stay quiet.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

LARGE_FILE_BYTES = 512 * 1024 * 1024


def load_bar(paths: list[str], desc: str, threshold_bytes: int = LARGE_FILE_BYTES) -> tqdm:
    """A byte-counting bar over ``paths``; disabled when together they are under ``threshold_bytes``."""
    total = sum(os.path.getsize(p) for p in paths)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None if total >= threshold_bytes else True, dynamic_ncols=True, leave=False)
