"""The torch stacks' stream snapshots: `snapshot` / `restore` and stream files (`jax_impl.snapshot`'s format).

`StackStreamIO` is a mixin of `model.StreamingStack` (it reads `self.config`, `self.dtype`,
`self.device` and the stack's `TorchStreamState`); the JAX side's counterpart is
`jax_impl/stream_io.py`. A snapshot or file taken on either side restores on the other.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from jax_impl.snapshot import (
    ARRAY_KEYS,
    check_restore_batch,
    check_ring_cast,
    check_snapshot_layout,
    check_snapshot_values,
    dtype_name,
    read_stream_file,
    snapshot_metadata,
    write_stream_file,
)

from .state import TorchStreamState


def read_torch_stream(path: str | os.PathLike) -> dict:
    """The snapshot dict a `save_stream` wrote (torch tensors on the CPU, "metadata" from the header)."""
    return read_stream_file(path, "pt")


def _as_torch(where: str, key: str, x) -> torch.Tensor:
    """A snapshot array as a torch tensor (a jax array or anything with __dlpack__ is viewed, not copied).

    A numpy bfloat16 array (ml_dtypes: what `jax_impl.read_stream` and `np.asarray` of a bf16 jax array
    give) has no DLPack dtype: its bits are viewed as uint16 and those as torch.bfloat16, exactly.
    """
    if isinstance(x, torch.Tensor):
        return x
    try:
        if isinstance(x, np.ndarray) and x.dtype.name == "bfloat16":
            return torch.from_dlpack(x.view(np.uint16)).view(torch.bfloat16)
        return torch.from_dlpack(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as err:
        raise TypeError(f"{where}: snapshot[{key!r}] ({type(x).__name__}) cannot be read as a torch tensor: "
                        f"{err}; pass a torch tensor") from None


class StackStreamIO:
    """The snapshot methods of a torch stack (mixed into `model.StreamingStack`)."""

    def snapshot(self) -> dict:
        """The stream so far, as copies, in the format of `jax_impl.snapshot`:

        {"k", "v": [L, B, H, C, D] (the stack's dtype), "offset", "start_offset": int64 [B],
        "metadata": dict[str, str] (config fields, dtype, batch size)}. `restore` on a stack of
        the same config (this class, the other path, or the JAX-backed drop-in) continues it.
        """
        s = self._require_state("snapshot")
        tensors = {key: getattr(s, key).clone() for key in ARRAY_KEYS}
        return {**tensors, "metadata": snapshot_metadata(self.config, dtype_name(self.dtype), s.batch_size)}

    @torch.no_grad()
    def restore(self, snapshot: dict, resize: bool = False) -> None:
        """Continue the stream of `snapshot` (from `snapshot()` here, on a drop-in, or a `jax_impl.Streamer`).

        Replaces the state with copies on this stack's device: the snapshot stays valid. A streaming
        stack takes a snapshot of its own batch size only, unless `resize=True` (then the snapshot's
        batch size replaces its own); before `streaming_init` the snapshot gives the batch size.
        Validated first (`jax_impl.snapshot`: keys, config, batch size, shapes, dtypes,
        0 <= start_offset <= offset); k, v of bf16/f16 widen
        exactly into a float32 stack, a narrowing is refused; int32 offsets widen to int64.
        On a refusal nothing changes. Same dtype and device: bit-identical continuation.
        """
        self._restore(snapshot, resize, "restore(snapshot)")

    def _restore(self, snapshot: dict, resize: bool, where: str) -> None:
        """`restore`, its errors headed by `where`."""
        layout = check_snapshot_layout(self.config, snapshot, where)
        check_restore_batch(layout.batch_size, None if self._state is None else self._state.batch_size, resize,
                            where)
        check_ring_cast(layout.dtype, dtype_name(self.dtype), where)
        t = {key: _as_torch(where, key, snapshot[key]) for key in ARRAY_KEYS}
        check_snapshot_values(t["offset"].tolist(), t["start_offset"].tolist(), torch.iinfo(torch.long).max,
                              where)
        ring = {key: t[key].to(device=self.device, dtype=self.dtype, copy=True) for key in ("k", "v")}
        idx = {key: t[key].to(device=self.device, dtype=torch.long, copy=True)
               for key in ("offset", "start_offset")}
        self._state = TorchStreamState(**ring, **idx)
        self._bounds = max(t["offset"].tolist()), max(t["start_offset"].tolist())  # the bump guard's

    def save_stream(self, path: str | os.PathLike) -> None:
        """Write `snapshot()` to a safetensors file: the four arrays as tensors, "metadata" in the header;
        ValueError naming `path` where it cannot be written."""
        snap = self.snapshot()
        meta = snap.pop("metadata")
        write_stream_file(path, {key: v.contiguous().cpu() for key, v in snap.items()}, meta, "pt")

    def load_stream(self, path: str | os.PathLike, resize: bool = False) -> None:
        """`restore` the stream that `save_stream` (of either path) wrote to `path` (`resize`: restore's)."""
        self._restore(read_torch_stream(path), resize, f"load_stream({os.fspath(path)})")
