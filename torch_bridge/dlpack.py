"""Zero-copy handoff between torch tensors and JAX arrays through DLPack.

`to_jax(tensor)` and `to_torch(array)` share the buffer (same address) or refuse:

- dtypes: float32, bfloat16, float16, int32, int64, bool. int64 needs JAX's x64 mode; with
  x64 off JAX would silently narrow to int32 (a copy), so it is refused.
- layout: JAX arrays are dense row-major. A non-contiguous tensor (or, on the CPU, a view whose
  address JAX will not take as is) is refused.
- device: the array lands on the JAX device matching the tensor's (CPU, or CUDA ordinal).

`copy=True` turns each refusal into a copy that says so (a `BridgeCopyWarning`), e.g. int64 ->
int32 after checking the values fit. `copy=None` copies a tensor whose *layout* JAX cannot
take (non-contiguous or misaligned) without a warning, for per-step inputs whose callers
document it (the steppers' `x` and `active`); it still refuses int64 narrowing. Nothing is
ever narrowed or moved silently.

Stream order on the GPU: both directions go through the DLPack stream protocol. JAX's
`from_dlpack` passes the stream it will read on to `tensor.__dlpack__`, and torch makes that
stream wait for the work queued on torch's current stream; `torch.from_dlpack(array)` passes
torch's current stream to `array.__dlpack__`, and JAX makes it wait until the array is
written. Neither blocks the host. `tests/test_bridge_gpu.py` proves it with a long producer.
`to_jax` sets that order up itself (`_order_for_jax`): torch's own `__dlpack__(stream=)` made
a CUDA event and looked its streams up at every call, 80-120 of the 250-350 us a step input took
to cross on an H200 (benchmarks/RESULTS.md, eighth session).
"""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import torch

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool)
_JAX_SHAREABLE = {jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int64, jnp.bool_)}


class BridgeCopyWarning(UserWarning):
    """A DLPack handoff had to copy (only ever with copy=True)."""


def _refuse_or_copy(copy: bool | None, why: str, fix: str) -> None:
    if copy is False:
        raise ValueError(f"to_jax(tensor): cannot share this tensor's buffer with JAX: {why}. {fix}, "
                         f"or pass copy=True to copy it")
    if copy:
        warnings.warn(f"to_jax copied the tensor: {why}", BridgeCopyWarning, stacklevel=3)


def _jax_device_for(tensor: torch.Tensor):
    if tensor.device.type not in ("cpu", "cuda"):  # e.g. "meta": no JAX device, not a GPU either
        raise ValueError(f"to_jax(tensor): the tensor is on {tensor.device}; JAX takes CPU and CUDA tensors")
    platform = "cpu" if tensor.device.type == "cpu" else "gpu"
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    index = tensor.device.index or 0
    if index >= len(devices):
        raise ValueError(f"to_jax(tensor): the tensor is on {tensor.device}, and JAX has no such device "
                         f"(JAX backends: {[d.platform for d in jax.devices()]})")
    return devices[index]


_HANDOFF = threading.local()  # per thread: JAX device -> (its external-ready stream, as a torch stream, an event)


class _Ordered:
    """A CUDA tensor whose DLPack export skips torch's own stream handshake (`_order_for_jax` did it)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __dlpack__(self, *, stream=None, **kwargs):
        del stream  # the stream JAX reads on already waits for torch's current one
        return self.tensor.__dlpack__(stream=-1, **kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def _order_for_jax(tensor: torch.Tensor, device) -> _Ordered | torch.Tensor:
    """tensor to hand to `jnp.from_dlpack`, with the stream JAX waits on for external writes made to
    wait for torch's current stream (the DLPack protocol's order), through one event reused per
    thread and device. Where JAX has no such stream, the tensor itself (torch's handshake)."""
    cache = _HANDOFF.__dict__.setdefault("by_device", {})
    if device not in cache:
        try:
            ptr = device.get_stream_for_external_ready_events()
        except jax.errors.JaxRuntimeError:
            ptr = None
        with torch.cuda.device(tensor.device):
            cache[device] = None if ptr is None else (ptr, torch.cuda.ExternalStream(ptr), torch.cuda.Event())
    if cache[device] is None:
        return tensor
    ptr, jax_stream, event = cache[device]
    current = torch.cuda.current_stream(tensor.device)
    if current.cuda_stream != ptr:
        event.record(current)
        jax_stream.wait_event(event)
    return _Ordered(tensor)


def to_jax(tensor: torch.Tensor, *, copy: bool | None = False) -> jax.Array:
    """The JAX array sharing `tensor`'s buffer: same shape, dtype and device.

    Raises TypeError for an unsupported dtype and ValueError when sharing is impossible
    (see the module docstring) unless copy=True, which copies and warns (copy=None: layout
    copies without a warning).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_jax(tensor): expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED:
        raise TypeError(f"to_jax(tensor): dtype {tensor.dtype} is not supported; expected one of {SUPPORTED}")
    if tensor.requires_grad:
        tensor = tensor.detach()
    device = _jax_device_for(tensor)
    if tensor.dtype == torch.int64 and not jax.config.jax_enable_x64:
        _refuse_or_copy(bool(copy), "int64 needs jax x64 mode (jax.config.update('jax_enable_x64', True))",
                        "Enable x64")
        info = torch.iinfo(torch.int32)
        if tensor.numel() and (tensor.min() < info.min or tensor.max() > info.max):
            raise OverflowError("to_jax(tensor): int64 values do not fit in int32; enable jax x64 mode")
        return jax.device_put(jnp.asarray(tensor.int().cpu().numpy()), device)
    if not tensor.is_contiguous():
        _refuse_or_copy(copy, f"it is not contiguous (strides {tensor.stride()})", "Call .contiguous()")
        tensor = tensor.contiguous()
    array = jnp.from_dlpack(_order_for_jax(tensor, device) if tensor.is_cuda else tensor)
    if tensor.numel() and array.unsafe_buffer_pointer() != tensor.data_ptr() and copy is not None:
        # JAX copied on import (on the CPU it does so for buffers it finds misaligned).
        _refuse_or_copy(copy, f"JAX copied it on import (address {tensor.data_ptr():#x} not accepted as is)",
                        "Pass a tensor that owns its storage (e.g. .clone())")
    return array


def to_torch(array: jax.Array) -> torch.Tensor:
    """The torch tensor sharing `array`'s buffer (JAX arrays are always dense and shareable).

    While the tensor is alive, JAX will not donate that buffer to a jitted call (it copies
    instead), so the tensor keeps its values; drop it to let the in-place updates resume.
    A deleted or donated array (no buffer left) raises ValueError.
    """
    if not isinstance(array, jax.Array):
        raise TypeError(f"to_torch(array): expected a jax.Array, got {type(array).__name__}")
    if isinstance(array, jax.core.Tracer):
        raise TypeError("to_torch(array): a traced array (inside jax.jit / grad / vmap) has no buffer to "
                        "share; call to_torch on the transformation's result")
    if array.is_deleted():
        raise ValueError("to_torch(array): the array has been deleted or donated to a jitted call (its "
                         "buffer is gone); use the array the call returned")
    if array.dtype not in _JAX_SHAREABLE:
        raise TypeError(f"to_torch(array): dtype {array.dtype} is not supported")
    return torch.from_dlpack(array)
