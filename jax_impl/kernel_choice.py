"""The one `kernels` vocabulary of every entry point: torch stacks, JAX steps, drop-ins, cross-check.

    name          torch stacks           JAX steps (make_step, Streamer, drop-ins, sharding)
    "reference"   torch ops, bit-exact   jax.numpy through XLA (RoPE products rounded as torch's)
                  with moshi
    "twin"        the Triton twins       the Pallas twins: the same bits as torch's "twin"
    "pallas"      -                      the Pallas RoPE and ring-attention kernels in the reference layer
    "auto"        -                      "pallas" on a GPU where those kernels apply, else "reference"

A name means the same everywhere; an entry point refuses a name it does not run, listing the
ones it does. Framework-neutral (standard library only).
"""

from __future__ import annotations

KERNELS = {
    "reference": "each framework's plain path: torch ops (bit-exact with moshi) / jax.numpy through XLA",
    "twin": "every float operation in a twin kernel (Triton for torch, Pallas for JAX): the same bits on both",
    "pallas": "JAX only: the Pallas RoPE and ring-attention kernels inside the reference layer",
    "auto": "JAX only: 'pallas' on a GPU where those kernels apply, else 'reference'",
}
TORCH_KERNELS = ("reference", "twin")
JAX_KERNELS = ("auto", "reference", "pallas", "twin")


def check_kernels(where: str, kernels, accepted: tuple[str, ...]) -> str:
    """`kernels` itself if it is one of `accepted`; else ValueError naming `where` and the accepted values."""
    if not isinstance(kernels, str) or kernels not in accepted:
        raise ValueError(f"{where}: kernels must be one of {list(accepted)}, got {kernels!r}")
    return kernels
