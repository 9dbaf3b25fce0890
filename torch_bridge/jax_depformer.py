"""`JaxDepformer`: the torch `Depformer`'s contract, stepped by the JAX depformer.

    dep = JaxDepformer.from_config(cfg, dtype=torch.bfloat16, kernels="twin")   # or from_torch(depformer)
    dep.load_weights(state_dict)
    codes, logits = dep(text_token, transformer_out, return_logits=True)       # torch in, torch out

A subclass of `Depformer`: the same buffers, loader, input checks and call; the frame runs as the
jitted `jax_impl.depformer.depformer_frame` with `kernels` ("reference" or "twin": the bits of the
torch depformer built with kernels="twin"). The JAX parameters are DLPack views of the module's own
buffers (no copy), taken again when a buffer is replaced (`.to()`, `.float()`, `from_torch`'s
sharing) and seeing any in-place edit (`load_weights`, `init_weights`). Codes come back int64 and
logits float32 on the module's device, as from the torch module.
"""

from __future__ import annotations

import functools

import jax
import torch

from jax_impl.depformer import depformer_frame
from jax_impl.depformer_config import check_steps
from jax_impl.sampling_config import check_sampling

from .depformer import Depformer
from .dlpack import to_jax, to_torch
from .sampling import check_randomness


def _uint32_bits(x: torch.Tensor) -> torch.Tensor:
    """Integers taken mod 2**32 (as the sampler takes seeds and counters), as int32 of the same bits."""
    x = x.long() & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


class JaxDepformer(Depformer):
    """The torch `Depformer` stepped by JAX (module docstring)."""

    def __init__(self, config, dtype=torch.float32, device=None, kernels: str = "reference"):
        super().__init__(config, dtype=dtype, device=device, kernels=kernels)  # checks kernels: the JAX frame's too
        self._views: tuple[tuple, dict] | None = None   # (the buffers' identities, their JAX views)
        self._frames: dict[tuple[float, int], object] = {}  # (temperature, top_k) -> the jitted frame

    def _check_device(self, device) -> None:
        """Any device JAX has: the Pallas twins run here (interpreted on the CPU), not Triton's."""

    @classmethod
    def from_torch(cls, depformer: Depformer, kernels: str | None = None) -> JaxDepformer:
        """A JaxDepformer on the very same weight buffers as `depformer` (no copy); kernels: the JAX
        frame's, by default the module's own (a twin module gives a twin drop-in: the same bits)."""
        if isinstance(depformer, JaxDepformer):
            raise TypeError("from_torch(depformer): depformer is already JAX-backed")
        if not isinstance(depformer, Depformer):
            raise TypeError(f"from_torch(depformer): expected a Depformer, got {type(depformer).__name__}")
        dropin = cls(depformer.config, dtype=depformer.dtype, device="meta",
                     kernels=depformer.kernels if kernels is None else kernels)
        for name, buffer in depformer.weights().items():
            setattr(dropin, name, buffer)  # nn.Module routes this to the registered buffer
        return dropin

    def jax_params(self) -> dict[str, jax.Array]:
        """The parameters as zero-copy JAX views of the weight buffers (kept while the buffers are)."""
        weights = self.weights()
        identity = tuple((n, w.data_ptr(), w.dtype, w.device, tuple(w.shape)) for n, w in weights.items())
        if self._views is None or self._views[0] != identity:
            self._views = identity, {name: to_jax(w) for name, w in weights.items()}
        return self._views[1]

    def _frame(self, temperature: float, top_k: int, steps: int | None):
        """The jitted frame of a sampler setting and step count (static in it), made once."""
        if (temperature, top_k, steps) not in self._frames:
            self._frames[temperature, top_k, steps] = jax.jit(functools.partial(
                depformer_frame, self.config, temperature=temperature, top_k=top_k, kernels=self.kernels,
                steps=steps))
        return self._frames[temperature, top_k, steps]

    @torch.no_grad()
    def forward(self, text_token: torch.Tensor, transformer_out: torch.Tensor, audio_tokens: torch.Tensor | None = None,
                audio_provided: torch.Tensor | None = None, return_logits: bool = False, *,
                temperature: float = 0.0, top_k: int = 0, seeds: torch.Tensor | None = None, counter=0,
                steps: int | None = None):
        """`Depformer.forward`'s arguments, checks and results (there), computed by JAX."""
        self._check_inputs(text_token, transformer_out, audio_tokens, audio_provided)
        check_steps(steps, self.config.dep_q)
        c = self.config
        B = transformer_out.shape[0]
        check_sampling(temperature, top_k, c.card)
        seeds, counter = check_randomness(seeds, counter, B, self.device, bool(temperature))
        counter = to_jax(_uint32_bits(torch.as_tensor(counter, device=self.device)))
        if audio_tokens is None:
            audio_tokens = torch.zeros((B, c.dep_q), dtype=torch.int32, device=self.device)
            audio_provided = torch.zeros((B, c.dep_q), dtype=torch.bool, device=self.device)
        else:  # where not provided the ids are not read (and may be anything): zeros, so they fit int32
            audio_tokens = torch.where(audio_provided, audio_tokens, 0).to(torch.int32)
        seeds = None if not temperature else to_jax(_uint32_bits(seeds))
        inputs = (text_token.to(torch.int32), transformer_out, audio_tokens, audio_provided)
        codes, logits = self._frame(float(temperature), top_k, steps)(
            self.jax_params(), *(to_jax(t, copy=None) for t in inputs), seeds, counter)
        codes = to_torch(codes).long()
        return (codes, to_torch(logits)) if return_logits else codes
