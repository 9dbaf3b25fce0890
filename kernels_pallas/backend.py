"""Which of Pallas's GPU backends the twin kernels run on, read when a call is traced.

PERSONAPLEX_PALLAS_BACKEND:
- "triton" (unset: the default): every Pallas kernel on Pallas's Triton backend, deprecated from jax 0.11.
- "mosaic_gpu": each twin kernel (`twin_linear.linear`, `linear_rope_write`, `twin_attention.attention`,
  `twin_norm.norm`, `split`, `twin_entry.entry`) runs its Mosaic GPU twin (`kernels_pallas.twin_*_mgpu`,
  jax >= 0.11) wherever that takes the call's shapes and dtypes, the Triton-backend kernel elsewhere.

The choice is made inside the kernel call, under its `jax.custom_vjp`: every caller follows it (the
stacks' steps, the depformer, the codec's convolutions, the twin backward's own products), and the
derivative is the same backward whichever backend ran the forward. The two backends follow one contract:
the same bits on the GPU wherever the tensor cores' sums are the same. Interpreted on the CPU the Mosaic
kernels run their MMA forms in Mosaic GPU's interpreter (jax >= 0.11), not the CPU's lane forms: other
bits, within rounding.
"""

from __future__ import annotations

import os

VARIABLE = "PERSONAPLEX_PALLAS_BACKEND"
BACKENDS = ("triton", "mosaic_gpu")


def gpu_backend() -> str:
    """The backend PERSONAPLEX_PALLAS_BACKEND names (checked): "triton" (unset) or "mosaic_gpu"."""
    backend = os.environ.get(VARIABLE, "triton")
    if backend not in BACKENDS:
        raise ValueError(f"{VARIABLE}: must be one of {list(BACKENDS)} (or unset), got {backend!r}")
    return backend


def on_mosaic() -> bool:
    """Whether the twin kernels traced now run on Mosaic GPU where it takes their calls."""
    return gpu_backend() == "mosaic_gpu"
