"""Which of Pallas's GPU backends the twin kernels run on, read when a call is traced.

PERSONAPLEX_PALLAS_BACKEND:
- "triton" (unset: the default): every Pallas kernel on Pallas's Triton backend, deprecated from jax 0.11.
- "mosaic_gpu": each twin kernel (`twin_linear.linear`, `linear_rope_write`, `twin_attention.attention`,
  `twin_norm.norm`, `split`, `twin_entry.entry`) runs its Mosaic GPU twin (`kernels_pallas.twin_*_mgpu`,
  jax >= 0.11) wherever that takes the call's shapes and dtypes, the Triton-backend kernel elsewhere.

The choice is made inside the kernel call, under its `jax.custom_vjp`: every caller follows it (the
stacks' steps, the depformer, the codec's convolutions, the twin backward's own products), and the
derivative is the same backward whichever backend ran the forward. `use(name)` chooses for the calls
traced inside it, over the variable. A jitted step follows the backend chosen when it was made
(`per_backend`, `traced_on`): `jax.jit` traces a function once per shape, so a choice read only when
the step is first called would be lost to a step made, and traced, before it. The two backends follow one contract:
the same bits on the GPU wherever the tensor cores' sums are the same. Interpreted on the CPU the Mosaic
kernels run their MMA forms in Mosaic GPU's interpreter (jax >= 0.11), not the CPU's lane forms: other
bits, within rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

VARIABLE = "PERSONAPLEX_PALLAS_BACKEND"
BACKENDS = ("triton", "mosaic_gpu")
_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_backend", default=None)


def gpu_backend() -> str:
    """The backend chosen by the innermost `use`, else the one PERSONAPLEX_PALLAS_BACKEND names (checked):
    "triton" (unset) or "mosaic_gpu"."""
    chosen = _CHOSEN.get()
    if chosen is not None:
        return chosen
    backend = os.environ.get(VARIABLE, "triton")
    if backend not in BACKENDS:
        raise ValueError(f"{VARIABLE}: must be one of {list(BACKENDS)} (or unset), got {backend!r}")
    return backend


@contextlib.contextmanager
def use(name: str):
    """The twin kernels traced inside run on backend `name` ("triton" or "mosaic_gpu"), whatever the variable."""
    if name not in BACKENDS:
        raise ValueError(f"use(name): must be one of {list(BACKENDS)}, got {name!r}")
    token = _CHOSEN.set(name)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def traced_on(fn):
    """fn, run (and so traced) under `use` of the backend chosen now. What a factory hands to `jax.jit`,
    so that its step keeps the backend chosen when it was made."""
    name = gpu_backend()

    @functools.wraps(fn)
    def on_backend(*args, **kwargs):
        with use(name):
            return fn(*args, **kwargs)

    return on_backend


def per_backend(factory):
    """`functools.cache` of a step factory, keyed also on the backend chosen when it is called: the
    factory runs under `use` of it, so the `traced_on` functions it makes keep it."""
    @functools.cache
    def made(name, *args, **kwargs):
        with use(name):
            return factory(*args, **kwargs)

    @functools.wraps(factory)
    def cached(*args, **kwargs):
        return made(gpu_backend(), *args, **kwargs)

    return cached


def on_mosaic() -> bool:
    """Whether the twin kernels traced now run on Mosaic GPU where it takes their calls."""
    return gpu_backend() == "mosaic_gpu"
