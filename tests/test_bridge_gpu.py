"""Stream ordering of the DLPack handoff on a GPU (skipped on a machine without CUDA).

torch and JAX queue work on different CUDA streams. Each test queues a producer long enough
(a ~50 ms spin, or a chain of large matmuls) that a consumer not ordered after it would read
the buffer before it is written, hands the buffer over at once, and checks every value.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU-only machine)")

N = 1 << 24  # 16M floats


def test_jax_reads_a_torch_tensor_only_after_torch_wrote_it():
    import jax.numpy as jnp

    from torch_bridge.dlpack import to_jax

    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        x = torch.zeros(N, device="cuda")
        torch.cuda._sleep(100_000_000)  # ~50 ms of spinning on the producer stream
        x.fill_(1.0)
        a = to_jax(x)  # JAX's stream must wait for the fill queued on `producer`
        assert a.unsafe_buffer_pointer() == x.data_ptr()
    assert float(jnp.sum(a)) == N


def test_torch_reads_a_jax_array_only_after_jax_wrote_it():
    import jax
    import jax.numpy as jnp

    from torch_bridge.dlpack import to_torch

    @jax.jit
    def produce(m):
        for _ in range(40):  # ~tens of ms of matmuls before the result exists
            m = jnp.tanh(m @ m)
        return jnp.zeros((N,), jnp.float32) + jnp.sum(m) * 0.0 + 2.0

    m = jnp.ones((4096, 4096), jnp.float32) * 1e-3
    produce(m).block_until_ready()  # compile outside the timed handoff
    y = produce(m)  # queued, not finished
    t = to_torch(y)  # torch's current stream must wait for it
    assert t.data_ptr() == y.unsafe_buffer_pointer()
    assert float(t.sum()) == 2.0 * N
