"""The DLPack bridge and the JAX-backed drop-in steppers (CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl.config import PRESETS
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import BridgeCopyWarning, to_jax, to_torch
from torch_bridge.jax_steppers import JaxMimiTransformer, JaxTemporalStreaming, from_torch

SHAREABLE = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool]


@pytest.mark.parametrize("dtype", SHAREABLE)
def test_zero_copy_both_ways(dtype):
    t = (torch.arange(24) % 3).to(dtype).view(4, 6)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == (4, 6) and str(a.dtype) == str(t.dtype).removeprefix("torch.")
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    assert torch.equal(back, t)


@pytest.mark.parametrize("path", ["capsule_import", "jnp_from_dlpack"])
def test_to_jax_shares_through_either_import(path, monkeypatch):
    """to_jax imports with JAX's own capsule call on this jax (a jax without it is noticed here),
    and with `jnp.from_dlpack` where that call is missing: the same shared buffer either way."""
    from torch_bridge import dlpack

    assert dlpack._capsule_import() is not None
    if path == "capsule_import":
        monkeypatch.setattr(dlpack.jnp, "from_dlpack", lambda *a, **k: pytest.fail("jnp.from_dlpack called"))
    else:
        monkeypatch.setattr(dlpack, "_capsule_import", lambda: None)
    t = torch.arange(12.0).view(3, 4).to(torch.bfloat16)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr() and a.dtype == jnp.bfloat16 and a.shape == (3, 4)
    assert a.committed and a.devices() == {dlpack.jax_device_for(t)}
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())


def test_int64_zero_copy_with_x64():
    import jax

    with jax.enable_x64(True):
        t = torch.arange(6)
        a = to_jax(t)
        assert a.dtype == jnp.int64 and a.unsafe_buffer_pointer() == t.data_ptr()
        back = to_torch(a)
        assert back.dtype == torch.int64 and back.data_ptr() == t.data_ptr()


def test_torch_write_is_seen_by_jax():
    t = torch.zeros(8)
    a = to_jax(t)
    t[3] = 5.0
    assert float(a[3]) == 5.0


def test_int64_is_refused_without_x64_or_copied_with_a_warning():
    t = torch.tensor([1, 2, 2**31 - 1])
    with pytest.raises(ValueError, match="int64 needs jax x64"):
        to_jax(t)
    with pytest.warns(BridgeCopyWarning, match="int64"):
        a = to_jax(t, copy=True)
    assert a.dtype == jnp.int32 and a.tolist() == [1, 2, 2**31 - 1]
    with pytest.warns(BridgeCopyWarning), pytest.raises(OverflowError, match="do not fit"):
        to_jax(torch.tensor([2**31]), copy=True)


def test_non_contiguous_and_misaligned_views_are_refused_or_copied_with_a_warning():
    t = torch.arange(12.0).view(3, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        to_jax(t.t())
    with pytest.warns(BridgeCopyWarning, match="not contiguous"):
        a = to_jax(t.t(), copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.t().numpy())
    view = torch.arange(13.0)[1:]  # storage offset of 4 bytes: the CPU client copies it
    with pytest.raises(ValueError, match="copied it on import"):
        to_jax(view)


def test_bad_types_are_refused():
    with pytest.raises(TypeError, match="dtype torch.float64"):
        to_jax(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        to_jax(np.zeros(2))
    with pytest.raises(TypeError, match=r"layout torch.sparse_coo is not supported; expected a dense"):
        to_jax(torch.eye(3).to_sparse(), copy=True)
    with pytest.raises(TypeError, match="expected a jax.Array"):
        to_torch(torch.zeros(2))
    with pytest.raises(TypeError, match=r"to_jax\(copy\): expected True, False or None, got 0"):
        to_jax(torch.zeros(2), copy=0)


def test_an_array_split_over_devices_is_refused_by_name():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("rows",))
    split = jax.device_put(jnp.zeros((4, 3)), NamedSharding(mesh, PartitionSpec("rows")))
    with pytest.raises(ValueError, match=r"to_torch\(array\): the array is split over 2 devices"):
        to_torch(split)


def test_a_lazily_negated_view_is_refused_or_copied_with_its_values():
    """torch's negative bit: the buffer of `conj().imag` holds +2 where the tensor reads -2; sharing
    the buffer once gave JAX +2."""
    negated = torch.tensor([1 + 2j]).conj().imag
    assert negated.is_neg() and negated.tolist() == [-2.0]
    with pytest.raises(ValueError, match="a lazily negated view"):
        to_jax(negated)
    with pytest.warns(BridgeCopyWarning, match="a lazily negated view"):
        assert np.asarray(to_jax(negated, copy=True)).tolist() == [-2.0]


@pytest.mark.parametrize("name", ["temporal", "mimi"])
def test_from_torch_shares_the_weight_buffers(name):
    cls = TemporalStreaming if name == "temporal" else MimiTransformer
    module = cls.from_config(PRESETS[f"{name}-small"])
    stepper = from_torch(module)
    params = stepper.jax_params()["params"]
    for spec_name, buffer in module.weights().items():
        leaf = params["layers"][spec_name] if spec_name in params["layers"] else params[spec_name]
        assert stepper.weights()[spec_name] is buffer
        assert leaf.unsafe_buffer_pointer() == buffer.data_ptr(), spec_name
    # an edit on the torch side is seen by the JAX stepper
    B, T = 2, 1 if name == "temporal" else 2
    x = torch.randn(B, T, module.config.dim)
    stepper.streaming_init(B)
    before = stepper.step(x)
    with torch.no_grad():
        module.out_proj.mul_(2.0)
    stepper.reset_streaming()
    after = stepper.step(x)
    module.streaming_init(B)
    expected = module.step(x)
    first = lambda y: y[0] if isinstance(y, tuple) else y
    assert not torch.equal(first(before), first(after))
    torch.testing.assert_close(first(after), first(expected), rtol=1e-5, atol=1e-5)


def serve(stack_class, steps=40):
    """A user's serving loop: runs unchanged on a torch stack or its JAX-backed drop-in."""
    torch.manual_seed(0)
    model = stack_class(dim=64, num_layers=2, num_heads=4, hidden=176, context=24, text_card=96)
    model.init_weights(generator=torch.Generator().manual_seed(1))
    model.streaming_init(3)
    tokens = []
    for step in range(steps):
        active = torch.tensor([True, step % 3 != 0, True])
        if step == 20:
            model.reset_slot(1)
            model.bump_slot_start(0)
        if step == 30:
            model.reset_rows(torch.tensor([False, False, True]))
        out, text_logits = model.step(frame_embedding=torch.randn(3, 1, 64), active=active)  # torch's names
        tokens.append(text_logits.argmax(-1).flatten())
    return torch.stack(tokens), out, [int(o) for o in model.state.offset]


