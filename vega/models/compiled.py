"""``aoti:PATH``: a sequence model compiled ahead of time (``vega export``) and run as it is.

The package is what ``torch.export`` and AOTInductor make of a ``python:`` model: its
forward pass as machine code for one device and instruction set, no Python and no
compiler needed where it is served. What Vega needs to serve it (channels, longest window,
output size, the length multiple its export holds for) rides in the package's AOTInductor
metadata, read here from the archive without loading the code: the serving process learns
the model's shape, and only the process that runs it loads it.

A call into the compiled code holds the GIL for the whole forward pass (torch 2.13), so it
never runs beside the event loop: ``auto`` gives it a model process (docs/executor.md).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

from vega.models.base import SequenceModel

# Keys of the package's metadata (all strings, as AOTInductor keeps them).
PREFIX = "vega."
FORMAT = "1"
FIELDS = ("format", "channels", "max_length", "output_size", "length_multiple", "least_length")
DEVICE_KEY = "AOTI_DEVICE_KEY"


class PackageError(Exception):
    """The file is not a package ``vega export`` wrote; the message says why."""


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of the package at ``path``, Vega's fields checked, without loading it."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("wrapper_metadata.json")]
            if len(names) != 1:
                raise PackageError(f"{path}: not an AOTInductor package of one model")
            metadata = json.loads(archive.read(names[0]))
    except (OSError, zipfile.BadZipFile, ValueError) as error:
        raise PackageError(f"{path}: cannot read: {error}") from None
    if not isinstance(metadata, dict):
        raise PackageError(f"{path}: its metadata is not an object")
    missing = [f for f in FIELDS if not isinstance(metadata.get(PREFIX + f), str)]
    if missing:
        raise PackageError(f"{path}: not written by `vega export` (no {PREFIX}{missing[0]})")
    if metadata[PREFIX + "format"] != FORMAT:
        raise PackageError(f"{path}: package format {metadata[PREFIX + 'format']}, "
                           f"this Vega reads {FORMAT}; export the model again")
    return metadata


class CompiledModel(SequenceModel):
    """A ``vega export`` package: windows as ``SequenceModel`` takes them, each batch padded
    up to the least length and the length multiple the export holds for (padding is masked,
    as for any batch)."""

    holds_gil = True  # a whole forward pass in one call: keep it off the loop's process
    inputs_hint = " (the shape it was exported for)"

    def __init__(self, path: str, name: str) -> None:
        metadata = read_metadata(path)
        try:
            channels, max_length, output_size, multiple, least = (
                int(metadata[PREFIX + f]) for f in FIELDS[1:])
            shortest = int(metadata.get(PREFIX + "min_length", "1"))  # packages before it: 1
        except ValueError:
            raise PackageError(f"{path}: its Vega metadata is not whole numbers") from None
        if min(channels, max_length, multiple, least, shortest) < 1 or shortest > max_length:
            raise PackageError(f"{path}: its Vega metadata is out of range")
        super().__init__(None, name, channels=channels, max_length=max_length,
                         min_length=shortest, output_size=output_size)
        self.path = path
        self.length_multiple = multiple
        self.least_length = least
        self.compiled_for = metadata.get(DEVICE_KEY, "cpu")

    def weights_digest(self) -> str:
        """A digest of the package file (its weights and compiled code)."""
        digest = hashlib.blake2b(digest_size=16)
        with open(self.path, "rb") as package:
            while chunk := package.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()

    def load(self, device: str) -> None:
        import torch

        target = torch.device(device)
        if target.type != self.compiled_for:
            raise PackageError(f"{self.path} was compiled for {self.compiled_for}, "
                               f"not {target.type}: export it again with --device {target.type}")
        index = target.index if target.index is not None else -1
        self._device = device
        self.module = torch._inductor.aoti_load_package(self.path, device_index=index)
        self.inspect_outputs()

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest window is ``longest`` runs at (the batcher
        reports its padding at this length)."""
        multiple = self.length_multiple
        return max(self.least_length, -(-longest // multiple) * multiple)

    def probe_lengths(self) -> tuple[int, int] | None:
        shorter = self.padded_length(self.min_length)
        longer = self.padded_length(shorter + 1)
        return (shorter, longer) if longer <= self.max_length else None

    def run(self, samples: list[Any], pad_to: int) -> list[Any]:
        return super().run(samples, self.padded_length(pad_to))
