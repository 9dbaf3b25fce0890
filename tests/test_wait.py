"""`jax_impl.until_ready`: the stepping loop's wait (the GPU's own stream order, not PjRt's futures)."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jax_impl import until_ready
from jax_impl import wait as wait_module

GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU: on the CPU until_ready is jax.block_until_ready")


def test_until_ready_returns_the_tree_and_leaves_non_arrays_alone():
    tree = {"a": jnp.arange(3) * 2, "b": (np.ones(2), 7, None), "c": [jnp.zeros((2, 2), jnp.bfloat16)]}
    assert until_ready(tree) is tree
    assert all(a.is_ready() for a in (tree["a"], tree["c"][0]))
    assert until_ready(5) == 5


def test_until_ready_sends_cpu_arrays_to_block_until_ready(monkeypatch):
    """A CPU array never reaches the CUDA path, even where a driver is loaded (a GPU host's CPU arrays)."""
    calls = []

    class NoDriver:
        def __getattr__(self, name):
            raise AssertionError(f"the CUDA driver was called ({name}) for a CPU array")

    monkeypatch.setattr(wait_module, "_driver", lambda: NoDriver())
    monkeypatch.setattr(wait_module.jax, "block_until_ready", lambda xs: calls.append(list(xs)) or xs)
    x = jax.device_put(jnp.ones(4), jax.devices("cpu")[0])
    until_ready((x, 3))
    assert len(calls) == 1 and calls[0][0] is x


def _read_without_waiting(cuda, array) -> np.ndarray:
    """array's bytes, copied by the driver on the legacy stream (no order with JAX's non-blocking streams)."""
    context, _ = wait_module._stream(cuda, array.devices().pop().local_hardware_id)
    host = np.empty(array.shape, array.dtype)
    assert cuda.cuCtxPushCurrent_v2(context) == 0
    try:
        assert cuda.cuMemcpyDtoH_v2(host.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(array.unsafe_buffer_pointer()),
                                    ctypes.c_size_t(host.nbytes)) == 0
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    return host


@gpu_only
@pytest.mark.parametrize("spin", [True, False])
def test_until_ready_waits_for_a_long_producer_on_the_gpu(spin):
    """After until_ready, a read that does not wait sees the final values; right after the dispatch
    the same read does not (the producer is ~100 ms of matmuls), so the check can fail."""
    cuda = wait_module._driver()
    n, steps = 4096, 300
    zeros = jnp.zeros((n, n), jnp.float32)
    producer = jax.jit(lambda a, s: lax.fori_loop(0, steps, lambda i, x: x + 1.0 + jnp.minimum(x @ a, 0.0) * 0.0,
                                                   jnp.full((n, n), s)))
    jax.block_until_ready(producer(zeros, 0.0))  # compiled
    start = float(np.random.default_rng().integers(1, 1000))
    y = producer(zeros, start)
    early = _read_without_waiting(cuda, y)
    assert until_ready(y, spin=spin) is y
    late = _read_without_waiting(cuda, y)
    assert np.all(late == start + steps)
    assert not np.all(early == start + steps)


@gpu_only
def test_until_ready_keeps_no_hold_on_the_buffer():
    """The DLPack export is dropped at once: a donated call after the wait updates the buffer in place."""
    a = jnp.arange(1 << 20, dtype=jnp.float32)
    before = a.unsafe_buffer_pointer()
    until_ready(a)
    b = jax.jit(lambda a: a + 1, donate_argnums=0)(a)
    assert b.unsafe_buffer_pointer() == before
    assert a.is_deleted()