def test_drop_in_script_runs_unchanged_on_either_class():
    tok_t, out_t, off_t = serve(TemporalStreaming)
    tok_j, out_j, off_j = serve(JaxTemporalStreaming)
    assert off_t == off_j == [40, 26, 10]
    assert torch.equal(tok_t, tok_j)
    assert isinstance(out_j, torch.Tensor) and out_j.dtype == out_t.dtype and out_j.shape == out_t.shape
    torch.testing.assert_close(out_j, out_t, rtol=1e-5, atol=1e-5)


def test_drop_in_without_active_steps_every_row_as_an_all_true_mask_does():
    """step(x) hands JAX no mask (the JAX step's own all-rows one, no torch mask a step): the same
    outputs and state, bit for bit, as step(x, all True)."""
    cfg = PRESETS["mimi-small"]
    module = MimiTransformer.from_config(cfg)
    module.init_weights(generator=torch.Generator().manual_seed(0))
    a, b = from_torch(module), from_torch(module)
    a.streaming_init(3)
    b.streaming_init(3)
    for x in torch.randn(3, 3, 2, cfg.dim, generator=torch.Generator().manual_seed(1)):
        assert torch.equal(a.step(x), b.step(x, torch.ones(3, dtype=torch.bool)))
    for name in ("k", "v", "offset", "start_offset"):
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name
    assert a.state.offset.tolist() == [6, 6, 6]


def test_drop_in_refuses_bad_input_with_state_unchanged():
    model = JaxMimiTransformer(num_layers=2, dim=32, num_heads=4, context=10, ffn=64)
    with pytest.raises(RuntimeError, match="before streaming_init"):
        model.step(torch.zeros(2, 2, 32))
    model.streaming_init(2)
    model.step(torch.randn(2, 2, 32))
    before = {k: v.clone() for k, v in vars(model.state).items()}
    for call, exc in [(lambda: model.step(torch.zeros(2, 2, 31)), ValueError),
                      (lambda: model.step(torch.zeros(2, 2, 32), torch.ones(2)), TypeError),
                      (lambda: model.reset_slot(2), IndexError),
                      (lambda: model.reset_rows(torch.ones(3, dtype=torch.bool)), ValueError),
                      (lambda: model.step(torch.zeros(2, 2, 32, requires_grad=True)), TypeError)]:
        with pytest.raises(exc):  # x requiring grad: JAX cannot give torch's autograd a graph
            call()
    for k, v in vars(model.state).items():
        assert torch.equal(v, before[k]), k


