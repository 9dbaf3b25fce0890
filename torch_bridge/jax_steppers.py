"""Drop-in torch-facing steppers backed by the JAX path.

`JaxTemporalStreaming` and `JaxMimiTransformer` take the same constructor keywords and have
the same methods as `TemporalStreaming` and `MimiTransformer` (they are subclasses: weights,
checkpoint I/O and input validation are shared), take and return torch tensors on the
module's device, and keep the streaming state as JAX arrays, stepped by the jitted JAX step
with the state donated. The JAX parameters are DLPack views of the module's own weight
buffers (taken at `streaming_init`): no copy, and an in-place edit of a buffer (`load_weights`,
`init_weights`, ...) is seen by the next step. A module conversion (`.to()`, `.float()`,
`.cuda()`, `.share_memory()`, ...) takes the views again and moves the JAX state along (or
refuses, as the torch stacks do); `snapshot()` / `restore()` cross with the torch stacks.

`from_torch(module)` builds the JAX stepper on the very same buffers as a torch stack.
"""

from __future__ import annotations

import jax
import torch

import jax_impl
from jax_impl.kernel_choice import JAX_KERNELS, check_head_dim, check_kernels
from jax_impl.model import check_loop_options
from jax_impl.snapshot import (
    ARRAY_KEYS,
    check_restore_batch,
    check_ring_cast,
    check_snapshot_layout,
    dtype_name,
)

from .depformer import Depformer
from .dlpack import jax_device_for, to_jax, to_torch
from .jax_depformer import JaxDepformer
from .model import MimiTransformer, StreamingStack, TemporalStreaming
from .state import TorchStreamState


