"""Torch module conventions and stream snapshots on the four torch-facing stacks and `jax_impl.Streamer`.

- `.to()` / `.float()` / `.half()` / `.bfloat16()` / `.double()` / `.cpu()` / `.share_memory()` /
  `.type()`: convert the weights and, while streaming, the state (exact widenings only), or
  refuse with everything unchanged; the drop-ins' JAX params and state follow.
- `snapshot()` / `restore()` / `save_stream()` / `load_stream()`: a stream restored into a fresh
  object continues bit for bit; `restore` validates (naming the key) or changes nothing; the
  `Streamer`'s overflow bound follows the restored offsets; snapshots cross between paths.
- the drop-ins' `reset_rows` takes every mask the torch path takes.
- `to_torch` of a deleted / donated array, the step's dtype rule for x on all sides, and
  `check_headroom(state)`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl.config import PRESETS, with_options
from kernels_pallas.contract.numerics import INT32_MAX
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import to_jax, to_torch
from torch_bridge.jax_steppers import JaxMimiTransformer, JaxTemporalStreaming

TCFG = PRESETS["temporal-small"]
MCFG = PRESETS["mimi-small"]
B = 3
CLASSES = [TemporalStreaming, MimiTransformer, JaxTemporalStreaming, JaxMimiTransformer]
JAX_CLASSES = [JaxTemporalStreaming, JaxMimiTransformer]
KEYS = ("k", "v", "offset", "start_offset")
ids = [c.__name__ for c in CLASSES]


def make(cls, dtype=torch.float32, seed=0):
    config = TCFG if issubclass(cls, TemporalStreaming) else MCFG
    model = cls.from_config(config, dtype=dtype)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model


def frames(model, n, seed, dtype=None):
    """n (x [B, T, dim], active [B]) inputs; T=1 (temporal) or 2 (Mimi), every row idle at times."""
    g = torch.Generator().manual_seed(seed)
    T = 1 if isinstance(model, TemporalStreaming) else 2
    out = []
    for i in range(n):
        x = torch.randn(B, T, model.config.dim, generator=g).to(dtype or model.dtype)
        out.append((x, torch.arange(B) != i % (B + 1)))
    return out


def first(y):
    return y[0] if isinstance(y, tuple) else y


def run(model, inputs, recycle=False):
    """Step through `inputs` (with a few recycle ops when asked); returns the outputs, cloned."""
    outs = []
    for i, (x, active) in enumerate(inputs):
        if recycle and i == 3:
            model.reset_slot(1)
        if recycle and i == 5:
            model.bump_slot_start(0)
        if recycle and i == 7:
            model.reset_rows(torch.tensor([False, False, True]))
        outs.append(first(model.step(x, active)).clone())
    return outs


def state_of(model) -> dict:
    s = model.state
    return {k: getattr(s, k).clone() for k in KEYS}


def assert_state(model, expected: dict) -> None:
    for k in KEYS:
        assert torch.equal(getattr(model.state, k), expected[k]), k


def weights_of(model) -> dict:
    return {k: v.clone() for k, v in model.weights().items()}


def assert_outputs_equal(a, b) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {i}"


def assert_params_view_buffers(model) -> None:
    """A drop-in's JAX params are zero-copy views of its current torch buffers."""
    p = model._streamer.params["params"]
    for name, buffer in model.weights().items():
        leaf = p["layers"][name] if name in p["layers"] else p[name]
        assert leaf.unsafe_buffer_pointer() == buffer.data_ptr(), name
        assert leaf.dtype == to_jax(buffer).dtype, name


