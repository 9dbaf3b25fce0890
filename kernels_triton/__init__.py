"""Triton kernels (torch tensors) with plain torch references beside them."""

from kernels_triton.rotary_mrope import (
    mrope,
    mrope_,
    mrope_from_cache,
    mrope_from_cache_,
    mrope_from_cache_native,
    mrope_native,
)

__all__ = [
    "mrope",
    "mrope_",
    "mrope_from_cache",
    "mrope_from_cache_",
    "mrope_from_cache_native",
    "mrope_native",
]
