"""Steps over two devices, on two forced CPU devices.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=2 (`bash run.sh test` sets it); with
one device the two-device tests skip and say so.

Oracles. Sessions: the one-device step with the same options, bit for bit (`parity.bits`,
so -0 != +0; at batch B/n, and at batch B with the twin kernels or two rows a device), for
every output, ring and offset after every step and every recycle op; the layout checked by
spec and per-device shard shape; the compiled sessions step and recycle ops hold no collective.
Tensor parallel: the one-device step within `TP_MAX_REL` (normwise max rel per step, float32),
the offsets identical, each device's ring the matching heads of the one-device ring, exactly two
all-reduces of [B, T, dim] per layer and no other collective, and bit-identity on a mesh of one
device (where the all-reduce is the identity: what is left is the layout and the plumbing).
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl import sharding as sh
from jax_impl.checkpoint import CheckpointError
from jax_impl.config import with_options
from jax_impl.parity import bits
from jax_impl.sessions import session_ops
from torch_bridge import TemporalStreaming
from torch_bridge.jax_steppers import from_torch
from torch_bridge.sharding import shard_dropin

two_devices = pytest.mark.skipif(
    len(jax.devices()) < 2,
    reason=f"needs 2 JAX devices, found {len(jax.devices())}: run with "
           f"XLA_FLAGS=--xla_force_host_platform_device_count=2 (bash run.sh test sets it)")

B = 4
FRAMES = {"temporal": 1, "mimi": 2}


@functools.cache
def init_params(config, seed: int) -> dict:
    """Random variables, initialized once per (config, seed) for the whole file (each init compiles)."""
    return jx.init_params(config, jax.random.key(seed))


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def rel(a, b) -> float:
    """Normwise relative distance max|a - b| / max|b| (as the cross-check reports it)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def frames(kind: str, config, t: int) -> np.ndarray:
    return np.array(jax.random.normal(jax.random.key(100 + t), (B, FRAMES[kind], config.dim)))  # writable