class JaxBacked:
    """Mixin over a torch stack: the state lives in a `jax_impl.Streamer` (jitted step, state
    donated, host-side overflow guard); inputs and outputs cross through DLPack."""

    def __init__(self, *args, layer_loop: str = "python", kernels: str = "auto", **kwargs):
        """kernels: the JAX step's, in the one vocabulary (`jax_impl.kernel_choice`): "auto",
        "reference", "pallas", or "twin" (the Pallas twins: the bits of the torch stack built with
        kernels="twin"); `self.kernels` says it. layer_loop: "python" or "scan"."""
        check_kernels(f"{type(self).__name__}(kernels)", kernels, JAX_KERNELS)
        check_loop_options(layer_loop)
        super().__init__(*args, **kwargs)
        check_head_dim(f"{type(self).__name__}(kernels)", self.config, kernels)
        self.kernels = kernels  # what steps this module: the JAX step's kernels
        self._layer_loop = layer_loop
        self._streamer: jax_impl.Streamer | None = None
        self._viewed = None  # (names, `_identity`) of the weight buffers the params view

    @staticmethod
    def _identity(weights) -> tuple:
        """What a JAX view of each buffer depends on: its memory, dtype, device and shape."""
        return tuple((w.data_ptr(), w.dtype, w.device, w.shape) for w in weights)

    def jax_params(self) -> dict:
        """The Flax variables, as zero-copy JAX views of this module's weight buffers."""
        weights, views = self.weights(), {}
        for name, w in weights.items():
            try:
                views[name] = to_jax(w)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{type(self).__name__}: the weight {name}: {err}") from None
        params = jax_impl.weights.nest_params(self.config, views)
        self._viewed = tuple(weights), self._identity(weights.values())
        return params

    def _follow_weights(self) -> None:
        """Before a step: a buffer replaced or moved since the params were taken (an attribute set, a
        `load_state_dict(assign=True)`, the torch twin's `share_memory()` moving the shared storage) is
        viewed again, as the torch module would read it; the old views would read the old weights, or
        freed memory. A weight that requires grad is refused, as x is: JAX's step is outside torch's
        autograd."""
        names, viewed = self._viewed
        weights = [self._buffers[name] for name in names]  # a few us a step (`weights()` takes ~12)
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            name = next(n for n, w in zip(names, weights) if w.requires_grad)
            raise TypeError(f"step: the weight {name} requires grad, and this {type(self).__name__} steps in JAX, "
                            f"where torch's autograd cannot follow; step the torch module, or detach the weights")
        if self._identity(weights) != viewed:
            self._streamer.convert(self.jax_params())

    @property
    def jax_state(self) -> jax_impl.StreamState | None:
        return None if self._streamer is None else self._streamer.state

    @property
    def state(self) -> TorchStreamState | None:
        """Torch views (DLPack, no copy) of the JAX state; offsets are int32 unless jax x64 is on.

        While a view is alive the next step cannot donate that buffer and copies it instead:
        look, then let the views go (or `.clone()` what you keep). They are for reading: the host's
        overflow guard does not see offsets written through them (`restore` a snapshot instead). A
        stream split over devices (`torch_bridge.sharding.shard_dropin`) has no single buffer to view:
        RuntimeError, pointing to `snapshot()` (torch copies on the module's device).
        """
        s = self.jax_state
        if s is None:
            return None
        devices = s.k.sharding.device_set
        if len(devices) > 1:
            raise RuntimeError(f"state: this {type(self).__name__}'s stream is split over {len(devices)} devices "
                               f"(shard_dropin), so no single buffer holds it to view as torch tensors; use "
                               f"snapshot() (torch copies on the module's device)")
        return TorchStreamState(*(to_torch(a) for a in (s.k, s.v, s.offset, s.start_offset)))

    def _require_state(self, op: str):
        if self._streamer is None:
            raise RuntimeError(f"{op}() called before streaming_init(batch_size)")
        return self._streamer.state

    def streaming_init(self, batch_size: int) -> None:
        """A fresh JAX state for `batch_size` rows; no torch ring is allocated (the torch stack's
        state stays None). The batch size is checked and the weights viewed first (a batch size whose
        ring no device holds, a buffer JAX cannot share: refused with the stream as it was), then the
        previous JAX state is released, then the new one made."""
        self._check_batch_size(batch_size)
        params = self.jax_params()
        self._state = None
        self._streamer = None
        self._streamer = self._new_streamer(batch_size, params=params)

    def _new_streamer(self, batch_size: int, cls=jax_impl.Streamer, params=None, **placement) -> jax_impl.Streamer:
        """A fresh `cls` stream of this module's weights (`params`, else viewed here) and options, its state
        made on the weights' device, or where `placement` says (`ShardedStreamer`'s mesh, axis,
        output_device)."""
        params = self.jax_params() if params is None else params
        in_proj = params["params"]["layers"]["in_proj"]
        return cls(self.config, params, batch_size, in_proj.dtype, layer_loop=self._layer_loop,
                   rope_freqs=self.rope_freqs(), kernels=self.kernels,
                   **(placement or {"device": in_proj.devices().pop()}))

    def streaming_end(self) -> None:
        """Drop the JAX state (back to before `streaming_init`)."""
        self._streamer = None
        self._state = None

    def _is_streaming(self) -> bool:
        return self._streamer is not None

    def _state_op(self, op: str, *args) -> None:
        # copy=None: a mask JAX cannot take as it is (from numpy, a slice, non-contiguous) is
        # copied (B bools), as the torch path accepts it.
        args = [to_jax(a, copy=None) if isinstance(a, torch.Tensor) else a for a in args]
        getattr(self._streamer, "reset_streaming" if op == "reset" else op)(*args)

    def _apply(self, fn, recurse=True):
        """The torch stack's conversions (`.to()`, `.float()`, `.cpu()`, `.share_memory()`, ...; see
        `StreamingStack._apply`: the same refusals), with the JAX side following while streaming:
        the params become views of the new buffers again (DLPack, no copy), and the JAX state
        moves to the matching JAX device with its rings widened exactly (`Streamer.convert`;
        offsets stay int32/int64 as they were). A device JAX does not have (e.g. "meta") is
        refused while streaming, before anything changes. `.share_memory()` shares the weight
        buffers; the state stays JAX's own (JAX arrays cannot live in torch shared memory).
        """
        if self._streamer is None:
            return super()._apply(fn, recurse)
        probe = self._conversion_target(fn)
        try:
            device = jax_device_for(probe)
        except ValueError:
            raise ValueError(f"cannot move a streaming {type(self).__name__} to {probe.device}: its state "
                             f"lives in JAX, which has no such device (JAX devices: {jax.devices()}); nothing was "
                             f"changed. streaming_end() first to move the weights alone") from None
        buffers = dict(self._buffers)
        super()._apply(fn, recurse)
        try:
            self._streamer.convert(self.jax_params(), device=device, rope_freqs=self.rope_freqs())
        except BaseException:
            self._buffers.update(buffers)  # the JAX side could not follow: put the old buffers back
            raise
        return self

    def snapshot(self) -> dict:
        """As the torch stack's `snapshot()`: torch tensors (views of fresh JAX copies, on the module's
        device); offsets int32 unless jax x64 is on. Restores into either class."""
        self._require_state("snapshot")
        snap = self._streamer.snapshot()
        return {key: v if key == "metadata" else to_torch(v) for key, v in snap.items()}

    def _restore(self, snapshot: dict, resize: bool, where: str) -> None:
        """The torch stack's `restore` and `load_stream` (another batch size only with `resize=True`), into
        the JAX state (`Streamer.restore`: validated copies, the overflow bound recomputed). Takes torch
        tensors (any device JAX has), jax or numpy arrays; int64 offsets (a torch stack's) are checked to
        fit JAX's index dtype, then converted exactly. On a refusal nothing changes (not streaming: still
        not streaming). Errors headed by `where`."""
        layout = check_snapshot_layout(self.config, snapshot, where)
        check_restore_batch(layout.batch_size, None if self._streamer is None else self._streamer.batch_size, resize,
                            where)
        check_ring_cast(layout.dtype, dtype_name(self.dtype), where)
        arrays = {}
        for key in ARRAY_KEYS:
            a = snapshot[key]
            if isinstance(a, torch.Tensor):
                a = a.detach()
                # offsets: B ints read on the host (values checked by Streamer.restore);
                # rings: shared or copied (Streamer.restore copies them again, into JAX's own buffers)
                a = a.cpu().numpy() if key in ("offset", "start_offset") else to_jax(a, copy=None)
            arrays[key] = a
        streamer = self._streamer if self._streamer is not None else self._new_streamer(layout.batch_size)
        streamer._restore({**arrays, "metadata": snapshot["metadata"]}, resize, where)
        self._streamer = streamer

    def step(self, x: torch.Tensor, active: torch.Tensor | None = None):
        """Same contract as the torch stack's step; returns torch tensors on the module's device.

        x and active are shared with JAX when it can take them as they are, copied otherwise
        (a non-contiguous or misaligned input: a few KB per step). No active: the JAX step's own
        all-rows mask (no torch mask made and handed over each step).

        The outputs are ordered on torch's current stream (DLPack's protocol): to wait for them, wait
        on that stream (`torch.cuda.current_stream().synchronize()`, or an event), not on the device.
        `torch.cuda.synchronize()` also waits for JAX's own streams, where PjRt queues a host callback
        behind each step: on an H200 it added 0.01-0.51 ms a step (benchmarks/RESULTS.md, "dropin_overhead").
        """
        _, active = self._check_step_inputs(x, active)
        if torch.is_grad_enabled() and x.requires_grad:
            raise TypeError(f"step(x): x requires grad, and this {type(self).__name__} steps in JAX, where torch's "
                            f"autograd cannot follow; differentiate with jax.grad through jax_impl.step_fn, or "
                            f"step the torch module")
        self._follow_weights()
        outputs = self._streamer.step(to_jax(x, copy=None), None if active is None else to_jax(active, copy=None))
        return jax.tree_util.tree_map(to_torch, outputs)


