"""The torch stacks: hoisted tables are exact, bad input is refused with state unchanged,
checkpoints round-trip through safetensors in the Moshi layout."""

import copy

import numpy as np
import pytest
import torch

from jax_impl.checkpoint import CheckpointError
from jax_impl.config import PRESETS, with_options
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.crosscheck import layer_tables

B = 3
STEPS = 300  # random steps of the hoisted-tables check: each recycle op and a ring wrap (checked)


def make_stack(name, convention="personaplex", seed=0, dtype=torch.float32):
    config = with_options(PRESETS[f"{name}-small"], ring_convention=convention)
    cls = TemporalStreaming if name == "temporal" else MimiTransformer
    stack = cls.from_config(config, dtype=dtype)
    stack.init_weights(generator=torch.Generator().manual_seed(seed))
    return stack


def tables_in_every_layer(stack) -> list:
    """Make every layer of `stack` build its own tables, as older code did (the oracle of the
    hoisted tables: the same bits). Returns the list the rebuilt tables are appended to."""
    layer_fn, built = stack._layer_fn, []

    def rebuilt(carry, layer, tables, active):
        s = stack.state  # offsets advance after the last layer
        built.append(stack.step_tables(s.offset, s.start_offset, active, carry[0].shape[1]))
        return layer_fn(carry, layer, built[-1], active)

    stack._layer_fn = rebuilt
    return built


def random_op(stack, gen):
    """One random recycle op (or none) for `stack`: (its name or None, a replayable closure)."""
    u = torch.rand((), generator=gen).item()
    b = int(torch.randint(B, (), generator=gen))
    mask = torch.rand(B, generator=gen) < 0.5
    if u < 0.03:
        return "reset_slot", lambda s: s.reset_slot(b)
    if u < 0.06 and stack.state.start_offset[b] < stack.state.offset[b]:
        return "bump_slot_start", lambda s: s.bump_slot_start(b)
    if u < 0.08:
        return "reset_rows", lambda s: s.reset_rows(mask)
    return None, lambda s: None


@pytest.mark.parametrize("name,T", [("temporal", 1), ("mimi", 2)])
@pytest.mark.parametrize("convention", ["personaplex", "moshi"])
def test_hoisted_tables_equal_per_layer_tables(name, T, convention):
    hoisted = make_stack(name, convention)
    per_layer = copy.deepcopy(hoisted)
    gen = torch.Generator().manual_seed(3)
    for s in (hoisted, per_layer):
        s.streaming_init(B)
    built = tables_in_every_layer(per_layer)
    ops = set()
    for _ in range(STEPS):
        op_name, op = random_op(hoisted, gen)
        ops.add(op_name)
        op(hoisted)
        op(per_layer)
        x = torch.randn(B, T, hoisted.config.dim, generator=gen)
        active = torch.rand(B, generator=gen) < 0.7
        built.clear()
        with layer_tables(hoisted) as seen:
            ya = hoisted.step(x, active)
        yb = per_layer.step(x, active)
        assert len(seen) == 1 and len(built) == hoisted.config.num_layers
        for u, v in zip(torch.utils._pytree.tree_leaves(ya), torch.utils._pytree.tree_leaves(yb)):
            assert torch.equal(u, v)
        sa, sb = hoisted.state, per_layer.state
        for field in ("k", "v", "offset", "start_offset"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), field
        assert all(torch.equal(seen[0].positions, t.positions) for t in built)
    assert int(hoisted.state.offset.max()) > hoisted.config.context  # the ring wrapped
    assert ops >= {"reset_slot", "bump_slot_start", "reset_rows"}, ops


def snapshot(stack):
    return {k: v.clone() for k, v in vars(stack.state).items()}


def assert_state_unchanged(stack, before):
    for k, v in vars(stack.state).items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("name", ["temporal", "mimi"])
