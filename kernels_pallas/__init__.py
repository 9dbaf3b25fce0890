"""Pallas kernels (JAX arrays), each beside its plain jax.numpy reference (`*_native`).

    import kernels_pallas as kp
    q, k = kp.mrope(q, k, cos, sin, [16, 24, 24], 128, 128)      # MRoPE (Qwen2/2.5/3-VL)

Lazy: names are imported on first use. `contract` (the twin kernels' numerics contract, tile plans
and checks, standard library only) is read by `kernels_triton` and `jax_impl.config` without
importing jax.
"""

from kernels_pallas.lazy import lazy_exports

_EXPORTS = {
    "mrope": "rotary_mrope", "mrope_native": "rotary_mrope",
    "mrope_from_cache": "rotary_mrope", "mrope_from_cache_native": "rotary_mrope",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [*_EXPORTS]  # noqa: PLE0604 (the names of the lazy export table)
