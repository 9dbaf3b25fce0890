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
to cross on an H200 (benchmarks/RESULTS.md, "dropin_overhead"). It then hands torch's capsule
(`torch.utils.dlpack.to_dlpack`) to the call `jnp.from_dlpack` makes after its checks
(`_capsule_import`), having made both sides' checks itself: 25 against 44 us a step input on an
idle H200 (RESULTS.md, "dropin_overhead").
"""

from __future__ import annotations

import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import torch
from torch.utils.dlpack import to_dlpack

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


def jax_device_for(tensor: torch.Tensor):
    """The JAX device matching `tensor`'s (ValueError where JAX has none)."""
    return _jax_device(tensor.device.type, tensor.device.index)


@functools.cache  # JAX's devices are fixed once its backends are up; a refusal is not cached
def _jax_device(kind: str, index: int | None):
    where, index = str(torch.device(kind, index)), index or 0
    if kind not in ("cpu", "cuda"):  # e.g. "meta": no JAX device, not a GPU either
        raise ValueError(f"to_jax(tensor): the tensor is on {where}; JAX takes CPU and CUDA tensors")
    try:
        devices = jax.devices("cpu" if kind == "cpu" else "gpu")
    except RuntimeError:
        devices = []
    if index >= len(devices):
        raise ValueError(f"to_jax(tensor): the tensor is on {where}, and JAX has no such device "
                         f"(JAX backends: {[d.platform for d in jax.devices()]})")
    return devices[index]


@functools.cache
def _capsule_import():
    """JAX's import of a DLPack capsule, `import_(capsule, device, stream, dl_device_type)`, the call
    `jnp.from_dlpack` makes after its own checks; None where this jaxlib lacks it (then
    `jnp.from_dlpack`). Private to JAX, so looked up once and called as `jnp.from_dlpack` calls
    it on this version. Why: with `jnp.from_dlpack` and `Tensor.__dlpack__`, `to_jax` took 44 us a
    step input on an idle H200, with this call and `to_dlpack` 25 (benchmarks/RESULTS.md,
    "dropin_overhead"); `to_jax` makes their checks itself (the devices and streams once per device)."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    fn = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    if fn is None:
        return None
    if jaxlib_extension_version >= 467:  # the DLPack device type is passed on
        return lambda capsule, device, stream, dl_type: fn(capsule, device, stream, None, dl_type)
    return lambda capsule, device, stream, dl_type: fn(capsule, device, stream, None)


_HANDOFF = threading.local()  # per thread: JAX device -> (its external-ready stream, as a torch stream, an event)
_DL_CPU, _DL_CUDA = 1, 2  # DLPack device types


def _order_for_jax(tensor: torch.Tensor, device) -> int | None:
    """The stream JAX waits on for external writes (a pointer), made to wait for torch's current
    stream (the DLPack protocol's order) through one event reused per thread and device; None
    where JAX has no such stream (then torch's own handshake, `jnp.from_dlpack`)."""
    cache = _HANDOFF.__dict__.setdefault("by_device", {})
    if device not in cache:
        try:
            ptr = device.get_stream_for_external_ready_events()
        except jax.errors.JaxRuntimeError:
            ptr = None
        with torch.cuda.device(tensor.device):
            cache[device] = None if ptr is None else (ptr, torch.cuda.ExternalStream(ptr), torch.cuda.Event())
    if cache[device] is None:
        return None
    ptr, jax_stream, event = cache[device]
    current = torch.cuda.current_stream(tensor.device)
    if current.cuda_stream != ptr:
        event.record(current)
        jax_stream.wait_event(event)
    return ptr


def _import(tensor: torch.Tensor, device) -> jax.Array:
    """`tensor` as a JAX array on `device` (JAX's DLPack import; on the CPU it may copy, see to_jax)."""
    import_ = _capsule_import()
    dl_type = tensor.__dlpack_device__()[0]
    if import_ is None or dl_type not in (_DL_CPU, _DL_CUDA):  # e.g. pinned memory: JAX's own checks
        return jnp.from_dlpack(tensor)
    stream = None if dl_type == _DL_CPU else _order_for_jax(tensor, device)
    if stream is None and dl_type == _DL_CUDA:
        return jnp.from_dlpack(tensor)
    # torch's capsule without its handshake (`__dlpack__`'s checks, 2-12 us, are to_jax's own):
    # JAX's reads wait for `stream`, which waits for torch's current one
    return import_(to_dlpack(tensor), device, stream, dl_type)


def to_jax(tensor: torch.Tensor, *, copy: bool | None = False) -> jax.Array:
    """The JAX array sharing `tensor`'s buffer: same shape, dtype and device.

    Raises TypeError for an unsupported dtype or layout (sparse) and ValueError when sharing is
    impossible (see the module docstring) unless copy=True, which copies and warns (copy=None:
    layout copies without a warning).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_jax(tensor): expected a torch.Tensor, got {type(tensor).__name__}")
    if not (copy is None or isinstance(copy, bool)):
        raise TypeError(f"to_jax(copy): expected True, False or None, got {copy!r}")
    if tensor.dtype not in SUPPORTED:
        raise TypeError(f"to_jax(tensor): dtype {tensor.dtype} is not supported; expected one of {SUPPORTED}")
    if tensor.layout != torch.strided:
        raise TypeError(f"to_jax(tensor): layout {tensor.layout} is not supported; expected a dense tensor "
                        f"(torch.strided: call .to_dense())")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_neg():  # a lazy negation (e.g. the imaginary part of a conjugate): its buffer holds -values
        _refuse_or_copy(copy, "it is a lazily negated view (its buffer holds the negated values)",
                        "Call .resolve_neg()")
        tensor = tensor.resolve_neg()
    device = jax_device_for(tensor)
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
    array = _import(tensor, device)
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
    if len(array.sharding.device_set) > 1:
        raise ValueError(f"to_torch(array): the array is split over {len(array.sharding.device_set)} devices, and a "
                         f"tensor views one buffer; view each shard (array.addressable_shards[i].data) or gather it")
    return torch.from_dlpack(array)