def test_bad_input_is_refused_and_state_unchanged(name):
    stack = make_stack(name)
    dim, T = stack.config.dim, 2
    with pytest.raises(RuntimeError, match="before streaming_init"):
        stack.step(torch.zeros(B, T, dim))
    with pytest.raises(RuntimeError, match="before streaming_init"):
        stack.reset_slot(0)
    with pytest.raises(ValueError, match="batch_size"):
        stack.streaming_init(0)
    stack.streaming_init(B)
    stack.step(torch.randn(B, T, dim))
    before = snapshot(stack)
    cases = [
        (lambda: stack.step(torch.zeros(B, T, dim + 1)), ValueError, r"step\(x\).*shape"),
        (lambda: stack.step(torch.zeros(B + 1, T, dim)), ValueError, r"step\(x\).*shape"),
        (lambda: stack.step(torch.zeros(B, 0, dim)), ValueError, "T = x.shape"),
        (lambda: stack.step(torch.zeros(B, stack.config.capacity + 1, dim)), ValueError, "capacity"),
        (lambda: stack.step(torch.zeros(B, T, dim, dtype=torch.float64)), TypeError, "dtype"),
        (lambda: stack.step(torch.zeros(B, T, dim), torch.ones(B)), TypeError, r"step\(active\)"),
        (lambda: stack.step(torch.zeros(B, T, dim), torch.ones(B + 1, dtype=torch.bool)), ValueError,
         r"step\(active\)"),
        (lambda: stack.step(torch.zeros(B, T, dim).numpy()), TypeError, "torch.Tensor"),
        (lambda: stack.reset_slot(B), IndexError, "out of range"),
        (lambda: stack.reset_slot(-1), IndexError, "out of range"),
        (lambda: stack.reset_slot(1.0), TypeError, r"reset_slot\(b\): b must be an integer row index"),
        (lambda: stack.reset_slot(np.bool_(True)), TypeError, "integer row index"),
        (lambda: stack.reset_slot(torch.tensor(True)), TypeError, "integer row index"),
        (lambda: stack.reset_slot(torch.tensor([1])), TypeError, "integer row index"),
        (lambda: stack.reset_slot(np.int64(B)), IndexError, "out of range"),
        (lambda: stack.reset_slot(torch.tensor(B)), IndexError, f"b={B} is out of range"),
        (lambda: stack.bump_slot_start(B), IndexError, "out of range"),
        (lambda: stack.reset_rows(torch.ones(B)), TypeError, r"reset_rows\(mask\)"),
        (lambda: stack.reset_rows(torch.ones(2 * B, dtype=torch.bool)), ValueError, r"reset_rows\(mask\)"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
        assert_state_unchanged(stack, before)
    stack.reset_slot(np.int64(1))  # a numpy integer row, as the JAX recycle ops take
    stack.reset_slot(torch.tensor(1))  # and a 0-d integer tensor or array
    stack.reset_slot(np.array(1))
    stack.bump_slot_start(0)
    stack.bump_slot_start(0)  # start_offset 2 == offset 2
    stack.bump_slot_start(0)  # and past it: a plain += 1 (the sacrifice tick), no refusal
    assert stack.state.start_offset[0] == stack.state.offset[0] + 1


@pytest.mark.parametrize("name", ["temporal", "mimi"])
def test_an_impossible_batch_size_leaves_the_stream(name):
    """streaming_init released the stream before allocating: a batch size whose ring no device holds
    failed inside torch ("Storage size calculation overflowed", naming no argument) and left the stack
    without a stream. Refused first now, naming batch_size, the stream as it was."""
    stack = make_stack(name)
    stack.streaming_init(2)
    T = 1 if name == "temporal" else 2
    stack.step(torch.randn(2, T, stack.config.dim))
    before = snapshot(stack)
    cls = type(stack).__name__
    with pytest.raises(ValueError, match=rf"^{cls}\.streaming_init\(batch_size\): a ring of \[\d+, 1152921504606846976, "
                                         r"\d+, \d+, \d+\] float32 \(batch_size 1152921504606846976\) is more bytes "
                                         r"than any device holds"):
        stack.streaming_init(2**60)
    assert_state_unchanged(stack, before)
    stack.step(torch.randn(2, T, stack.config.dim))
    assert stack.state.offset.tolist() == [2 * T, 2 * T]


def test_inactive_rows_are_inert():
    stack = make_stack("mimi")
    stack.streaming_init(B)
    for _ in range(4):
        stack.step(torch.randn(B, 2, stack.config.dim))
    before = snapshot(stack)
    active = torch.tensor([True, False, True])
    stack.step(torch.randn(B, 2, stack.config.dim), active)
    assert torch.equal(stack.state.k[:, 1], before["k"][:, 1])
    assert torch.equal(stack.state.v[:, 1], before["v"][:, 1])
    assert stack.state.offset.tolist() == [10, 8, 10]
    assert not torch.equal(stack.state.k[:, 0], before["k"][:, 0])


def test_reset_ops():
    stack = make_stack("mimi")
    stack.streaming_init(B)
    for _ in range(3):
        stack.step(torch.randn(B, 2, stack.config.dim))
    stack.reset_slot(2)
    stack.bump_slot_start(0)
    assert stack.state.start_offset.tolist() == [1, 0, 6]
    with layer_tables(stack) as seen:
        stack.step(torch.randn(B, 2, stack.config.dim))
    assert seen[0].positions[2].tolist() == [-1] * 6 + [6, 7, -1, -1]
    stack.reset_rows(torch.tensor([True, False, False]))
    assert stack.state.offset.tolist() == [0, 8, 8] and stack.state.start_offset.tolist() == [0, 0, 6]
    stack.reset_streaming()
    assert not stack.state.k.any() and not stack.state.offset.any()


@pytest.mark.parametrize("name,prefix", [("temporal", None), ("mimi", "decoder_transformer")])
def test_checkpoint_round_trip(tmp_path, name, prefix):
    src = make_stack(name, seed=1)
    dst = make_stack(name, seed=2)
    path = tmp_path / "model.safetensors"
    src.save_safetensors(path, prefix)
    buffers = {k: v.data_ptr() for k, v in dst.weights().items()}
    dst.load_safetensors(path, prefix)
    for k, v in dst.weights().items():
        assert torch.equal(v, src.weights()[k]), k
        assert v.data_ptr() == buffers[k], "weights must be loaded in place"


def test_checkpoint_errors_list_every_key():
    stack = make_stack("mimi")
    sd = stack.export_weights("encoder_transformer")
    sd.pop("encoder_transformer.transformer.layers.1.linear1.weight")
    sd.pop("encoder_transformer.transformer.layers.0.norm2.bias")
    sd["encoder_transformer.transformer.layers.0.linear2.weight"] = torch.zeros(3, 3)
    sd["encoder_transformer.transformer.layers.7.linear1.weight"] = torch.zeros(3, 3)
    sd["decoder_transformer.transformer.layers.0.linear1.weight"] = torch.zeros(3, 3)  # other stack: ignored
    before = {k: v.clone() for k, v in stack.weights().items()}
    with pytest.raises(CheckpointError) as err:
        stack.load_weights(sd, "encoder_transformer")
    msg = str(err.value)
    assert "missing: encoder_transformer.transformer.layers.1.linear1.weight" in msg
    assert "missing: encoder_transformer.transformer.layers.0.norm2.bias" in msg
    assert "unexpected: encoder_transformer.transformer.layers.7.linear1.weight" in msg
    assert "wrong shape: encoder_transformer.transformer.layers.0.linear2.weight" in msg
    assert "decoder_transformer" not in msg
    for k, v in stack.weights().items():
        assert torch.equal(v, before[k])
    with pytest.raises(ValueError, match="prefix"):
        stack.load_weights(sd, "transformer")


def test_checkpoint_dtype_widening_only():
    f32 = make_stack("temporal", dtype=torch.float32)
    bf16 = make_stack("temporal", dtype=torch.bfloat16)
    f32.load_weights(bf16.export_weights())  # exact widening
    assert torch.equal(f32.in_proj, bf16.in_proj.float())
    with pytest.raises(CheckpointError, match="casting float32 to it would narrow it"):
        bf16.load_weights(make_stack("temporal").export_weights())


def test_bfloat16_step_runs_with_float32_tables():
    stack = make_stack("temporal", dtype=torch.bfloat16)
    stack.streaming_init(B)
    with layer_tables(stack) as seen:
        out, logits = stack.step(torch.randn(B, 1, stack.config.dim, dtype=torch.bfloat16))
    assert out.dtype == logits.dtype == stack.state.k.dtype == torch.bfloat16
    assert seen[0].cos.dtype == torch.float32
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------ construction-time refusals
ODD_HEAD_DIMS = {"temporal": with_options(PRESETS["temporal-small"], dim=48, num_heads=4),
                 "mimi": with_options(PRESETS["mimi-small"], dim=24, num_heads=2)}


@pytest.mark.parametrize("name", ["temporal", "mimi"])
def test_twin_stacks_refuse_a_head_dim_not_a_power_of_two_when_built(name):
    """kernels="twin" on head dim 12 is refused by the constructor, naming the stack and its head dim
    (it used to fail at the first step, inside the twin kernel); the reference kernels take it."""
    config = ODD_HEAD_DIMS[name]
    cls = TemporalStreaming if name == "temporal" else MimiTransformer
    stack = "temporal" if name == "temporal" else "Mimi transformer"
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\(kernels\): kernels='twin' needs power-of-two head "
                                         rf"dims \(.*\); the {stack} stack's is 12 \(head_dim = dim"):
        cls.from_config(config, kernels="twin")
    module = cls.from_config(config, kernels="reference")
    module.streaming_init(B)
    module.step(torch.zeros(B, 1, config.dim))


def test_from_config_refuses_a_config_of_another_type_with_a_type_error():
    with pytest.raises(TypeError, match=r"^TemporalStreaming\.from_config\(config\): config must be a "
                                        r"TemporalConfig, got MimiConfig$"):
        TemporalStreaming.from_config(PRESETS["mimi-small"])
    with pytest.raises(TypeError, match=r"^MimiTransformer\.from_config\(config\): config must be a MimiConfig, "
                                        r"got TemporalConfig$"):
        MimiTransformer.from_config(PRESETS["temporal-small"])

