"""The token sampler: the same tokens from JAX and torch for the same seeds (bits of the generator,
the noise and the choice), ties, top-k = 1 = greedy, the distribution, and the argument checks."""

from __future__ import annotations

from decimal import Decimal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import sampling as jsample
from torch_bridge import sampling as tsample


def np_hash32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def test_hash_is_lowbias32_on_both_sides():
    x = np.concatenate([np.array([0, 1, 2**31, 2**32 - 1], np.uint64),
                        np.random.default_rng(0).integers(0, 2**32, 5000, dtype=np.uint64)])
    want = np_hash32(x)
    assert np.array_equal(tsample.hash32(torch.from_numpy(x.astype(np.int64))).numpy(), want.astype(np.int64))
    assert np.array_equal(np.asarray(jsample.hash32(jnp.asarray(x.astype(np.uint32)))), want)


def test_log_is_accurate_and_identical():
    x = np.concatenate([np.geomspace(6e-8, 17.0, 20000, dtype=np.float32),
                        np.array([1.0, 2.0, 0.5, np.sqrt(2)], np.float32)])
    t = tsample.log(torch.from_numpy(x)).numpy()
    j = np.asarray(jax.jit(jsample.log)(jnp.asarray(x)))
    assert np.array_equal(t.view(np.int32), j.view(np.int32))
    assert np.allclose(t, np.log(x.astype(np.float64)), rtol=3e-7, atol=2e-7)


def test_noise_bits_identical():
    seeds = np.array([0, 1, 7, 2**31 - 1], np.int64)
    for counter in (0, 5, 2**32 + 3):
        t = tsample.gumbel(torch.from_numpy(seeds), counter, 2048).numpy()
        j = np.asarray(jsample.gumbel(jnp.asarray(seeds, jnp.int32), counter, 2048))
        assert np.array_equal(t.view(np.int32), j.view(np.int32)), counter
    assert np.isfinite(t).all() and 0.4 < t.mean() < 0.75  # Gumbel(0, 1): mean 0.577


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.8, 0), (0.8, 5), (1.3, 1), (0.7, 40)])
def test_same_tokens_jax_and_torch(temperature, top_k):
    rng = np.random.default_rng(1)
    B, V = 64, 40
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    logits[:16] = np.round(logits[:16])  # many ties, at the top-k boundary too
    seeds = rng.integers(0, 2**31, B)
    step = jax.jit(jsample.sample, static_argnames=("temperature", "top_k"))
    for counter in range(3):
        t = tsample.sample(torch.from_numpy(logits), torch.from_numpy(seeds), counter, temperature=temperature,
                           top_k=top_k)
        j = step(jnp.asarray(logits), jnp.asarray(seeds, jnp.int32), counter, temperature=temperature, top_k=top_k)
        assert np.array_equal(t.numpy(), np.asarray(j))
        if top_k:
            ranks = (logits > logits[np.arange(B), t.numpy()][:, None]).sum(1)
            assert (ranks < top_k).all()  # inside the top k
    if temperature and top_k != 1:
        assert len({tuple(tsample.sample(torch.from_numpy(logits), torch.from_numpy(seeds), c,
                                         temperature=temperature, top_k=top_k).tolist()) for c in range(3)}) > 1


def test_top1_is_greedy_with_ties():
    logits = np.array([[1, 3, 3, 0], [5, 5, 5, 5], [0, 0, 2, 2]], np.float32)
    for seeds in ([0, 1, 2], [9, 8, 7]):
        t = tsample.sample(torch.from_numpy(logits), torch.tensor(seeds), 3, temperature=5.0, top_k=1)
        j = jsample.sample(jnp.asarray(logits), jnp.asarray(seeds), 3, temperature=5.0, top_k=1)
        assert t.tolist() == np.asarray(j).tolist() == [1, 0, 2]
    assert tsample.sample(torch.from_numpy(logits)).tolist() == [1, 0, 2]
    mask = tsample.top_k_mask(torch.from_numpy(logits), 2).numpy()
    assert np.array_equal(mask, np.asarray(jsample.top_k_mask(jnp.asarray(logits), 2)))
    assert mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]]


