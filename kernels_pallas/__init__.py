"""Pallas kernels (JAX arrays) with plain jax.numpy references beside them."""

from kernels_pallas.rotary_mrope import mrope, mrope_from_cache, mrope_from_cache_native, mrope_native

__all__ = ["mrope", "mrope_from_cache", "mrope_from_cache_native", "mrope_native"]
