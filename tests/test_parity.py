"""`jax_impl.parity`, the distances the cross-checks report: what they count, and what they refuse."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from jax_impl.parity import NAN_DISTANCE, bits, max_ulp, ulp_distance


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_ulp_distance_counts_the_values_between(dtype):
    """Neighbours are 1 apart, across zero too (+0 and -0 are one value); NaN against NaN is 0, NaN against
    a number the largest distance."""
    a = np.array([0.0, -0.0, 1.0, np.nan, np.nan], dtype)
    b = np.array([-0.0, 0.0, 1.0, np.nan, 1.0], dtype)
    assert ulp_distance(a, b).tolist() == [0, 0, 0, 0, int(NAN_DISTANCE)]
    one, zero = bits(np.ones(1, dtype)), bits(np.zeros(1, dtype))
    above_one, least = (one + 1).view(dtype), (zero + 1).view(dtype)  # the next value up, the least subnormal
    assert max_ulp(above_one, np.ones(1, dtype)) == 1
    assert ulp_distance(least, -least).tolist() == [2]


@pytest.mark.parametrize("a,b,exc,match", [
    (np.zeros(2, ml_dtypes.float8_e4m3fn), None, TypeError, "expected one of"),
    (np.zeros(2, np.longdouble), None, TypeError, "expected one of"),
    (np.zeros(2, np.int32), None, TypeError, "expected one of"),
    (np.zeros(2, np.float32), np.zeros(2, np.float64), TypeError, "dtypes differ"),
    (np.zeros(2, np.float32), np.zeros(3, np.float32), ValueError, "shapes differ"),
    (np.zeros(1, np.float32), np.zeros((2, 1), np.float32), ValueError, "shapes differ"),
])
def test_ulp_distance_refuses_what_it_cannot_order(a, b, exc, match):
    with pytest.raises(exc, match=match):
        ulp_distance(a, a if b is None else b)


def test_bits_of_bools_and_numbers_and_not_of_wider_values():
    assert bits(np.array([True, False])).tolist() == [1, 0]
    assert bits(np.array([-1], np.int8)).tolist() == [255]
    with pytest.raises(TypeError, match=r"bits: expected an array of 1-, 2-, 4- or 8-byte"):
        bits(np.zeros(2, np.complex128))


def test_torch_tensors_that_require_grad_are_read_detached():
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    assert ulp_distance(a, a.detach().clone()).tolist() == [0, 0]
    assert bits(a * 1).tolist() == bits(a.detach()).tolist()