def test_draws_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    tokens = tsample.sample(logits, torch.arange(4000), 0, temperature=0.9)
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0].double() / 0.9, 0), atol=0.03)
    top2 = tsample.sample(logits, torch.arange(4000), 0, temperature=0.9, top_k=2)
    assert set(top2.tolist()) == {0, 1}


def test_bad_arguments():
    logits = torch.zeros(2, 8)
    # 1e39 is inf in float32, 1e-50 is 0, 10**400 is past float64 too; 0j, an array and a Decimal only compare
    # equal to 0
    for temperature in (-1.0, 1e39, 1e-50, 10**400, float("nan"), 0j, np.array(0.0), Decimal(0), "0.5"):
        with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or a float > 0 that float32 holds"):
            tsample.sample(logits, torch.zeros(2, dtype=torch.long), temperature=temperature)
        with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or a float > 0 that float32 holds"):
            jsample.sample(jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), temperature=temperature)
    for temperature in (np.float32(0.5), np.float64(0.0)):  # numpy's real numbers are numbers
        tsample.sample(logits, torch.zeros(2, dtype=torch.long), temperature=temperature)
    with pytest.raises(ValueError, match="top_k must be an int in 0..8"):
        tsample.sample(logits, torch.zeros(2, dtype=torch.long), temperature=1.0, top_k=9)
    for seeds in (None, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(3, dtype=torch.long)):
        with pytest.raises(ValueError, match="seeds must be an integer array \\[2\\]"):
            tsample.sample(logits, seeds, temperature=1.0)
    with pytest.raises(ValueError, match="seeds is on meta"):
        tsample.sample(logits, torch.zeros(2, dtype=torch.long, device="meta"), temperature=1.0)
    with pytest.raises(TypeError, match="counter must be an int or an integer array, got torch.float32"):
        tsample.sample(logits, torch.zeros(2, dtype=torch.long), torch.zeros(2), temperature=1.0)
    with pytest.raises(ValueError, match="logits must be a float32"):
        tsample.sample(logits.double())
    for seeds in (jnp.zeros(3, jnp.int32), jnp.zeros(2, bool), [1, 2]):
        with pytest.raises(ValueError, match="seeds must be an integer array \\[2\\]"):
            jsample.sample(jnp.zeros((2, 8)), seeds, temperature=1.0)
    with pytest.raises(ValueError, match="top_k must be an int"):
        jsample.sample(jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), temperature=1.0, top_k=2.0)


def test_counter_refused_alike_on_both_sides():
    """The counter is checked (`check_counter`) before a draw on both sides: no float truncated, no bool,
    no shape broadcast to the rows."""
    logits = np.zeros((3, 8), np.float32)
    cases = [(1.5, TypeError, "got float"), (True, TypeError, "got bool"),
             (np.zeros(3, np.float32), TypeError, "float32 \\[3\\]"),
             (np.array([7]), ValueError, "counter must have shape \\[\\] or \\[3\\], got \\[1\\]"),
             (np.zeros((3, 1), np.int32), ValueError, "counter must have shape \\[\\] or \\[3\\], got \\[3, 1\\]")]
    for counter, kind, match in cases:
        with pytest.raises(kind, match=match):
            tsample.sample(torch.from_numpy(logits), torch.tensor([1, 2, 3]),
                           torch.from_numpy(counter) if isinstance(counter, np.ndarray) else counter, temperature=1.0)
        with pytest.raises(kind, match=match):
            jsample.sample(jnp.asarray(logits), jnp.array([1, 2, 3]),
                           jnp.asarray(counter) if isinstance(counter, np.ndarray) else counter, temperature=1.0)
    for counter in (2, np.array(2), np.array([2, 2, 2], np.uint8)):  # an int, [] and [B]: the same draws
        t = tsample.sample(torch.from_numpy(logits), torch.tensor([1, 2, 3]),
                           torch.from_numpy(counter) if isinstance(counter, np.ndarray) else counter, temperature=1.0)
        j = jsample.sample(jnp.asarray(logits), jnp.array([1, 2, 3]),
                           jnp.asarray(counter) if isinstance(counter, np.ndarray) else counter, temperature=1.0)
        assert t.tolist() == np.asarray(j).tolist() == tsample.sample(
            torch.from_numpy(logits), torch.tensor([1, 2, 3]), 2, temperature=1.0).tolist()


