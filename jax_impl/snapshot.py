"""Stream snapshots: one format for the torch stacks, the JAX-backed drop-ins and `jax_impl.Streamer`.

A snapshot is a dict (what `snapshot()` returns and `restore()` takes, on every side):

    "k", "v":                 [L, B, H, C, D] ring values, the stack's float dtype
    "offset", "start_offset": [B] integer positions (int64 on the torch path, int32 on the JAX
                              path unless jax x64 mode is on)
    "metadata":               dict[str, str]: "format", "stack" (the config class), "config"
                              (its fields as JSON), "dtype" (of k and v), "batch_size"

The arrays are torch tensors (torch stacks, drop-ins) or jax arrays (`Streamer`,
`state_snapshot`); every `restore` copies them, so a snapshot stays valid while the stream
goes on. In a safetensors file (`save_stream` / `load_stream`) the four arrays are the file's
tensors and "metadata" its header's string metadata, so a file written by either side loads
on the other.

`restore` validates before it touches anything: keys, metadata (config fields, dtype, batch
size: the stream's own unless `resize=True`, `check_restore_batch`), shapes, dtypes and values (0 <= start_offset <= offset <= the index dtype's maximum),
with errors naming the key. Dtypes follow the rule of the whole package: an exact widening is
applied (bf16/f16 rings into a float32 stack; int32 offsets into int64 ones; int64 offsets
into int32 ones only after the values are checked to fit), anything that would round is
refused.

This module is framework-neutral (no torch, no jax): arrays are only asked for `.shape` and
`.dtype`, and values are passed in as Python ints. So it also holds the rules of a stream that
both sides apply outside snapshots, the torch side without importing jax: a row index
(`row_index`), a ring's size (`check_ring_size`) and the guard of `bump_slot_start` (`check_bump`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jax_impl.config import StackConfig

FORMAT = "personaplex-jax stream snapshot v1"
ARRAY_KEYS = ("k", "v", "offset", "start_offset")
KEYS = (*ARRAY_KEYS, "metadata")
RING_DTYPES = ("float32", "bfloat16", "float16", "float64")
INDEX_DTYPES = ("int32", "int64")
# (from, to) ring dtype casts that are exact: every value of `from` is a value of `to`.
_EXACT_FLOAT = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"),
                ("float16", "float64"), ("float32", "float64")}


class SnapshotError(ValueError):
    """A snapshot does not fit the stack it is restored into (the message names the key)."""


def dtype_name(x) -> str:
    """'float32', 'bfloat16', 'int64', ... of a torch tensor, jax array, numpy array or dtype."""
    dt = getattr(x, "dtype", x)
    return str(dt).removeprefix("torch.")


def exact_float_cast(src: str, dst: str) -> bool:
    """True when casting floats of dtype `src` to `dst` is exact (the same dtype, or a widening)."""
    return src == dst or (src, dst) in _EXACT_FLOAT


def config_fields(config: StackConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def ring_shape(config: StackConfig, batch_size: int) -> tuple[int, ...]:
    """(L, B, H, C, D) of each ring (k, v) of a `config` stack streaming `batch_size` rows."""
    c = config
    return (c.num_layers, batch_size, c.num_heads, c.capacity, c.head_dim)


def check_ring_size(op: str, config: StackConfig, batch_size: int, dtype) -> None:
    """ValueError naming `op(batch_size)` where a ring [L, batch_size, H, C, D] of `dtype` (a jax, numpy
    or torch dtype) is 2**62 bytes or more: no device holds it, XLA ends the process on a shape whose
    size overflows, torch fails with an error naming no argument. Allocates nothing: a stepper checks
    before it releases the stream it holds."""
    ring = ring_shape(config, batch_size)
    if math.prod(ring) * dtype.itemsize >= 2**62:
        raise ValueError(f"{op}(batch_size): a ring of {list(ring)} {dtype_name(dtype)} (batch_size {batch_size}) is "
                         f"more bytes than any device holds (2**62 or more)")


def row_index(op: str, b, batch_size: int) -> int:
    """b as an int after checking it is a row index of a stream of `batch_size` rows: the one rule of
    every recycle op on both sides (the JAX ops, `Streamer`, the torch stacks, the drop-ins). A row index
    is a Python or numpy integer, or a 0-d integer array (numpy, jax) or tensor (torch), never a bool;
    anything else TypeError, a row out of 0..batch_size-1 IndexError, naming `op`. A jax array or a torch
    tensor is read on the host (a device sync where it lives on one)."""
    shape = tuple(getattr(b, "shape", ()))
    try:
        if isinstance(b, bool) or dtype_name(getattr(b, "dtype", "")) == "bool" or shape:
            raise TypeError
        index = operator.index(b)
    except TypeError:
        got = f"{type(b).__name__} of {dtype_name(b.dtype)}{list(shape)}" if shape else f"{type(b).__name__} {b!r}"
        raise TypeError(f"{op}(b): b must be an integer row index (a Python or numpy integer, or a 0-d integer "
                        f"array or tensor; not a bool), got {got}") from None
    if not 0 <= index < batch_size:
        raise IndexError(f"{op}(b): b={index} is out of range for batch_size {batch_size}")
    return index


def check_bump(op: str, b: int, bounds: tuple[int, int], read: Callable[[], tuple[Sequence[int], Sequence[int]]],
               index: str) -> tuple[int, int]:
    """The host-side guard of a `bump_slot_start` of row b (`jax_impl.Streamer`'s, the torch stacks'),
    as `jax_impl.state.check_headroom` is a step's: OverflowError naming `op` and the row, before
    anything changes, where the bump would take start_offset[b] past the largest `index` position
    ("int32" or "int64", the offsets' dtype).

    bounds: (offset_bound, start_bound), Python ints such that every row's offset <= offset_bound
    and its start_offset <= max(offset_bound, start_bound) (start_offset passes offset only by
    bumps). read() -> (offsets, start_offsets), the rows' values as ints: called only where the
    bounds cannot rule the overflow out (one device sync). Returns the bounds after the bump.
    """
    offset_bound, start_bound = bounds
    limit = int(np.iinfo(index).max)
    if max(offset_bound, start_bound) + 1 <= limit:
        return offset_bound, max(offset_bound, start_bound) + 1
    offsets, starts = read()
    start = int(starts[b])
    if start + 1 > limit:
        raise OverflowError(f"{op}(b): row {b}'s start_offset is {start}, the largest {index} position: one more "
                            f"would wrap (refused, nothing changed); reset_rows() the row first"
                            + (" (or enable jax x64 for int64 offsets)" if index == "int32" else ""))
    return max(map(int, offsets), default=0), max(max(map(int, starts), default=0), start + 1)


def snapshot_metadata(config: StackConfig, dtype: str, batch_size: int) -> dict[str, str]:
    """The string metadata of a snapshot of a `config` stack holding `dtype` rings of `batch_size` rows."""
    return {"format": FORMAT, "stack": type(config).__name__,
            "config": json.dumps(config_fields(config), sort_keys=True),
            "dtype": dtype, "batch_size": str(batch_size)}


@dataclasses.dataclass(frozen=True)
class SnapshotLayout:
    """What `check_snapshot_layout` found: rows, ring dtype and offsets dtype (names)."""

    batch_size: int
    dtype: str
    index_dtype: str


def check_snapshot_layout(config: StackConfig, snapshot, where: str = "restore(snapshot)") -> SnapshotLayout:
    """Check a snapshot's keys, metadata, shapes and dtypes against `config` (no values read).

    Raises SnapshotError (a ValueError) for a missing / unexpected key, a metadata or shape
    mismatch, TypeError for a dtype that is not a ring / index dtype.
    """
    if not isinstance(snapshot, Mapping):
        raise TypeError(f"{where}: expected a snapshot dict with keys {list(KEYS)} (from snapshot()), "
                        f"got {type(snapshot).__name__}")
    missing = [k for k in KEYS if k not in snapshot]
    unexpected = [k for k in snapshot if k not in KEYS]
    if missing or unexpected:
        raise SnapshotError(f"{where}: the snapshot must have exactly the keys {list(KEYS)}; "
                            f"missing {missing}, unexpected {unexpected}")
    meta = snapshot["metadata"]
    if not isinstance(meta, Mapping):
        raise SnapshotError(f"{where}: snapshot['metadata'] must be a dict of strings, "
                            f"got {type(meta).__name__}")
    need = ("format", "stack", "config", "dtype", "batch_size")
    absent = [k for k in need if k not in meta]
    if absent:
        raise SnapshotError(f"{where}: snapshot['metadata'] lacks {absent}: not a stream snapshot")
    if meta["format"] != FORMAT:
        raise SnapshotError(f"{where}: snapshot['metadata']['format'] is {meta['format']!r}, "
                            f"expected {FORMAT!r}")
    if meta["stack"] != type(config).__name__:
        raise SnapshotError(f"{where}: snapshot['metadata']['stack'] is {meta['stack']!r}: the snapshot is "
                            f"of another stack than this {type(config).__name__}")
    try:
        fields = json.loads(meta["config"])
    except (TypeError, ValueError):
        raise SnapshotError(f"{where}: snapshot['metadata']['config'] is not JSON: "
                            f"{meta['config']!r}") from None
    want = json.loads(json.dumps(config_fields(config)))  # as it reads back (a tuple field as a list)
    if not isinstance(fields, dict) or fields != want:
        have = fields if isinstance(fields, dict) else {}
        diff = [f"{k}: snapshot {have.get(k, '(absent)')!r}, stack {v!r}" for k, v in want.items()
                if have.get(k, object()) != v]
        diff += [f"{k}: snapshot {have[k]!r}, stack (absent)" for k in have if k not in want]
        raise SnapshotError(f"{where}: snapshot['metadata']['config'] does not match this stack's config: "
                            + "; ".join(diff))
    try:
        B = int(meta["batch_size"])
    except (TypeError, ValueError):
        B = 0
    if B <= 0 or str(B) != str(meta["batch_size"]):
        raise SnapshotError(f"{where}: snapshot['metadata']['batch_size'] must be a positive int, "
                            f"got {meta['batch_size']!r}")
    for key in ARRAY_KEYS:
        if not hasattr(snapshot[key], "shape") or not hasattr(snapshot[key], "dtype"):
            raise TypeError(f"{where}: snapshot[{key!r}] must be an array (torch tensor, jax or numpy "
                            f"array), got {type(snapshot[key]).__name__}")
    ring = ring_shape(config, B)
    for key, shape in (("k", ring), ("v", ring), ("offset", (B,)), ("start_offset", (B,))):
        got = tuple(snapshot[key].shape)
        if got != shape:
            raise SnapshotError(f"{where}: snapshot[{key!r}] has shape {list(got)}; this stack with "
                                f"batch_size {B} (metadata) expects {list(shape)}")
    dtype = dtype_name(snapshot["k"])
    if dtype not in RING_DTYPES:
        raise TypeError(f"{where}: snapshot['k'] has dtype {dtype}; rings are one of {list(RING_DTYPES)}")
    if dtype_name(snapshot["v"]) != dtype:
        raise TypeError(f"{where}: snapshot['v'] has dtype {dtype_name(snapshot['v'])}, snapshot['k'] "
                        f"{dtype}: they must agree")
    if meta["dtype"] != dtype:
        raise SnapshotError(f"{where}: snapshot['metadata']['dtype'] is {meta['dtype']!r} but snapshot['k'] "
                            f"holds {dtype}")
    index = dtype_name(snapshot["offset"])
    for key in ("offset", "start_offset"):
        if dtype_name(snapshot[key]) not in INDEX_DTYPES:
            raise TypeError(f"{where}: snapshot[{key!r}] has dtype {dtype_name(snapshot[key])}; offsets are "
                            f"one of {list(INDEX_DTYPES)}")
    if dtype_name(snapshot["start_offset"]) != index:
        raise TypeError(f"{where}: snapshot['start_offset'] has dtype "
                        f"{dtype_name(snapshot['start_offset'])}, snapshot['offset'] {index}: they must agree")
    return SnapshotLayout(batch_size=B, dtype=dtype, index_dtype=index)


def check_restore_batch(snapshot_batch: int, batch_size: int | None, resize, where: str = "restore(snapshot)") -> None:
    """Refuse a snapshot of `snapshot_batch` rows into a stream of `batch_size` rows unless `resize`.

    A restore replaces the whole stream, so a snapshot of another batch size would silently turn a
    stepper of B rows into one of the snapshot's: only asked for (`resize=True`). batch_size None:
    no stream yet (a torch stack before `streaming_init`), whose batch size the snapshot gives.
    SnapshotError (a ValueError) naming both sizes and the way out; TypeError for a non-bool resize.
    """
    if not isinstance(resize, bool):
        raise TypeError(f"{where}: resize must be a bool, got {type(resize).__name__}")
    if resize or batch_size is None or snapshot_batch == batch_size:
        return
    raise SnapshotError(f"{where}: the snapshot holds {snapshot_batch} rows (batch_size {snapshot_batch}), this "
                        f"stream {batch_size}; nothing was changed. With resize=True the snapshot's "
                        f"{snapshot_batch} rows replace the stream")


def check_ring_cast(src: str, dst: str, where: str = "restore(snapshot)") -> None:
    """TypeError unless the snapshot's ring dtype `src` converts exactly to the stack's `dst`."""
    if not exact_float_cast(src, dst):
        raise TypeError(f"{where}: snapshot['k'] and ['v'] hold {src}; this stack holds {dst}, and casting "
                        f"{src} to {dst} would round the stream's history (refused): restore into a stack "
                        f"built with dtype {src}")


def check_snapshot_values(offset: Sequence[int], start_offset: Sequence[int], index_max: int,
                          where: str = "restore(snapshot)") -> None:
    """SnapshotError unless 0 <= offset[b] <= index_max and 0 <= start_offset[b] <= index_max for every row b.

    start_offset may exceed offset: `bump_slot_start` is a plain += 1, and the tick after
    reset_slot + bump_slot_start has start_offset == offset + 1 (a snapshot may be taken then).
    """
    for b, (off, start) in enumerate(zip(offset, start_offset, strict=True)):
        if not 0 <= off <= index_max:
            raise SnapshotError(f"{where}: snapshot['offset'][{b}] = {off} is out of range 0..{index_max} "
                                f"(the largest position of this stack's offsets)")
        if not 0 <= start <= index_max:
            raise SnapshotError(f"{where}: snapshot['start_offset'][{b}] = {start} is out of range "
                                f"0..{index_max}")


def read_stream_file(path, framework: str) -> dict:
    """The snapshot dict in a stream file (tensors of `framework`, "numpy" or "pt" on the CPU, and
    "metadata" from the safetensors header); ValueError naming the path for an unreadable file
    (`checkpoint.safetensors_header`'s checks: a directory, a truncated file, a key named twice; a
    tensor of a dtype the framework cannot hold)."""
    import os

    from jax_impl.checkpoint import CheckpointError, read_safetensors, safetensors_header

    try:
        header = safetensors_header(path)
        meta = header.get("__metadata__") or {}
        snap = read_safetensors(path, [k for k in header if k != "__metadata__"], framework)
    except (CheckpointError, OSError) as err:
        raise ValueError(f"{os.fspath(path)} is not a readable stream file: {err}") from None
    if "metadata" in snap:
        raise ValueError(f"{os.fspath(path)}: a tensor named 'metadata' is not part of a stream snapshot")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{os.fspath(path)} is not a readable stream file: its header's metadata is not strings")
    return {**snap, "metadata": dict(meta)}


def write_stream_file(path, arrays: Mapping, metadata: Mapping[str, str], framework: str) -> None:
    """Write a stream file: `arrays` (numpy arrays for framework "numpy", CPU torch tensors for
    "pt") as its tensors, `metadata` in its header; ValueError naming the path where it cannot be
    written (`checkpoint.write_safetensors`), as `read_stream_file` names it."""
    from jax_impl.checkpoint import write_safetensors

    write_safetensors(path, arrays, framework, metadata, what="stream file")


__all__ = ["FORMAT", "KEYS", "SnapshotError", "SnapshotLayout", "check_bump", "check_ring_cast",
           "check_ring_size", "check_snapshot_layout", "check_snapshot_values", "dtype_name", "exact_float_cast",
           "read_stream_file", "ring_shape", "row_index", "snapshot_metadata", "write_stream_file"]
