"""Reading banked vectors and summing them: lazily, tensor by tensor, everything that could refuse checked first.

:meth:`editkit.bank.store.Bank.merge` streams through ``safetensors.safe_open`` so a sum of any number of vectors
needs about one model of memory; vectors of different families, adapters or bases are refused by name, as are
files whose parameters or shapes differ (read from their headers before the first addition).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from editkit.bank.entries import VectorEntry, short_fingerprint
from editkit.core.adapters import LoraWeights
from editkit.core.modes import Family, families_help
from editkit.errors import BankError, CorruptVectorError, IncompatibleVectorsError

if TYPE_CHECKING:
    import torch


def header_shapes(path: Path, name: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of vector ``name``'s file, read from its header alone."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {key: tuple(fh.get_slice(key).get_shape()) for key in fh.keys()}
    except Exception as exc:  # safetensors raises its own types
        raise CorruptVectorError(f"vector file {path} of {name!r} is missing or unreadable") from exc


class VectorReader(Mapping[str, "torch.Tensor"]):
    """A banked vector's tensors by parameter name, each read from the (already verified) file when it is
    asked for and not kept; ``shapes`` comes from the file's header."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        self.path, self.shapes = path, shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.shapes:
            raise KeyError(key)
        try:
            with safe_open(str(self.path), framework="pt") as fh:
                return fh.get_tensor(key)
        except Exception as exc:  # safetensors raises its own types
            raise CorruptVectorError(f"vector file {self.path} is truncated or unreadable") from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def sum_files(entries: list[VectorEntry], paths: list[Path], alphas: list[float]) -> dict[str, torch.Tensor]:
    """sum_i alpha_i tau_i of the (already verified) files ``paths`` of ``entries``, key by key; plain-LoRA vectors
    as their weight updates s * B_i A_i, whose factors do not add. Key sets and shapes are checked first."""
    if entries[0].weight_updates:
        return merge_views([in_merge_space(e, VectorReader(p, header_shapes(p, e.name)))
                            for e, p in zip(entries, paths)], alphas)
    with contextlib.ExitStack() as stack:
        handles = [_open(stack, p) for p in paths]
        keys = check_layouts(entries, handles)
        return {key: merge_key(key, handles, alphas) for key in keys}


def _open(stack: contextlib.ExitStack, path: Path) -> Any:
    try:
        return stack.enter_context(safe_open(str(path), framework="pt"))
    except Exception as exc:  # safetensors raises its own types
        raise CorruptVectorError(f"vector file {path} is truncated or unreadable") from exc


def in_merge_space(entry: VectorEntry, vector: VectorReader) -> Mapping[str, torch.Tensor]:
    """The vector as merges and coefficients act on it: as stored, or a plain-LoRA vector's weight updates."""
    return LoraWeights(vector, entry.adapter.scaling) if entry.weight_updates else vector


def merge_views(views: list[Mapping[str, torch.Tensor]], alphas: list[float]) -> dict[str, torch.Tensor]:
    """sum_i alpha_i view_i, one parameter at a time (the views compute each tensor when read)."""
    keys = list(views[0])
    for i, view in enumerate(views[1:], 1):
        if view.shapes != views[0].shapes:
            raise BankError(f"vectors 0 and {i} adapt different layers or shapes")
    return {key: sum(alpha * view[key] for view, alpha in zip(views, alphas)) for key in keys}


def common_family(entries: list[VectorEntry]) -> Family:
    if not entries:
        raise BankError("no vectors selected")
    adapters = {e.adapter for e in entries}
    if len(adapters) > 1:
        listing = ", ".join(f"{e.name} ({e.adapter.describe() if e.adapter else 'full'})" for e in entries)
        raise IncompatibleVectorsError(f"cannot combine vectors of different adapters (or adapter and full "
                                       f"vectors): {listing}")
    families = {e.family for e in entries}
    if len(families) > 1:
        listing = ", ".join(f"{e.name} ({e.mode})" for e in entries)
        raise IncompatibleVectorsError(
            f"cannot combine non-linear and linearized vectors: {listing}; "
            f"select vectors of one family ({families_help()})"
        )
    return families.pop()


def check_bases(entries: list[VectorEntry], base: str | None) -> None:
    bases = {e.base for e in entries}
    if len(bases) > 1:
        listing = ", ".join(f"{e.name} ({short_fingerprint(e.base)})" for e in entries)
        raise IncompatibleVectorsError(f"vectors come from different base models: {listing}")
    if base is not None and bases != {base}:
        bad = ", ".join(sorted({e.name for e in entries if e.base != base}))
        raise IncompatibleVectorsError(
            f"vector(s) {bad} were fine-tuned from base {short_fingerprint(bases.pop())}, "
            f"not from the requested base {short_fingerprint(base)}"
        )


def check_layouts(entries: list[VectorEntry], handles: list[Any]) -> list[str]:
    """Identical key sets and shapes across vectors, checked from headers only."""
    first, keys = entries[0], list(handles[0].keys())
    shapes = {k: handles[0].get_slice(k).get_shape() for k in keys}
    for entry, handle in zip(entries[1:], handles[1:]):
        other = set(handle.keys())
        if other != set(keys):
            extra, lacking = sorted(other - set(keys)), sorted(set(keys) - other)
            raise BankError(
                f"vectors {first.name!r} and {entry.name!r} have different parameters: "
                f"only in {entry.name!r}: {extra[:5]}, only in {first.name!r}: {lacking[:5]}"
            )
        for key in keys:
            shape = handle.get_slice(key).get_shape()
            if shape != shapes[key]:
                raise BankError(
                    f"parameter {key!r} has shape {tuple(shapes[key])} in {first.name!r} "
                    f"but {tuple(shape)} in {entry.name!r}"
                )
    return keys


def merge_key(key: str, handles: list[Any], alphas: list[float]) -> torch.Tensor:
    """alpha-weighted sum of one parameter, holding one input tensor at a time."""
    import torch

    acc: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    for handle, alpha in zip(handles, alphas):
        tensor = handle.get_tensor(key)
        out_dtype = tensor.dtype if out_dtype is None else torch.promote_types(out_dtype, tensor.dtype)
        if acc is None:
            acc = torch.zeros(tensor.shape, dtype=acc_dtype(tensor.dtype))
        elif acc_dtype(tensor.dtype) == torch.float64 and acc.dtype != torch.float64:
            acc = acc.double()
        acc.add_(tensor.to(acc.dtype), alpha=alpha)
    assert acc is not None and out_dtype is not None
    if not out_dtype.is_floating_point and not out_dtype.is_complex:
        acc = acc.round()
    return acc.to(out_dtype)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    import torch

    if dtype == torch.float64 or not dtype.is_floating_point:
        return torch.float64
    return torch.float32