_jitted_sample = jax.jit(jsample.sample, static_argnames=("temperature", "top_k"))


def _both(logits, seeds, counter=0, **kw):
    """The tokens of torch's sampler and JAX's (eager and jitted) for the same arguments."""
    t = tsample.sample(torch.from_numpy(logits), torch.from_numpy(np.asarray(seeds)), counter, **kw).numpy()
    j = np.asarray(jsample.sample(jnp.asarray(logits), jnp.asarray(seeds), counter, **kw))
    jj = np.asarray(_jitted_sample(jnp.asarray(logits), jnp.asarray(seeds), counter, **kw))
    return t, j, jj


def test_subnormals_flushed_alike():
    """Subnormal logits, temperatures and products are flushed to +0 on both sides (XLA on the CPU flushes
    them, torch keeps them): the same tokens, bit for bit, and the greedy choice over the flushed logits."""
    values = np.array([1e-40, -1e-40, 2.0**-149, 0.0, -0.0, 2.0**-126, -2.0**-126, np.inf, np.nan], np.float32)
    t, j = tsample.flush(torch.from_numpy(values)).numpy(), np.asarray(jsample.flush(jnp.asarray(values)))
    assert np.array_equal(t.view(np.int32), j.view(np.int32))
    assert t.view(np.int32)[:5].tolist() == [0] * 5 and np.array_equal(t[5:7], values[5:7])
    subnormal = np.array([[1e-40, 3e-40, 2e-40, 0.0], [0.0, -1e-40, 0.0, 0.0]], np.float32)
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}):  # greedy: every logit a zero, the first
        assert all(x.tolist() == [0, 0] for x in _both(subnormal, [1, 2], **kw))
    t, j, jj = _both(subnormal, [1, 2], temperature=1e-30, top_k=2)
    assert np.array_equal(t, j) and np.array_equal(t, jj)
    for temperature in (1e-40, 2.0**-149):  # a subnormal temperature is 0: greedy, the first of the tied zeros
        assert all(x.tolist() == [0] * 4 for x in _both(np.zeros((4, 8), np.float32), np.arange(4),
                                                        temperature=temperature))
    # temperature * g rounds to 2**-126 in torch from an exact product below it, which XLA flushes: 0 on both
    temperature = 2.0113557125864762e-38
    noise = torch.tensor(temperature, dtype=torch.float32) * tsample.gumbel(torch.tensor([89]), 0, 2)
    assert noise[0, 0] < 2.0**-126 and noise[0, 1] == 2.0**-126
    assert all(x.tolist() == [0] for x in _both(np.zeros((1, 2), np.float32), [89], temperature=temperature))
    # a mix of subnormal, normal, infinite and NaN logits at subnormal and tiny normal scales of the noise
    rng = np.random.default_rng(4)
    pool = np.array([0.0, -0.0, 1e-40, -1e-40, 3e-40, 2.0**-149, 2.0**-126, -2.0**-126, 2e-38, 1e-30, 1.0, -1.0,
                     np.inf, -np.inf, np.nan], np.float32)
    logits = pool[rng.integers(0, len(pool), (2000, 8))]
    logits[:500] = rng.normal(size=(500, 8)).astype(np.float32) * 1e-38  # across the subnormal boundary
    seeds = rng.integers(0, 2**31, 2000)
    for temperature in (0.0, 1e-40, 2.0**-149, 2e-38, 1e-30, 1.0):
        for top_k in (0, 2) if temperature else (0,):
            t = tsample.sample(torch.from_numpy(logits), torch.from_numpy(seeds), 3, temperature=temperature,
                               top_k=top_k)
            j = _jitted_sample(jnp.asarray(logits), jnp.asarray(seeds), 3, temperature=temperature, top_k=top_k)
            assert np.array_equal(t.numpy(), np.asarray(j)), (temperature, top_k)
