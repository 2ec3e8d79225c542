"""``SafetensorsDict``: a lazy reader of a Hugging Face checkpoint directory's weights.

It maps names to tensors across the shards of a directory and reads a tensor only when
asked (an expert-parallel rank reads only its own slots).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open


class SafetensorsDict(Mapping):
    """Read-only name -> tensor mapping over every ``*.safetensors`` file of a directory;
    tensors are read on access."""

    def __init__(self, directory: str | Path):
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors files in {directory}")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    self._where[name] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as sf:
            return sf.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