class JaxTemporalStreaming(JaxBacked, TemporalStreaming):
    """`TemporalStreaming`, stepped by JAX. step(frame_embedding [B,T,dim], active [B]) ->
    (out [B,T,dim], text_logits [B,1,T,text_card]) as torch tensors."""

    def step(self, frame_embedding: torch.Tensor, active: torch.Tensor | None = None):
        """`TemporalStreaming.step`'s signature (its argument's name too), stepped by JAX (`JaxBacked.step`)."""
        return JaxBacked.step(self, frame_embedding, active)


class JaxMimiTransformer(JaxBacked, MimiTransformer):
    """`MimiTransformer`, stepped by JAX. step(x [B,T,dim], active [B]) -> [B,T,dim] torch tensor."""


def from_torch(module: StreamingStack | Depformer, *, layer_loop: str = "python",
               kernels: str = "auto") -> JaxBacked | JaxDepformer:
    """A JAX-backed stepper on the very same weight buffers as `module` (no copy), with its bits where
    it has twins: kernels "auto" is "twin" for a stack built with kernels="twin" (else JAX's choice,
    `jax_impl.kernel_choice`). A `Depformer` gives a `JaxDepformer` (kernels "auto": the module's own;
    layer_loop checked, unused)."""
    check_loop_options(layer_loop)
    if isinstance(module, Depformer):
        return JaxDepformer.from_torch(module, None if kernels == "auto" else kernels)
    if isinstance(module, JaxBacked):
        raise TypeError("from_torch(module): module is already JAX-backed")
    if not isinstance(module, (TemporalStreaming, MimiTransformer)):
        raise TypeError(f"from_torch(module): expected TemporalStreaming, MimiTransformer or Depformer, "
                        f"got {type(module).__name__}")
    cls = JaxTemporalStreaming if isinstance(module, TemporalStreaming) else JaxMimiTransformer
    kernels = "twin" if kernels == "auto" and module.kernels == "twin" else kernels
    stepper = cls.from_config(module.config, dtype=module.dtype, device="meta", layer_loop=layer_loop,
                              kernels=kernels)
    for name, buffer in module.weights().items():
        setattr(stepper, name, buffer)  # nn.Module routes this to the registered buffer
    return stepper