def test_from_torch_of_a_twin_stack_steps_on_the_twins():
    """A stack built with kernels="twin" gets a drop-in with its bits (kernels "auto": the twins)."""
    from torch_bridge import MimiTransformer, from_torch

    module = MimiTransformer(num_layers=2, dim=32, num_heads=4, context=10, ffn=64, kernels="twin")
    dropin = from_torch(module)
    assert dropin.kernels == "twin" and from_torch(MimiTransformer(num_layers=1, dim=32, num_heads=4, context=10,
                                                                   ffn=64)).kernels == "auto"
    module.streaming_init(2)
    dropin.streaming_init(2)
    x = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(module.step(x), dropin.step(x))
    with pytest.raises(ValueError, match="layer_loop must be one of"):
        from_torch(module, layer_loop="bogus")
    # a buffer replaced, or its storage moved by the torch twin's share_memory(), is viewed again: the
    # drop-in once stepped on the old weights (or on freed memory)
    dropin.in_proj = dropin.in_proj * 1.5
    module.in_proj = module.in_proj * 1.5
    assert torch.equal(module.step(x), dropin.step(x))
    module.share_memory()
    assert torch.equal(module.step(x), dropin.step(x))
    dropin.in_proj.requires_grad_(True)  # the torch module would record autograd; JAX's step cannot
    with pytest.raises(TypeError, match="step: the weight in_proj requires grad"):
        dropin.step(x)
    # a buffer JAX cannot share is refused by name before the stream is dropped
    dropin.in_proj = dropin.in_proj.detach().mT.contiguous().mT
    with pytest.raises(ValueError, match="JaxMimiTransformer: the weight in_proj: to_jax.*not contiguous"):
        dropin.streaming_init(2)
    assert dropin.jax_state is not None


def test_state_views_are_zero_copy():
    model = JaxMimiTransformer(num_layers=2, dim=32, num_heads=4, context=10, ffn=64)
    model.streaming_init(2)
    model.step(torch.randn(2, 2, 32))
    view = model.state
    assert view.k.data_ptr() == model.jax_state.k.unsafe_buffer_pointer()
    assert view.offset.tolist() == [2, 2]
    model.step(torch.randn(2, 2, 32))  # cannot donate the viewed buffers: JAX copies them instead
    assert view.offset.tolist() == [2, 2]  # the view kept the old buffer alive and intact
    assert model.state.offset.tolist() == [4, 4]


@pytest.mark.parametrize("cls", [JaxTemporalStreaming, JaxMimiTransformer])
def test_drop_in_streaming_init_allocates_no_torch_ring(cls, monkeypatch):
    """The drop-in's state lives in JAX: streaming_init must not allocate (and drop) a torch ring,
    which at the real sizes is 6.3 GB at B=4, and a bad batch size is refused before anything."""
    config = PRESETS["temporal-small" if cls is JaxTemporalStreaming else "mimi-small"]
    module = cls.from_config(config)
    allocated = []
    monkeypatch.setattr("torch_bridge.model.TorchStreamState.zeros", lambda *a, **k: allocated.append(a))
    module.streaming_init(3)
    assert allocated == []
    assert module.jax_state.k.shape[1] == 3
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        module.streaming_init(0)
    assert module.jax_state.k.shape[1] == 3  # the refused call left the stream as it was


def test_drop_in_refuses_an_impossible_batch_size_with_its_stream_kept():
    """The drop-in released its JAX stream before init_state refused the batch size (the error was
    clear, the stream gone). Refused first now, naming batch_size; the stream goes on as it was."""
    model = JaxMimiTransformer(num_layers=2, dim=32, num_heads=4, context=10, ffn=64)
    model.streaming_init(2)
    model.step(torch.randn(2, 2, 32))
    before = {k: v.clone() for k, v in model.snapshot().items() if k != "metadata"}
    with pytest.raises(ValueError, match=r"^JaxMimiTransformer\.streaming_init\(batch_size\): a ring of "
                                         r"\[2, 1152921504606846976, 4, \d+, 8\] float32 \(batch_size "
                                         r"1152921504606846976\) is more bytes than any device holds"):
        model.streaming_init(2**60)
    after = model.snapshot()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    model.step(torch.randn(2, 2, 32))
    assert model.state.offset.tolist() == [4, 4]