# ============================================================================ 1. module conventions
@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_load_state_dict_keeps_to_the_loaders_rules(cls):
    """`nn.Module.load_state_dict` would cast float64 values into the float32 buffers and, with
    assign=True, swap in buffers of another dtype: both refused naming the key, nothing written. A
    drop-in streaming through an assign=True load steps with the new buffers: the bits of an in-place
    load of the same values."""
    from jax_impl.checkpoint import CheckpointError

    model = make(cls)
    model.streaming_init(B)
    before = weights_of(model)
    halved = {k: v * 0.5 for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="wrong dtype: in_proj: float64"):
        model.load_state_dict({k: v.double() for k, v in halved.items()})
    with pytest.raises(CheckpointError, match=r"not assignable: in_proj: torch.bfloat16 \[2, "):
        model.load_state_dict({k: v.bfloat16() for k, v in halved.items()}, assign=True)
    assert all(torch.equal(v, before[k]) for k, v in model.weights().items())
    inputs = frames(model, 2, seed=4)
    twin = make(cls)
    twin.streaming_init(B)
    model.load_state_dict({k: v.clone() for k, v in halved.items()}, assign=True)
    twin.load_state_dict(halved)
    assert model.in_proj.data_ptr() != twin.in_proj.data_ptr()
    for a, b in zip(run(model, inputs), run(twin, inputs), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", CLASSES, ids=ids)
@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
def test_refused_conversions_change_nothing(cls):
    """While streaming: float64, complex, narrowing the ring, turning the int64 offsets into
    floats and devices JAX lacks are refused; weights (the same objects), state and the next
    step are as if nothing was called."""
    model, twin = make(cls), make(cls)
    with pytest.raises(TypeError, match=r"to torch.float64 is refused.*no float64 stack"):
        model.double()  # before streaming too
    assert model.dtype == torch.float32 and model.state is None
    inputs = frames(model, 6, seed=1)
    model.streaming_init(B)
    twin.streaming_init(B)
    run(model, inputs[:3], recycle=True)
    run(twin, inputs[:3], recycle=True)
    buffers, weights, state = model.weights(), weights_of(model), state_of(model)
    refusals = [
        (lambda: model.double(), TypeError, "float64 is refused"),
        (lambda: model.to(torch.float64), TypeError, "float64 is refused"),
        (lambda: model.to(torch.complex64), TypeError, "complex64 is refused"),
        (lambda: model.half(), RuntimeError, r"from torch.float32 to torch.float16 is refused.*would round"),
        (lambda: model.bfloat16(), RuntimeError, "to torch.bfloat16 is refused"),
        (lambda: model.to(torch.float16), RuntimeError, "streaming_end"),
        (lambda: model.type(torch.float32), TypeError, "int64 offsets into torch.float32"),
    ]
    if not torch.cuda.is_available():
        refusals.append((lambda: model.cuda(), (AssertionError, RuntimeError), "CUDA"))
    if cls in JAX_CLASSES:
        refusals.append((lambda: model.to("meta"), ValueError, "state lives in JAX"))
    for call, exc, pattern in refusals:
        with pytest.raises(exc, match=pattern):
            call()
        assert model.dtype == torch.float32
        for name, buffer in model.weights().items():
            assert buffer is buffers[name] and torch.equal(buffer, weights[name]), name
        assert_state(model, state)
    if cls in JAX_CLASSES:
        assert_params_view_buffers(model)
    assert_outputs_equal(run(model, inputs[3:]), run(twin, inputs[3:]))


@pytest.mark.parametrize("method", ["float", "to-dtype", "to-device-dtype"])
@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_widening_while_streaming_converts_the_state(cls, method):
    """A bf16 stack widened mid-stream: buffers and rings are exactly the bf16 values in float32,
    offsets unchanged, and the stream goes on as a float32 stack restored from the bf16 stream."""
    model = make(cls, torch.bfloat16)
    inputs = frames(model, 8, seed=2, dtype=torch.float32)
    model.streaming_init(B)
    run(model, [(x.bfloat16(), a) for x, a in inputs[:4]], recycle=True)
    weights, state, snap = weights_of(model), state_of(model), model.snapshot()
    convert = {"float": lambda m: m.float(), "to-dtype": lambda m: m.to(torch.float32),
               "to-device-dtype": lambda m: m.to(device="cpu", dtype=torch.float32)}[method]
    assert convert(model) is model
    assert model.dtype == torch.float32
    for name, buffer in model.weights().items():
        assert buffer.dtype == torch.float32 and torch.equal(buffer, weights[name].float()), name
    for k in ("k", "v"):
        assert getattr(model.state, k).dtype == torch.float32
        assert torch.equal(getattr(model.state, k), state[k].float()), k
    for k in ("offset", "start_offset"):
        got = getattr(model.state, k)
        assert got.dtype == state[k].dtype and torch.equal(got, state[k])
    if cls in JAX_CLASSES:
        assert model.jax_state.k.dtype == jnp.float32
        assert_params_view_buffers(model)
    reference = make(cls, torch.float32)
    with torch.no_grad():
        for name, buffer in reference.weights().items():
            buffer.copy_(weights[name].float())
    reference.restore(snap)  # a bf16 snapshot widens exactly into the float32 stack
    assert_outputs_equal(run(model, inputs[4:]), run(reference, inputs[4:]))
    assert_state(model, state_of(reference))


@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_any_stack_dtype_before_streaming(cls):
    """Not streaming, every FLOAT_DTYPES cast converts the weights as asked (narrowing too: it is
    an explicit request), and a stream then runs as in a stack built with that dtype."""
    model = make(cls)
    weights = weights_of(model)
    model.half()
    assert all(torch.equal(w, weights[n].half()) for n, w in model.weights().items())
    model.bfloat16()  # f16 -> bf16, not streaming: allowed
    assert model.dtype == torch.bfloat16
    assert all(torch.equal(w, weights[n].half().bfloat16()) for n, w in model.weights().items())
    reference = cls.from_config(model.config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, buffer in reference.weights().items():
            buffer.copy_(model.weights()[name])
    inputs = frames(model, 4, seed=3)
    model.streaming_init(B)
    reference.streaming_init(B)
    assert model.state.k.dtype == torch.bfloat16
    assert_outputs_equal(run(model, inputs), run(reference, inputs))
    assert_state(model, state_of(reference))
    model.streaming_end()  # ends the stream: narrowing is allowed again
    assert model.state is None
    model.half()
    assert model.dtype == torch.float16


@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_device_moves_while_streaming(cls):
    """`.cpu()`, `.to("cpu")`, `.to(torch.device("cpu"))` mid-stream: the stream goes on bit for bit;
    the drop-ins' params still view the buffers. A torch stack moved to "meta" takes its state along."""
    model, twin = make(cls), make(cls)
    inputs = frames(model, 6, seed=4)
    model.streaming_init(B)
    twin.streaming_init(B)
    run(model, inputs[:3], recycle=True)
    run(twin, inputs[:3], recycle=True)
    model.cpu()
    model.to("cpu")
    model.to(torch.device("cpu"), non_blocking=True)
    assert model.device == torch.device("cpu")
    assert all(getattr(model.state, k).device.type == "cpu" for k in KEYS)
    if cls in JAX_CLASSES:
        assert_params_view_buffers(model)
        assert model.jax_state.k.devices() == {jax.devices("cpu")[0]}
    assert_outputs_equal(run(model, inputs[3:]), run(twin, inputs[3:]))
    if cls not in JAX_CLASSES:
        model.to("meta")
        assert model.device.type == "meta"
        assert all(getattr(model.state, k).device.type == "meta" for k in KEYS)
        assert model.state.offset.dtype == torch.long


@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_share_memory_while_streaming(cls):
    model, twin = make(cls), make(cls)
    inputs = frames(model, 6, seed=5)
    model.streaming_init(B)
    twin.streaming_init(B)
    run(model, inputs[:3])
    run(twin, inputs[:3])
    state = state_of(model)
    assert model.share_memory() is model
    assert all(w.is_shared() for w in model.weights().values())
    if cls in JAX_CLASSES:
        assert_params_view_buffers(model)  # moved to shared memory: the views were taken again
    else:
        assert all(getattr(model.state, k).is_shared() for k in KEYS)
    assert_state(model, state)
    assert_outputs_equal(run(model, inputs[3:]), run(twin, inputs[3:]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU-only machine)")
@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_cuda_round_trip_while_streaming(cls):
    """`.cuda()` then `.cpu()` mid-stream: the state goes along both ways, values kept exactly; on
    the GPU the moved stack steps as one built there and restored from the CPU snapshot."""
    model = make(cls)
    inputs = frames(model, 5, seed=6)
    model.streaming_init(B)
    run(model, inputs[:2])
    snap, state = model.snapshot(), state_of(model)
    model.cuda()
    assert model.device.type == "cuda" and all(w.is_cuda for w in model.weights().values())
    for k in KEYS:
        assert getattr(model.state, k).is_cuda and torch.equal(getattr(model.state, k).cpu(), state[k]), k
    if cls in JAX_CLASSES:
        assert model.jax_state.k.devices().pop().platform == "gpu"
        assert_params_view_buffers(model)
    reference = make(cls).cuda()
    reference.restore(snap)  # a CPU snapshot into a CUDA stack
    cuda_inputs = [(x.cuda(), a.cuda()) for x, a in inputs[2:4]]
    assert_outputs_equal(run(model, cuda_inputs), run(reference, cuda_inputs))
    model.cpu()
    assert model.device.type == "cpu"
    moved, expected = state_of(model), state_of(reference)
    for k in KEYS:
        assert moved[k].device.type == "cpu" and torch.equal(moved[k], expected[k].cpu()), k
    model.step(*inputs[4])


# ============================================================================ 2. snapshots
@pytest.mark.parametrize("via", ["memory", "file"])
@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_snapshot_restore_continues_bit_identically(cls, via, tmp_path):
    """Snapshot mid-run (rings wrapped, rows recycled), restore into a fresh object: every later
    output and the final state are bit-identical; the snapshot is a copy the stream does not touch."""
    model = make(cls)
    inputs = frames(model, 28, seed=7)
    model.streaming_init(B)
    run(model, inputs[:14], recycle=True)
    snap = model.snapshot()
    kept = {k: snap[k].clone() for k in KEYS}
    assert snap["metadata"]["batch_size"] == str(B)
    assert all(torch.equal(snap[k], getattr(model.state, k)) for k in KEYS)
    path = tmp_path / "stream.safetensors"
    if via == "file":
        model.save_stream(path)
    expected = run(model, inputs[14:], recycle=True)
    assert all(torch.equal(snap[k], kept[k]) for k in KEYS)  # the stream went on without touching it
    fresh = make(cls)
    if via == "file":
        fresh.load_stream(path)
    else:
        fresh.restore(snap)
    assert_state(fresh, kept)
    assert_outputs_equal(run(fresh, inputs[14:], recycle=True), expected)
    assert_state(fresh, state_of(model))
    assert all(torch.equal(snap[k], kept[k]) for k in KEYS)  # restore copied it (JAX donates its state)


@pytest.fixture(scope="module")
def tparams():
    return jx.init_params(TCFG, jax.random.key(0))


def test_streamer_snapshot_restore_and_overflow_bound(tparams, tmp_path):
    s = jx.Streamer(TCFG, tparams, B)
    xs = [jax.random.normal(jax.random.key(i), (B, 1, TCFG.dim)) for i in range(30)]
    for x in xs[:15]:
        s.step(x)
    s.reset_slot(1)
    snap = s.snapshot()
    s.save_stream(tmp_path / "s.safetensors")
    expected = [s.step(x) for x in xs[15:]]
    for restored in (jx.Streamer(TCFG, tparams, 1), jx.Streamer(TCFG, tparams, B)):
        if restored.batch_size == 1:
            restored.restore(snap, resize=True)
        else:
            restored.load_stream(tmp_path / "s.safetensors")
        assert restored.offset_bound == 15 and restored.batch_size == B
        for x, (out, logits) in zip(xs[15:], expected, strict=True):
            o, lg = restored.step(x)
            assert jnp.array_equal(o, out) and jnp.array_equal(lg, logits)
        for a, b in zip(restored.state, s.state, strict=True):
            assert jnp.array_equal(a, b)
    # the restored bound follows the restored offsets: offsets near 2**31 - 1 cannot wrap
    near = {**snap, "offset": jnp.array([INT32_MAX - 1, 3, 3], jnp.int32),
            "start_offset": jnp.array([INT32_MAX - 5, 0, 3], jnp.int32)}
    r = jx.Streamer(TCFG, tparams, B)
    r.restore(near)
    assert r.offset_bound == INT32_MAX - 1
    r.step(xs[0])
    assert np.asarray(r.state.offset).tolist() == [INT32_MAX, 4, 4]
    before = r.state
    with pytest.raises(OverflowError, match="2147483648 > 2147483647"):
        r.step(xs[1])
    assert r.state is before and not before.k.is_deleted()


def test_state_snapshot_functions(tparams):
    """The functional API: state_snapshot / state_from_snapshot round-trip a state exactly."""
    state = jx.init_state(TCFG, B)
    step = jx.make_step(TCFG)
    for i in range(5):
        _, state = step(tparams, state, jnp.full((B, 1, TCFG.dim), float(i)), None)
    snap = jx.state_snapshot(TCFG, state)
    _, state2 = step(tparams, state, jnp.ones((B, 1, TCFG.dim)), None)  # donates `state`
    assert state.k.is_deleted() and not snap["k"].is_deleted()
    restored = jx.state_from_snapshot(TCFG, snap)
    _, state3 = step(tparams, restored, jnp.ones((B, 1, TCFG.dim)), None)
    for a, b in zip(state2, state3, strict=True):
        assert jnp.array_equal(a, b)
    with pytest.raises(TypeError, match="expected a jax_impl.StreamState"):
        jx.state_snapshot(TCFG, dict(snap))


def bad_snapshots(good: dict, to_int):
    """(mutated snapshot, exception, pattern) for every validation of `restore`."""
    meta = good["metadata"]
    other = jx.snapshot.snapshot_metadata(with_options(TCFG, context=TCFG.context + 1), meta["dtype"], B)
    off = good["offset"]
    neg = to_int([-1] + [0] * (B - 1))
    return [
        ([1, 2], TypeError, "expected a snapshot dict"),
        ({k: v for k, v in good.items() if k != "v"}, ValueError, r"missing \['v'\]"),
        ({**good, "extra": off}, ValueError, r"unexpected \['extra'\]"),
        ({**good, "k": good["k"][:, :2]}, ValueError, r"snapshot\['k'\] has shape"),
        ({**good, "offset": good["offset"][:2]}, ValueError, r"snapshot\['offset'\] has shape"),
        ({**good, "metadata": other}, ValueError, r"config.*context: snapshot 25, stack 24"),
        ({**good, "metadata": {**meta, "stack": "MimiConfig"}}, ValueError, "another stack"),
        ({**good, "metadata": {**meta, "dtype": "float16"}}, ValueError, r"\['dtype'\] is 'float16'"),
        ({**good, "metadata": {**meta, "batch_size": "3.0"}}, ValueError, "batch_size"),
        ({**good, "metadata": {**meta, "format": "x"}}, ValueError, "format"),
        ({**good, "metadata": {}}, ValueError, "not a stream snapshot"),
        ({**good, "offset": neg, "start_offset": neg}, ValueError, r"snapshot\['offset'\]\[0\] = -1"),
        ({**good, "start_offset": neg}, ValueError, r"snapshot\['start_offset'\]\[0\] = -1 is out of range"),
        ({**good, "offset": good["k"][0, :, 0, 0, 0]}, TypeError, r"snapshot\['offset'\] has dtype float32"),
        ({**good, "k": "nope"}, TypeError, r"snapshot\['k'\] must be an array"),
    ]


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("cls", [TemporalStreaming, JaxTemporalStreaming], ids=lambda c: c.__name__)
def test_restore_refuses_bad_snapshots_and_changes_nothing(cls, streaming):
    source = make(cls)
    with pytest.raises(RuntimeError, match=r"snapshot\(\) called before streaming_init"):
        source.snapshot()
    source.streaming_init(B)
    run(source, frames(source, 7, seed=8))
    good = source.snapshot()
    # row 0 has forgotten everything: start_offset == offset
    good["start_offset"] = torch.where(torch.arange(B) == 0, good["offset"], good["start_offset"])
    to_int = lambda v: torch.tensor(v, dtype=good["offset"].dtype)
    cases = bad_snapshots(good, to_int)
    narrow = make(cls, torch.bfloat16)  # a float32 snapshot into a bf16 stack: would round
    cases_narrow = [(good, TypeError, r"hold float32; this stack holds bfloat16.*would round")]
    if cls in JAX_CLASSES:  # int64 offsets past JAX's int32: refused, not wrapped
        big = torch.tensor([2**31, 0, 0], dtype=torch.long)
        cases.append(({**good, "offset": big, "start_offset": big}, ValueError,
                      r"\['offset'\]\[0\] = 2147483648"))
    for target, target_cases in ((make(cls), cases), (narrow, cases_narrow)):
        if streaming:
            target.streaming_init(B)
            run(target, frames(target, 2, seed=9))
            before = state_of(target)
        for bad, exc, pattern in target_cases:
            with pytest.raises(exc, match=pattern):
                target.restore(bad)
            if streaming:
                assert_state(target, before)
            else:
                assert target.state is None
    target = make(cls)
    target.restore(good)  # the good one restores
    assert_state(target, {k: good[k] for k in KEYS})


def test_streamer_restore_refuses_bad_snapshots_and_changes_nothing(tparams):
    s = jx.Streamer(TCFG, tparams, B)
    for i in range(7):
        s.step(jnp.full((B, 1, TCFG.dim), 0.1 * i))
    good = s.snapshot()
    good["start_offset"] = good["start_offset"].at[0].set(7)
    r = jx.Streamer(TCFG, tparams, B)
    r.step(jnp.ones((B, 1, TCFG.dim)))
    before, bound = jax.tree_util.tree_map(jnp.copy, r.state), r.offset_bound
    cases = bad_snapshots(good, lambda v: jnp.array(v, jnp.int32))
    cases.append(({**good, "offset": np.full(B, 2**31, np.int64), "start_offset": np.zeros(B, np.int64)},
                  ValueError, r"\['offset'\]\[0\] = 2147483648 is out of range"))
    for bad, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            r.restore(bad)
        assert r.offset_bound == bound
        for a, b in zip(r.state, before, strict=True):
            assert jnp.array_equal(a, b)
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tparams)
    bf16 = jx.Streamer(TCFG, p16, B, jnp.bfloat16)
    with pytest.raises(TypeError, match="would round"):
        bf16.restore(good)
    r.restore(good)
    assert np.asarray(r.state.start_offset).tolist() == [7, 0, 0]


RESIZE_REFUSED = (r"^(restore\(snapshot\)|load_stream\(.*/s\.safetensors\)): the snapshot holds 2 rows \(batch_size "
                  r"2\), this stream 3; nothing was changed\. With resize=True the snapshot's 2 rows replace the stream")


@pytest.mark.parametrize("cls", [TemporalStreaming, JaxTemporalStreaming], ids=lambda c: c.__name__)
def test_restore_of_another_batch_size_only_when_asked(cls, tmp_path):
    """A snapshot (or file) of 2 rows into a stack streaming 3 is refused, naming both sizes and
    resize=True, with the stream unchanged; `resize=True` takes it (the stack then streams 2 rows);
    before `streaming_init` there is no batch size to keep and the snapshot gives it."""
    source = make(cls)
    source.streaming_init(2)
    for i in range(3):
        source.step(torch.full((2, 1, TCFG.dim), 0.25 * i))
    snap = source.snapshot()
    source.save_stream(tmp_path / "s.safetensors")
    target = make(cls)
    target.streaming_init(B)
    run(target, frames(target, 4, seed=3))
    before = state_of(target)
    for restore in (lambda: target.restore(snap), lambda: target.load_stream(tmp_path / "s.safetensors")):
        with pytest.raises(ValueError, match=RESIZE_REFUSED):
            restore()
        assert_state(target, before)
    with pytest.raises(TypeError, match=r"restore\(snapshot\): resize must be a bool, got int"):
        target.restore(snap, resize=1)
    assert_state(target, before)
    for restore in (lambda: target.restore(snap, resize=True),
                    lambda: target.load_stream(tmp_path / "s.safetensors", resize=True)):
        target.streaming_init(B)
        restore()
        assert_state(target, {k: snap[k] for k in KEYS})
        assert first(target.step(torch.ones(2, 1, TCFG.dim))).shape == (2, 1, TCFG.dim)
    fresh = make(cls)  # not streaming: any batch size
    fresh.restore(snap)
    assert_state(fresh, {k: snap[k] for k in KEYS})


def test_streamer_restore_of_another_batch_size_only_when_asked(tparams, tmp_path):
    """`jx.Streamer`: the same rule (refused with the state and the overflow bound unchanged; taken
    with resize=True, the bound then the restored offsets')."""
    small = jx.Streamer(TCFG, tparams, 2)
    for _ in range(5):
        small.step(jnp.ones((2, 1, TCFG.dim)))
    snap = small.snapshot()
    small.save_stream(tmp_path / "s.safetensors")
    s = jx.Streamer(TCFG, tparams, B)
    s.step(jnp.ones((B, 1, TCFG.dim)))
    before, bound = jax.tree_util.tree_map(jnp.copy, s.state), s.offset_bound
    for restore in (lambda: s.restore(snap), lambda: s.load_stream(tmp_path / "s.safetensors")):
        with pytest.raises(ValueError, match=RESIZE_REFUSED):
            restore()
        assert s.offset_bound == bound and s.batch_size == B
        for a, b in zip(s.state, before, strict=True):
            assert jnp.array_equal(a, b)
    for restore in (lambda: s.restore(snap, resize=True),
                    lambda: s.load_stream(tmp_path / "s.safetensors", resize=True)):
        restore()
        assert s.batch_size == 2 and s.offset_bound == 5
        for a, b in zip(s.state, small.state, strict=True):
            assert jnp.array_equal(a, b)


@pytest.mark.parametrize("name", ["temporal", "mimi"])
def test_snapshots_cross_between_the_torch_path_and_the_drop_in(name, tmp_path):
    """torch -> drop-in (memory) and drop-in -> torch (file): the restored state is the snapshot
    exactly; the continuations agree as the two paths do (float tolerance, integers exact)."""
    torch_cls, jax_cls = ((TemporalStreaming, JaxTemporalStreaming) if name == "temporal"
                          else (MimiTransformer, JaxMimiTransformer))
    for src_cls, dst_cls in ((torch_cls, jax_cls), (jax_cls, torch_cls)):
        src, dst = make(src_cls), make(dst_cls)
        inputs = frames(src, 20, seed=10)
        src.streaming_init(B)
        run(src, inputs[:10], recycle=True)
        snap = src.snapshot()
        if dst_cls is torch_cls:
            src.save_stream(tmp_path / "s.safetensors")
            dst.load_stream(tmp_path / "s.safetensors")
        else:
            dst.restore(snap)
        for k in KEYS:
            assert torch.equal(getattr(dst.state, k).long() if "offset" in k else getattr(dst.state, k),
                               snap[k].long() if "offset" in k else snap[k]), k
        out_src, out_dst = run(src, inputs[10:], recycle=True), run(dst, inputs[10:], recycle=True)
        for a, b in zip(out_src, out_dst, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for k in ("offset", "start_offset"):
            assert torch.equal(getattr(src.state, k).long(), getattr(dst.state, k).long())


def test_a_streamer_file_restores_on_the_torch_path(tparams, tmp_path):
    s = jx.Streamer(TCFG, tparams, B)
    for i in range(9):
        s.step(jax.random.normal(jax.random.key(i), (B, 1, TCFG.dim)))
    s.save_stream(tmp_path / "s.safetensors")
    model = TemporalStreaming.from_config(TCFG)
    model.load_stream(tmp_path / "s.safetensors")
    assert torch.equal(model.state.k, torch.from_numpy(np.array(s.state.k)))
    assert model.state.offset.tolist() == [9, 9, 9] and model.state.offset.dtype == torch.long
    with pytest.raises(ValueError, match="missing.safetensors is not a readable stream file"):
        model.load_stream(tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match=r"restore\(snapshot\): rings of float64 \(snapshot\['k'\]\) need "
                                        r"jax_enable_x64"):  # without x64, JAX would round them to float32
        snap = model.snapshot()
        jx.state_from_snapshot(TCFG, {**snap, "k": np.asarray(s.state.k, np.float64),
                                      "v": np.asarray(s.state.v, np.float64),
                                      "metadata": {**snap["metadata"], "dtype": "float64"}})


def test_writing_a_stream_file_where_it_cannot_go_names_the_path(tparams, tmp_path):
    """A missing directory or a directory at the path: one ValueError naming the target path (the
    type reading raises), from the torch stack, the Streamer and write_stream; nothing written."""
    s = jx.Streamer(TCFG, tparams, B)
    model = TemporalStreaming.from_config(TCFG)
    model.streaming_init(B)
    missing = tmp_path / "no" / "such" / "s.safetensors"
    writers = (model.save_stream, s.save_stream, lambda path: jx.write_stream(TCFG, s.state, path))
    for write in writers:
        with pytest.raises(ValueError, match=rf"cannot write the stream file {re.escape(str(missing))}: the "
                                             rf"directory {re.escape(str(missing.parent))} does not exist"):
            write(missing)
        with pytest.raises(ValueError, match=rf"cannot write the stream file {re.escape(str(tmp_path))}: "):
            write(tmp_path)
    assert not (tmp_path / "no").exists() and not list(tmp_path.iterdir())


# ============================================================================ 3. drop-in reset_rows masks
def test_drop_in_reset_rows_takes_every_mask_the_torch_path_takes():
    masks = [
        torch.from_numpy(np.array([True, False, True])),
        torch.tensor([False, False, True, False, False, True])[::2],  # non-contiguous: [F, T, F]
        torch.tensor([False, True, False, True])[1:],  # offset view: [T, F, T]
        torch.tensor([[True, False], [False, True], [True, True]])[:, 1],  # a column: [F, T, T]
    ]
    assert not masks[1].is_contiguous() and masks[2].storage_offset() == 1
    ref, drop_in = make(TemporalStreaming), make(JaxTemporalStreaming)
    inputs = frames(ref, 2 * len(masks), seed=11)
    for model in (ref, drop_in):
        model.streaming_init(B)
    for i, mask in enumerate(masks):
        for model in (ref, drop_in):
            run(model, inputs[2 * i:2 * i + 2])
            model.reset_rows(mask)
        assert torch.equal(drop_in.state.offset.long(), ref.state.offset)
        assert torch.equal(drop_in.state.start_offset.long(), ref.state.start_offset)
    assert ref.state.offset.tolist() == [2, 0, 0]  # the last mask resets rows 1, 2


# ============================================================================ 4. to_torch of a dead array
def test_to_torch_of_a_deleted_or_donated_array_says_so():
    a = jnp.arange(4.0)
    a.delete()
    with pytest.raises(ValueError, match=r"to_torch\(array\): the array has been deleted or donated"):
        to_torch(a)
    b = jnp.arange(4.0)
    c = jax.jit(lambda x: x + 1, donate_argnums=0)(b)
    assert b.is_deleted()
    with pytest.raises(ValueError, match="use the array the call returned"):
        to_torch(b)
    assert to_torch(c).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_to_jax_refuses_a_device_jax_does_not_have():
    with pytest.raises(ValueError, match=r"tensor is on meta; JAX takes CPU and CUDA tensors"):
        to_jax(torch.empty(2, device="meta"))  # on a GPU host too (it was mapped to the GPU)


# ============================================================================ 5. x's dtype rule, check_headroom
@pytest.mark.parametrize("cls", CLASSES, ids=ids)
def test_step_widens_x_exactly_and_refuses_narrowing(cls):
    model, twin = make(cls), make(cls)
    narrow = make(cls, torch.bfloat16)
    for m in (model, twin, narrow):
        m.streaming_init(B)
    inputs = frames(model, 4, seed=12)
    for (x, active), dtype in zip(inputs, [torch.bfloat16, torch.float16] * 2, strict=True):
        x = x.to(dtype)  # bf16 / f16 x into a float32 stack: cast exactly
        assert torch.equal(first(model.step(x, active)), first(twin.step(x.float(), active)))
    assert_state(model, state_of(twin))
    before = state_of(narrow)
    x = inputs[0][0]
    with pytest.raises(TypeError, match=r"step\(x\): x has dtype torch.float32; the stack holds "
                                        r"torch.bfloat16\. Only an exact cast.*x.to\(torch.bfloat16\)"):
        narrow.step(x)
    with pytest.raises(TypeError, match=r"torch.float16 -> torch.bfloat16 would round x"):
        narrow.step(x.half())
    with pytest.raises(TypeError, match=r"x has dtype torch.int32"):
        narrow.step(x.int())
    assert_state(narrow, before)


def test_jax_step_widens_x_exactly_and_refuses_narrowing(tparams):
    step = jx.step_fn(TCFG)
    state = jx.init_state(TCFG, B)
    x = jax.random.normal(jax.random.key(3), (B, 1, TCFG.dim)).astype(jnp.bfloat16)
    (out_b, lg_b), s_b = step(tparams, state, x, None)
    (out_f, lg_f), s_f = step(tparams, state, x.astype(jnp.float32), None)
    assert out_b.dtype == jnp.float32
    assert jnp.array_equal(out_b, out_f) and jnp.array_equal(lg_b, lg_f) and jnp.array_equal(s_b.k, s_f.k)
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tparams)
    s16 = jx.init_state(TCFG, B, jnp.bfloat16)
    with pytest.raises(TypeError, match=r"step\(x\): x has dtype float32; the stack's state holds bfloat16\. "
                                        r"Only an exact cast.*x.astype\(jnp.bfloat16\)"):
        step(p16, s16, x.astype(jnp.float32), None)
    with pytest.raises(TypeError, match="float16 -> bfloat16 would round x"):
        jax.jit(step)(p16, s16, x.astype(jnp.float16), None)


def test_jitted_steps_refuse_a_float64_x_that_jit_would_narrow(tparams):
    """jit narrows a numpy float64 x to float32 (x64 off) before the step's own check sees it: make_step
    and the Streamer check x on the host first and refuse that rounding (the state not donated); an
    exact cast (bfloat16 x into a float32 stack) still steps, with the bits of the float32 x."""
    step = jx.make_step(TCFG)
    x = np.asarray(jax.random.normal(jax.random.key(4), (B, 1, TCFG.dim)), np.float64)
    state = jx.init_state(TCFG, B)
    streamer = jx.Streamer(TCFG, tparams, B)
    for run in (lambda: step(tparams, state, x), lambda: step.lower(tparams, state, x),
                lambda: streamer.step(x)):
        with pytest.raises(TypeError, match=r"step\(x\): x has dtype float64; the stack's state holds float32\. "
                                            r"Only an exact cast.*float64 -> float32 would round x"):
            run()
    assert not state.k.is_deleted() and streamer.offset_bound == 0
    x16 = x.astype(jnp.bfloat16)
    (out_b, _), _ = step(tparams, jx.init_state(TCFG, B), x16)
    (out_f, _), _ = step(tparams, jx.init_state(TCFG, B), x16.astype(np.float32))
    assert jnp.array_equal(out_b, out_f)


def test_check_headroom_takes_a_state_or_a_bound():
    state = jx.init_state(TCFG, 2)
    jx.check_headroom(state, TCFG.capacity)
    near = state._replace(offset=jnp.array([INT32_MAX - 1, 0], jnp.int32))
    jx.check_headroom(near, 1)
    with pytest.raises(OverflowError, match="2147483648 > 2147483647"):
        jx.check_headroom(near, 2)
    jx.check_headroom(INT32_MAX - 1, 1, jnp.int32)
    with pytest.raises(OverflowError):
        jx.check_headroom(INT32_MAX - 1, 2, jnp.int32)
    with pytest.raises(TypeError, match=r"check_headroom\(state_or_bound\): expected a jax_impl.StreamState"):
        jx.check_headroom(near.offset, 1)
    with pytest.raises(ValueError, match=r"check_headroom\(T\)"):
        jx.check_headroom(state, -1)
    assert np.asarray(near.offset).tolist() == [INT32_MAX - 1, 0]  # read, not touched


def test_loop_options_are_checked_when_a_stepper_is_made():
    """A bad layer_loop is refused where the step or the drop-in is made, not at its first step."""
    for make_it in (lambda: JaxTemporalStreaming.from_config(TCFG, layer_loop="bogus"),
                    lambda: jx.make_step(TCFG, layer_loop=None), lambda: jx.step_fn(MCFG, scan_unroll=0)):
        with pytest.raises(ValueError, match="layer_loop must be one of|scan_unroll must be a positive int"):
            make_it()