def assert_sessions_layout(state: jx.StreamState, mesh) -> None:
    """Rings split on B, offsets split by row, each device B/n rows."""
    n = mesh.shape[sh.SESSIONS]
    assert state.k.sharding.spec == state.v.sharding.spec == jax.sharding.PartitionSpec(None, sh.SESSIONS)
    assert state.offset.sharding.spec == state.start_offset.sharding.spec == jax.sharding.PartitionSpec(sh.SESSIONS)
    L, _, H, C, D = state.k.shape
    for leaf, shape in ((state.k, (L, B // n, H, C, D)), (state.offset, (B // n,))):
        assert len(leaf.addressable_shards) == n
        for shard in leaf.addressable_shards:
            chex.assert_shape(shard.data, shape)


def assert_same_stream(got, want, outputs_got=None, outputs_want=None) -> None:
    for name in jx.StreamState._fields:
        assert same_bits(getattr(got, name), getattr(want, name)), name
    for i, (a, b) in enumerate(zip(jax.tree.leaves(outputs_got), jax.tree.leaves(outputs_want), strict=True)):
        assert same_bits(a, b), f"output {i}"


# ------------------------------------------------------------------------------ sessions
@two_devices
def test_sessions_step_bit_identical_through_recycling():
    """The temporal stack (Mimi's sharded step: test_sharded_streamer_snapshot_restore_and_files)."""
    kind = "temporal"
    config = jx.PRESETS[f"{kind}-small"]
    params = init_params(config, 0)
    mesh = sh.session_mesh()
    ref_step, step = jx.make_step(config), sh.make_sharded_step(config, mesh)
    ref = jx.init_state(config, B)
    sparams, state = sh.shard_sessions(params, jx.init_state(config, B), mesh)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(sparams))
    assert_sessions_layout(state, mesh)
    # the compiled step and every recycle op: no communication at all
    assert sh.collectives(step.lower(sparams, state, frames(kind, config, 0)).compile().as_text()) == {}
    ops = session_ops(mesh, sh.SESSIONS)
    mask = jax.device_put(np.array([True, False, False, True]), jax.sharding.NamedSharding(mesh, jax.P(sh.SESSIONS)))
    for name, args in (("reset_slot", (np.int32(1),)), ("bump_slot_start", (np.int32(1),)), ("reset_rows", (mask,)),
                       ("reset_streaming", ())):
        assert sh.collectives(ops[name].lower(state, *args).compile().as_text()) == {}, name
    recycle = {2: [("reset_slot", 1), ("bump_slot_start", 1)], 4: [("reset_slot", 2)], 5: [("bump_slot_start", 3)],
               7: [("reset_rows", np.array([True, False, False, True]))], 8: [("reset_slot", 0)]}
    for t in range(10):
        x, active = frames(kind, config, t), np.arange(B) != t % B
        out_ref, ref = ref_step(params, ref, x, active)
        out, state = step(sparams, state, x, active)
        assert_same_stream(state, ref, out, out_ref)
        assert_sessions_layout(state, mesh)
        assert all(o.sharding.spec == jax.P(sh.SESSIONS) for o in jax.tree.leaves(out))
        for op, arg in recycle.get(t, []):
            ref = getattr(jx, f"jit_{op}")(ref, jnp.asarray(arg) if op == "reset_rows" else arg)
            state = getattr(sh, f"sharded_{op}")(state, arg)
            assert_same_stream(state, ref)
            assert_sessions_layout(state, mesh)
    state = sh.sharded_reset_streaming(state)
    assert_sessions_layout(state, mesh)
    assert not np.asarray(state.k).any() and not np.asarray(state.offset).any()


def concat_rows(trees, axes) -> list:
    """The leaves of per-device results joined along their batch axes (`axes`: one per leaf)."""
    return [np.concatenate(leaves, axis) for axis, leaves in
            zip(axes, zip(*(jax.tree.leaves(t) for t in trees), strict=True), strict=True)]


@two_devices
@pytest.mark.parametrize("kernels", ["twin", "pallas", "reference"])
def test_sessions_step_bits_at_each_batch_per_device(kernels):
    """Each device runs the one-device step on its B/n rows: every row has that step's bits at batch
    B/n. With the twin kernels (batch-invariant) that is the one-device step's at batch B too, a row a
    device included; with the others it is at two rows a device (at one, XLA dots one row otherwise).
    Pallas and twin run inside the shard_map (their outputs carry no varying-axes type)."""
    config = jx.PRESETS["temporal-small"]
    params = init_params(config, 0)
    mesh = sh.session_mesh()
    ref_step, step = jx.make_step(config, kernels=kernels), sh.make_sharded_step(config, mesh, kernels=kernels)
    axes = (0, 0, 1, 1, 0, 0)  # out, logits, then the state: k, v, offset, start_offset
    for rows in (2, B):
        half = rows // 2
        sparams, state = sh.shard_sessions(params, jx.init_state(config, rows), mesh)
        ref, per_device = jx.init_state(config, rows), [jx.init_state(config, half) for _ in range(2)]
        for t in range(2):
            x = frames("temporal", config, t)[:rows]
            out, state = step(sparams, state, x)
            out_ref, ref = ref_step(params, ref, x)
            stepped = [ref_step(params, s, x[i * half:(i + 1) * half]) for i, s in enumerate(per_device)]
            per_device = [s for _, s in stepped]
            got = jax.tree.leaves((out, state))
            assert all(same_bits(a, b) for a, b in zip(got, concat_rows(stepped, axes), strict=True))
            if kernels == "twin" or half > 1:
                assert_same_stream(state, ref, out, out_ref)


@two_devices
def test_sessions_refusals_name_the_argument():
    config = jx.PRESETS["temporal-small"]
    params = init_params(config, 0)
    mesh = sh.session_mesh()
    with pytest.raises(ValueError, match=r"batch_size B = 3 must be divisible by the 2 devices of mesh axis "
                                         r"'sessions'.*pad the batch"):
        sh.shard_sessions(params, jx.init_state(config, 3), mesh)
    with pytest.raises(ValueError, match=r"ShardedStreamer\(batch_size\): batch_size B = 5"):
        sh.ShardedStreamer(config, params, 5, mesh=mesh)
    with pytest.raises(ValueError, match=r"init_state\(device\): state\.k \[.*\] \(batch_size 3\) does not split"):
        jx.init_state(config, 3, device=sh.session_shardings(mesh))
    with pytest.raises(ValueError, match=r"make_sharded_step\(axis\): the mesh has axes \['sessions'\], not 'rows'"):
        sh.make_sharded_step(config, mesh, "rows")
    with pytest.raises(ValueError, match=r"session_mesh\(devices\): a device is listed twice"):
        sh.session_mesh([jax.devices()[0]] * 2)
    step = sh.make_sharded_step(config, mesh)
    sparams, state = sh.shard_sessions(params, jx.init_state(config, B), mesh)
    x = np.zeros((B, 1, config.dim), np.float32)
    with pytest.raises(ValueError, match=r"step\(state\): state\.k is laid out as SingleDeviceSharding.*"
                                         r"shard_sessions"):
        step(sparams, jx.init_state(config, B), x)
    with pytest.raises(ValueError, match=r"step\(params\): params\['params'\]\['layers'\]\['in_proj'\] is laid out"):
        step(params, state, x)
    d0, d1 = jax.devices()[:2]  # the same layout on the same devices in another order: the message tells them apart
    pair = sh.session_mesh([d0, d1])
    pair_params, _ = sh.shard_sessions(params, jx.init_state(config, B), pair)
    _, reversed_state = sh.shard_sessions(params, jx.init_state(config, B), sh.session_mesh([d1, d0]))
    with pytest.raises(ValueError, match=rf"step\(state\): state\.k is laid out as .* on devices \[{d1.id}, "
                                         rf"{d0.id}\], expected .* on devices \[{d0.id}, {d1.id}\]"):
        sh.make_sharded_step(config, pair)(pair_params, reversed_state, x)
    with pytest.raises(ValueError, match=r"step\(x\): x must have shape \[B=4, T, dim=64\]"):
        step(sparams, state, x[:, :, :8])
    with pytest.raises(TypeError, match=r"step\(x\): x has dtype float64; .*float64 -> float32 would round x"):
        step(sparams, state, x.astype(np.float64))  # refused before device_put narrows it
    for rows in (3, 5):  # rows that do not split over the mesh: the step's message, not the placement's
        with pytest.raises(ValueError, match=rf"step\(x\): x must have shape \[B=4, T, dim=64\], got \[{rows}, 1, 64\]"):
            step(sparams, state, np.zeros((rows, 1, config.dim), np.float32))
        with pytest.raises(ValueError, match=rf"step\(active\): active must have shape \[4\], got \[{rows}\]"):
            step(sparams, state, x, np.ones(rows, bool))
    with pytest.raises(ValueError, match=r"reset_slot\(state\): the state is not sharded by session"):
        sh.sharded_reset_slot(jx.init_state(config, B), 0)
    with pytest.raises(IndexError, match=r"reset_slot\(b\): b=4 is out of range for batch_size 4"):
        sh.sharded_reset_slot(state, 4)
    with pytest.raises(ValueError, match=r"reset_rows\(mask\): mask must have shape \[4\]"):
        sh.sharded_reset_rows(state, np.ones(3, bool))
    assert not state.k.is_deleted()  # refused before the donated call
    with pytest.raises(TypeError, match=r"step\(active\): active must be a bool array, got list"):
        step(sparams, state, x, [True] * B)  # not placed as an array: the step's own check names it
    donated, state = state, sh.sharded_reset_slot(state, 1)
    for op, arg in ((sh.sharded_reset_slot, 0), (sh.sharded_bump_slot_start, 0), (sh.sharded_reset_rows, np.ones(B, bool)),
                    (sh.sharded_reset_streaming, None), (lambda s: step(sparams, s, x), None),
                    (lambda s: sh.shard_sessions(params, s, mesh), None)):
        with pytest.raises(ValueError, match="the state was donated to an earlier call"):
            op(donated, arg) if arg is not None else op(donated)
    streamer = sh.ShardedStreamer(config, params, B, mesh=mesh)
    odd = jx.state_snapshot(config, jx.init_state(config, 3))
    with pytest.raises(ValueError, match=r"restore\(snapshot\): batch_size B = 3 must be divisible"):
        streamer.restore(odd)
    assert streamer.batch_size == B
    assert_sessions_layout(streamer.state, mesh)


@two_devices
def test_sharded_streamer_snapshot_restore_and_files(tmp_path):
    config = jx.PRESETS["mimi-small"]
    params = init_params(config, 1)
    mesh = sh.session_mesh()
    ref = jx.Streamer(config, params, B)
    got = sh.ShardedStreamer(config, params, B, mesh=mesh)
    for t in range(4):
        assert same_bits(got.step(frames("mimi", config, t)), ref.step(frames("mimi", config, t)))
    got.reset_slot(3)
    ref.reset_slot(3)
    first = got.snapshot()
    assert first["k"].sharding.spec == jax.P(None, sh.SESSIONS)  # copies, split as the state
    got.save_stream(tmp_path / "s.safetensors")
    later = [frames("mimi", config, t) for t in range(4, 7)]
    want = [ref.step(x) for x in later]
    assert same_bits(np.stack([got.step(x) for x in later]), np.stack(want))
    for restored in (sh.ShardedStreamer(config, params, 2, mesh=mesh), jx.Streamer(config, params, 2)):
        restored.restore(first, resize=True)  # the snapshot outlived three donated steps
        assert same_bits(np.stack([restored.step(x) for x in later]), np.stack(want))
    from_file = sh.ShardedStreamer(config, params, 2, mesh=mesh)
    from_file.load_stream(tmp_path / "s.safetensors", resize=True)
    assert_sessions_layout(from_file.state, mesh)
    assert from_file.offset_bound == 8
    assert same_bits(np.stack([from_file.step(x) for x in later]), np.stack(want))
    params2 = jax.tree.map(lambda a: a * 1.5, params)
    got.convert(params2)  # new weights mid-stream (the drop-ins' .to() path): the stream stays split
    ref.convert(params2)
    assert_sessions_layout(got.state, mesh)
    assert same_bits(got.step(later[0]), ref.step(later[0]))
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params2)
    with pytest.raises(TypeError, match=r"convert\(params\): the params hold bfloat16, the ring float32; .*refused"):
        got.convert(bf16)
    assert_sessions_layout(got.state, mesh)
    assert same_bits(got.step(later[1]), ref.step(later[1]))
    from_file.reset_rows(np.ones(B, bool))
    assert from_file.offset_bound == 0


@two_devices
def test_sharded_streamer_restore_of_another_batch_size_only_when_asked():
    """A snapshot of 2 rows (splitting over the mesh) into a ShardedStreamer of 4: refused, naming both
    sizes and resize=True, the state unchanged; with resize=True restored, split by row."""
    config = jx.PRESETS["mimi-small"]
    params = init_params(config, 1)
    mesh = sh.session_mesh()
    small = jx.Streamer(config, params, 2)
    small.step(np.ones((2, 2, config.dim), np.float32))
    snap = small.snapshot()
    got = sh.ShardedStreamer(config, params, B, mesh=mesh)
    got.step(frames("mimi", config, 0))
    before = jax.tree.map(jnp.copy, got.state)
    with pytest.raises(ValueError, match=r"restore\(snapshot\): the snapshot holds 2 rows \(batch_size 2\), this "
                                         r"stream 4; nothing was changed\. With resize=True"):
        got.restore(snap)
    assert_same_stream(got.state, before)
    assert_sessions_layout(got.state, mesh)
    got.restore(snap, resize=True)
    assert got.batch_size == 2 and got.offset_bound == 2
    assert_same_stream(got.state, small.state)
    assert got.state.k.sharding.spec == jax.sharding.PartitionSpec(None, sh.SESSIONS)
    assert [shard.data.shape[1] for shard in got.state.k.addressable_shards] == [1, 1]  # a row a device


@two_devices
def test_dropin_on_sharded_state_bit_identical():
    config = jx.PRESETS["temporal-small"]
    torch_stack = TemporalStreaming.from_config(config)
    torch_stack.init_weights(generator=torch.Generator().manual_seed(3))
    ref, got = from_torch(torch_stack), from_torch(torch_stack)
    for m in (ref, got):
        m.streaming_init(B)
    with pytest.raises(ValueError, match=r"from_streamer\(streamer\): batch_size B = 3"):
        other = from_torch(torch_stack)
        other.streaming_init(3)
        shard_dropin(other)
    assert shard_dropin(got) is got
    mesh = got._streamer.mesh
    with pytest.raises(RuntimeError, match=r"state: this JaxTemporalStreaming's stream is split over 2 devices "
                                           r"\(shard_dropin\).*use snapshot\(\)"):
        got.state  # noqa: B018 (the property's refusal is what is tested)
    assert_sessions_layout(got.jax_state, mesh)
    split = shard_dropin(from_torch(torch_stack), mesh, batch_size=B)  # a fresh stream made split: no streaming_init
    assert_sessions_layout(split.jax_state, mesh)
    before = split.jax_state
    for bad, match in ((3, r"shard_dropin\(batch_size\): batch_size B = 3"), (0, "positive int")):
        with pytest.raises(ValueError, match=match):
            shard_dropin(split, mesh, batch_size=bad)
        assert split.jax_state is before  # refused: the stream it had is untouched
    for t in range(6):
        x = torch.from_numpy(frames("temporal", config, t))
        active = torch.arange(B) != t % B
        out_ref, out, out_split = ref.step(x, active), got.step(x, active), split.step(x, active)
        for a, b, c in zip(out, out_ref, out_split, strict=True):
            assert a.device == b.device == c.device == torch.device("cpu")  # the module's device
            assert same_bits(a, b) and same_bits(c, b)
        if t == 2:
            for m in (ref, got, split):
                m.reset_slot(1)
                m.bump_slot_start(1)
                m.reset_rows(torch.tensor([False, False, True, False]))
    assert_sessions_layout(got.jax_state, mesh)
    snap = got.snapshot()  # torch tensors on the module's device
    assert all(snap[k].device == torch.device("cpu") for k in ("k", "v", "offset", "start_offset"))
    fresh = from_torch(torch_stack)
    fresh.restore(snap)
    got.restore(ref.snapshot())
    assert_sessions_layout(got.jax_state, mesh)
    x = torch.from_numpy(frames("temporal", config, 9))
    outs = [m.step(x) for m in (ref, got, fresh)]
    assert all(same_bits(a, b) for o in outs[1:] for a, b in zip(o, outs[0], strict=True))


@two_devices
def test_dropin_of_a_twin_stack_split_a_row_a_device():
    """A drop-in of a stack built with kernels="twin" steps on the Pallas twins inside the sharded step,
    a row a device: the torch twin's bits. A fresh stream too large for any device is refused before
    the stream it had goes: that one still steps."""
    config = jx.PRESETS["temporal-small"]
    torch_stack = TemporalStreaming.from_config(config, kernels="twin")
    torch_stack.init_weights(generator=torch.Generator().manual_seed(3))
    dropin = from_torch(torch_stack)
    assert dropin.kernels == "twin"
    for m in (torch_stack, dropin):
        m.streaming_init(2)
    xs = [torch.from_numpy(frames("temporal", config, t)[:2]) for t in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(dropin.step(xs[0]), torch_stack.step(xs[0]), strict=True))
    before = dropin.jax_state
    with pytest.raises(ValueError, match=r"shard_dropin\(batch_size\): .*\(batch_size 1152921504606846976\) is more "
                                         r"bytes than any device holds"):
        shard_dropin(dropin, batch_size=2**60)
    assert dropin.jax_state is before  # the stream it had, unchanged
    assert all(torch.equal(a, b) for a, b in zip(dropin.step(xs[1]), torch_stack.step(xs[1]), strict=True))
    shard_dropin(dropin)
    assert [s.data.shape[1] for s in dropin.jax_state.k.addressable_shards] == [1, 1]  # a row a device
    assert all(torch.equal(a, b) for a, b in zip(dropin.step(xs[2]), torch_stack.step(xs[2]), strict=True))


# ------------------------------------------------------------------------------ tensor parallel
@two_devices
@pytest.mark.parametrize("kernels", ["auto", "pallas"])
def test_tensor_parallel_within_bound_of_one_device(kernels):
    config = jx.PRESETS["temporal-small"]
    L, H = config.num_layers, config.num_heads
    params = init_params(config, 2)
    mesh = sh.session_mesh(axis=sh.MODEL)
    ref_step, step = jx.make_step(config, kernels=kernels), sh.make_tensor_parallel_step(config, mesh, kernels=kernels)
    ref = jx.init_state(config, B)
    tp, state = sh.shard_tensor_parallel(config, params, jx.init_state(config, B), mesh)
    assert state.k.sharding.spec == jax.P(None, None, sh.MODEL) and state.offset.sharding.is_fully_replicated
    for name, dim in (("in_proj", 2), ("linear_in", 2), ("out_proj", 2), ("linear_out", 2)):
        shard_shapes = {s.data.shape[dim] for s in tp["layers"][name].addressable_shards}
        assert shard_shapes == {tp["layers"][name].shape[dim] // 2}, name
    compiled = step.lower(tp, state, frames("temporal", config, 0)).compile().as_text()
    # in the scan's body (one layer): after the attention and after the FFN, of [B, T, dim] each
    assert sh.collectives(compiled) == {"all-reduce": 2}
    assert len(re.findall(rf"= f32\[{B},1,{config.dim}\]\S* all-reduce\(", compiled)) == 2
    worst = 0.0
    for t in range(8):
        x, active = frames("temporal", config, t), np.arange(B) != t % B
        (out_ref, logits_ref), ref = ref_step(params, ref, x, active)
        (out, logits), state = step(tp, state, x, active)
        assert out.sharding.is_fully_replicated and logits.sharding.is_fully_replicated
        assert same_bits(state.offset, ref.offset) and same_bits(state.start_offset, ref.start_offset)
        for i, shard in enumerate(sorted(state.k.addressable_shards, key=lambda s: s.index[2].start)):
            assert shard.data.shape == (L, B, H // 2, config.capacity, config.head_dim)
            worst = max(worst, rel(shard.data, ref.k[:, :, i * H // 2:(i + 1) * H // 2]))
        worst = max(worst, rel(out, out_ref), rel(logits, logits_ref), rel(state.v, ref.v))
        assert worst <= sh.TP_MAX_REL["float32"], (t, worst)
        if t == 3:  # the plain recycle ops work on the tensor-parallel state and keep its layout
            ref, state = jx.jit_reset_slot(ref, 2), jx.jit_reset_slot(state, 2)
            ref, state = jx.jit_bump_slot_start(ref, 2), jx.jit_bump_slot_start(state, 2)
            assert state.k.sharding.spec == jax.P(None, None, sh.MODEL)
    assert worst > 0  # the all-reduce adds in another order: the bits do differ


@pytest.mark.parametrize("kernels", ["auto", "pallas"])
def test_tensor_parallel_on_one_device_is_bit_identical(kernels):
    config = jx.PRESETS["temporal-small"]
    params = init_params(config, 2)
    mesh = sh.session_mesh(jax.devices()[:1], axis=sh.MODEL)
    ref_step, step = jx.make_step(config, kernels=kernels), sh.make_tensor_parallel_step(config, mesh, kernels=kernels)
    ref = jx.init_state(config, B)
    tp, state = sh.shard_tensor_parallel(config, params, jx.init_state(config, B), mesh)
    for t in range(3):
        x = frames("temporal", config, t)
        out_ref, ref = ref_step(params, ref, x, np.arange(B) != t)
        out, state = step(tp, state, x, np.arange(B) != t)
        assert_same_stream(state, ref, out, out_ref)


def test_tensor_parallel_refusals_name_the_argument():
    config = jx.PRESETS["temporal-small"]
    params = init_params(config, 2)
    mesh = sh.session_mesh(jax.devices()[:1], axis=sh.MODEL)
    with pytest.raises(TypeError, match=r"make_tensor_parallel_step\(config\): .*got MimiConfig"):
        sh.make_tensor_parallel_step(jx.PRESETS["mimi-small"], mesh)
    with pytest.raises(ValueError, match=r"kernels\): 'twin' is not split"):
        sh.make_tensor_parallel_step(config, mesh, kernels="twin")
    if len(jax.devices()) >= 2:
        two = sh.session_mesh(axis=sh.MODEL)
        with pytest.raises(ValueError, match=r"num_heads = 1 must be divisible by the 2 devices of mesh axis 'model'"):
            sh.make_tensor_parallel_step(with_options(config, num_heads=1), two)
    step = sh.make_tensor_parallel_step(config, mesh)
    tp, state = sh.shard_tensor_parallel(config, params, jx.init_state(config, B), mesh)
    x = np.zeros((B, 1, config.dim), np.float32)
    with pytest.raises(TypeError, match=r"step\(params\): expected the tensor-parallel parameters"):
        step(params, state, x)  # Flax variables: not the tensor-parallel layout
    with pytest.raises(CheckpointError, match=r"step\(params\): expected a Flax variables dict"):
        jx.make_step(config)(tp, jx.init_state(config, B), x)  # and the plain step refuses the split layout
    for dtype in (jnp.int32, "foo"):  # the partial sums would be truncated to integers
        with pytest.raises(TypeError, match=r"make_tensor_parallel_step\(reduce_dtype\): expected None or a float"):
            sh.make_tensor_parallel_step(config, mesh, reduce_dtype=dtype)
    with pytest.raises(TypeError, match=r"reduce_dtype\): bfloat16 would round the partial sums of this float32"):
        sh.make_tensor_parallel_step(config, mesh, reduce_dtype=jnp.bfloat16)(tp, state, x)
    # the options are make_step's, checked as its are: a table of the wrong length, a truthy string, and
    # exact_rope=False on the Pallas kernels (whose RoPE is exact always) refused by name
    with pytest.raises(ValueError, match=r"make_tensor_parallel_step\(rope_freqs\)"):
        sh.make_tensor_parallel_step(config, mesh, rope_freqs=(1.0,))
    with pytest.raises(TypeError, match=r"make_tensor_parallel_step\(donate\)"):
        sh.make_tensor_parallel_step(config, mesh, donate="False")
    with pytest.raises(ValueError, match=r"make_tensor_parallel_step\(exact_rope, kernels\)"):
        sh.make_tensor_parallel_step(config, mesh, exact_rope=False, kernels="pallas")
    freqs = tuple(float(f) for f in np.linspace(1.0, 1e-3, config.head_dim // 2, dtype=np.float32))
    assert sh.make_tensor_parallel_step(config, mesh, rope_freqs=list(freqs)) is \
        sh.make_tensor_parallel_step(config, mesh, rope_freqs=freqs)  # a list keys as its tuple: one step
    assert not jax.config.jax_enable_x64  # float64 would be made float32 silently
    with pytest.raises(TypeError, match=r"make_tensor_parallel_step\(reduce_dtype\): float64 needs jax_enable_x64"):
        sh.make_tensor_parallel_step(config, mesh, reduce_dtype=jnp.float64)
    lora = jx.init_lora(config, jax.random.key(1), rank=4)
    with pytest.raises(CheckpointError, match=r"step\(params\): unexpected top-level keys \['lora'\]; expected "
                                              r"\['layers', 'out_norm_alpha', 'text_linear'\] \(LoRA adapters are not "
                                              r"supported by the tensor-parallel step\)"):
        step({**tp, "lora": lora}, state, x)
    assert not state.k.is_deleted()


@two_devices
def test_states_are_made_where_they_live():
    """`init_state(device=...)` makes the state on a device or split by row (each array made there
    by one jitted computation with those output shardings: never made on the default device and
    moved, which at B=64 would need a 50 GB ring's room there); `Streamer(device=...)` and
    `ShardedStreamer` make theirs that way. The values are a fresh state's."""
    cfg = jx.PRESETS["mimi-small"]
    d1 = jax.devices()[1]
    mesh = sh.session_mesh()
    rows = sh.session_shardings(mesh)
    params = init_params(cfg, 0)
    alone = jx.init_state(cfg, B, device=d1)
    split = jx.init_state(cfg, B, device=rows)
    streamer = jx.Streamer(cfg, jax.device_put(params, d1), B, device=d1)
    sharded = sh.ShardedStreamer(cfg, params, B, mesh=mesh)
    for state in (alone, streamer.state):
        assert all(a.devices() == {d1} for a in state)
    for state in (split, sharded.state):
        for a, want in zip(state, rows):
            assert a.sharding.is_equivalent_to(want, a.ndim) and len(a.devices()) == 2
    fresh = jax.device_get(jx.init_state(cfg, B))
    for state in (alone, split):
        chex.assert_trees_all_equal(jax.device_get(state), fresh)
    # a snapshot restores straight onto a device or split by row, as fresh buffers (a later donated
    # step deletes the state's, never the snapshot's)
    snap = jx.state_snapshot(cfg, alone)                                    # jax arrays on d1
    host = {k: v if k == "metadata" else np.asarray(v) for k, v in snap.items()}
    back, back_split = jx.state_from_snapshot(cfg, snap, device=d1), jx.state_from_snapshot(cfg, host, device=rows)
    assert all(a.devices() == {d1} for a in back)
    assert back.k.unsafe_buffer_pointer() != snap["k"].unsafe_buffer_pointer()
    for a, want in zip(back_split, rows):
        assert a.sharding.is_equivalent_to(want, a.ndim)
    chex.assert_trees_all_equal(jax.device_get(back_split), fresh)
    with pytest.raises(TypeError, match=r"init_state\(device\): expected a jax.Device"):
        jx.init_state(cfg, B, device="cpu:1")
