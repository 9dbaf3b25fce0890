"""Reliability of slot recycling: the sacrifice tick, rows with nothing visible,
session isolation, and the argument checks of the jitted recycle ops.

Oracles. The `moshi` package has `reset_streaming(mask)` (our `reset_rows`) but no
start_offset: `reset_slot` / `bump_slot_start` cannot be expressed in it, so for those the torch
path (bit-exact with moshi where both apply, tests/test_torch_vs_moshi.py) is the oracle of the
JAX path (float32, ~1e-7 apart from matmul summation order: checked to rtol 1e-5, normwise).
Isolation is checked bit for bit within each path: a new session after a poisoned old one
(NaN / +-Inf frames, or NaN / Inf written straight into the rings) must give exactly the
outputs it gives after a finite old session, and after `reset_rows` exactly those of a fresh
stream; torch's `reset_rows` with its ring clearing stays bit-identical to moshi's on finite data.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl.config import PRESETS, with_options
from jax_impl.ops import masked_attention
from kernels_pallas.ring_attention import ring_attention, ring_attention_native
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.crosscheck import crosscheck, layer_tables
from torch_bridge.jax_steppers import from_torch

from .moshi_oracle import moshi_stack

B = 3
FRAMES = {"temporal": 1, "mimi": 2}
PATHS = ["torch", "jax", "dropin", "pallas"]
TWINS = ["torch_twin", "jax_twin"]  # the twin kernels (Triton / Pallas, interpreted on the CPU)
TORCH_SIDE = ("torch", "dropin", "torch_twin")


def config(kind, convention="personaplex"):
    return with_options(PRESETS[f"{kind}-small"], ring_convention=convention)


def torch_stack(cfg, seed=0, kernels="reference"):
    cls = TemporalStreaming if kind_of(cfg) == "temporal" else MimiTransformer
    stack = cls.from_config(cfg, kernels=kernels)
    stack.init_weights(generator=torch.Generator().manual_seed(seed))
    return stack


def kind_of(cfg) -> str:
    return "temporal" if hasattr(cfg, "text_card") else "mimi"


class Runner:
    """One path behind one interface: step(x np [B, T, dim], active np [B]) -> tuple of np outputs.

    "torch": the torch stack; "jax": the jitted JAX step (XLA attention) with the `jit_*` recycle
    ops; "pallas": the same with the Pallas RoPE + ring attention (interpreted on the CPU);
    "dropin": the JAX-backed torch drop-in on the torch stack's buffers; "torch_twin" / "jax_twin":
    the twin kernels of either side. Same weights everywhere.
    """

    def __init__(self, path: str, cfg, batch: int = B):
        self.path, self.cfg = path, cfg
        self.module = torch_stack(cfg, kernels="twin" if path == "torch_twin" else "reference")
        if path == "dropin":
            self.module = from_torch(self.module)
        if path in TORCH_SIDE:
            self.module.streaming_init(batch)
        else:
            self.params = jx.params_from_stacked(cfg, self.module.weights())
            # committed to the device, as the step's output state is: an uncommitted first state would
            # compile the step a second time at the second step
            self.state = jax.device_put(jx.init_state(cfg, batch), jax.devices()[0])
            kernels = {"pallas": "pallas", "jax_twin": "twin"}.get(path, "reference")
            self._step = jx.make_step(cfg, layer_loop="python", kernels=kernels)

    def step(self, x: np.ndarray, active: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        active = np.ones(x.shape[0], bool) if active is None else active
        if self.path in TORCH_SIDE:
            out = self.module.step(torch.from_numpy(x), torch.from_numpy(active))
        else:
            out, self.state = self._step(self.params, self.state, jnp.asarray(x), jnp.asarray(active))
        outs = out if isinstance(out, tuple) else (out,)
        return tuple(o.numpy().copy() if isinstance(o, torch.Tensor) else np.asarray(o) for o in outs)

    def reset_slot(self, b):
        if self.path in TORCH_SIDE:
            self.module.reset_slot(b)
        else:
            self.state = jx.jit_reset_slot(self.state, b)

    def bump_slot_start(self, b):
        if self.path in TORCH_SIDE:
            self.module.bump_slot_start(b)
        else:
            self.state = jx.jit_bump_slot_start(self.state, b)

    def reset_rows(self, mask: np.ndarray):
        if self.path in TORCH_SIDE:
            self.module.reset_rows(torch.from_numpy(mask))
        else:
            self.state = jx.jit_reset_rows(self.state, mask)

    def offsets(self) -> tuple[list[int], list[int]]:
        s = self.module.state if self.path in TORCH_SIDE else self.state
        return [int(o) for o in s.offset], [int(o) for o in s.start_offset]

    def poison_ring(self, b: int):
        """Row b's rings: k all +Inf, v all NaN (what an old session may have left in them)."""
        if self.path in ("torch", "torch_twin"):
            self.module.state.k[:, b] = float("inf")
            self.module.state.v[:, b] = float("nan")
            return
        holder = self.module._streamer if self.path == "dropin" else self
        s = holder.state
        holder.state = s._replace(k=s.k.at[:, b].set(jnp.inf), v=s.v.at[:, b].set(jnp.nan))


def frames(rng, cfg, n=B):
    return rng.standard_normal((n, FRAMES[kind_of(cfg)], cfg.dim)).astype(np.float32)


def normwise_rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


# ------------------------------------------------------------------------------ 1. the sacrifice tick
@pytest.mark.parametrize("path", PATHS[:3])
def test_bump_slot_start_is_a_plain_increment(path):
    """bump_slot_start(b) is start_offset[b] += 1 on every path, past offset[b] too: no refusal,
    no saturation (the torch path and the drop-in refused, the jitted op saturated at offset)."""
    run = Runner(path, config("mimi"))
    rng = np.random.default_rng(0)
    for _ in range(3):
        run.step(frames(rng, run.cfg))
    run.reset_slot(1)
    run.bump_slot_start(1)  # start_offset == offset before it: the sacrifice tick
    run.bump_slot_start(1)
    run.bump_slot_start(2)
    offset, start = run.offsets()
    assert offset == [6, 6, 6] and start == [0, 8, 1]


def test_pure_and_traced_bump_do_not_saturate():
    s = jx.init_state(config("temporal"), 2)._replace(offset=jnp.array([4, 4], jnp.int32),
                                                       start_offset=jnp.array([4, 9], jnp.int32))
    np.testing.assert_array_equal(jx.bump_slot_start(s, 0).start_offset, [5, 9])  # concrete, un-jitted
    np.testing.assert_array_equal(jax.jit(jx.bump_slot_start)(s, jnp.int32(1)).start_offset, [4, 10])  # traced
    np.testing.assert_array_equal(jx.jit_bump_slot_start(s, 0).start_offset, [5, 9])
    assert not hasattr(jx.state, "check_can_bump")


def test_check_headroom_covers_a_bump():
    """The pure bump reads no values (as the pure step); the caller's check, check_headroom(state, 1),
    also looks at the start_offsets: one at the largest position is refused, though no offset is."""
    top = jx.state.index_max()
    s = jx.init_state(config("temporal"), 2)._replace(offset=jnp.array([top - 1, 0], jnp.int32),
                                                       start_offset=jnp.array([top - 1, 0], jnp.int32))
    jx.check_headroom(s, 1)
    s = jx.jit_bump_slot_start(s, 0)
    with pytest.raises(OverflowError, match="2147483648 > 2147483647"):
        jx.check_headroom(s, 1)
    assert np.asarray(s.start_offset).tolist() == [top, 0]


LIMITS = {"jax": jx.state.index_max(), "torch": torch.iinfo(torch.long).max, "dropin": jx.state.index_max()}


class Stepper:
    """`jx.Streamer`, a torch stack or a drop-in behind one interface (recycle ops, snapshot, restore)."""

    def __init__(self, path: str, cfg, batch: int = 2):
        self.path = path
        if path == "jax":
            self.module = jx.Streamer(cfg, jx.init_params(cfg, jax.random.key(0)), batch)
        else:
            self.module = torch_stack(cfg) if path == "torch" else from_torch(torch_stack(cfg))
            self.module.streaming_init(batch)

    def arrays(self) -> dict[str, np.ndarray]:
        snap = self.module.snapshot()
        return {k: np.asarray(v) for k, v in snap.items() if k != "metadata"}

    def restore_offsets(self, offset, start_offset):
        snap = self.module.snapshot()
        ints = (lambda a: torch.tensor(a)) if self.path == "torch" else (lambda a: np.array(a, np.int32))
        self.module.restore({**snap, "offset": ints(offset), "start_offset": ints(start_offset)})


@pytest.mark.parametrize("path", ["jax", "torch", "dropin"])
def test_a_bump_past_the_largest_position_is_refused(path):
    """bump_slot_start took start_offset past the offsets' largest value: int32 wrapped to -2**31 on the
    JAX side, which the torch stack's int64 did not do. Every stepper refuses it, naming the row, with
    the state unchanged; the other rows (and the row once reset) still bump."""
    top = LIMITS[path]
    run = Stepper(path, config("temporal"))
    run.restore_offsets([top, 5], [top - 1, 5])
    run.module.bump_slot_start(0)  # to the largest position: taken
    before = run.arrays()
    assert before["start_offset"].tolist() == [top, 5]
    with pytest.raises(OverflowError, match=rf"^bump_slot_start\(b\): row 0's start_offset is {top}, the largest "
                                            rf"int(32|64) position: one more would wrap \(refused, nothing changed\)"):
        run.module.bump_slot_start(0)
    after = run.arrays()
    assert all(np.array_equal(after[k], before[k]) for k in before)
    run.module.bump_slot_start(1)
    run.module.reset_rows(torch.tensor([True, False]) if path != "jax" else np.array([True, False]))
    run.module.bump_slot_start(0)
    assert run.arrays()["start_offset"].tolist() == [1, 6]


def test_streamer_bump_guard_reads_nothing_far_from_the_limit(monkeypatch):
    """The guard is the step's: host bounds, a device read only near the largest position."""
    run = Stepper("jax", config("temporal"))
    monkeypatch.setattr(run.module, "_read_offsets", lambda: pytest.fail("read the offsets far from the limit"))
    for _ in range(3):
        run.module.step(np.zeros((2, 1, run.module.config.dim), np.float32))
    run.module.reset_slot(1)
    run.module.bump_slot_start(1)
    run.module.bump_slot_start(1)
    assert run.arrays()["start_offset"].tolist() == [0, 5]
    assert run.module.offset_bound == 3 and run.module.start_bound == 5


def test_sacrifice_tick_through_crosscheck(monkeypatch):
    """The cross-check's random schedule includes reset_slot + bump_slot_start pairs (the torch
    stack refused the bump before); both paths stay exact on integers and close on floats."""
    ticks, bump = [], jx.jit_bump_slot_start

    def counted(state, b):
        state = bump(state, b)
        ticks.append(int(state.start_offset[int(b)]) > int(state.offset[int(b)]))
        return state

    monkeypatch.setattr(jx, "jit_bump_slot_start", counted)
    report = crosscheck("temporal", steps=150, batch=4, seed=0)
    assert sum(ticks) >= 3, ticks
    report.require(identical=("positions", "mask", "offset", "start_offset", "write_index"),
                   max_rel={"out": 1e-5, "text_logits": 1e-5})


# ------------------------------------------------------------------------------ 2. nothing visible
# each stack and convention once (the temporal stack's personaplex sacrifice ticks: also
# test_sacrifice_tick_through_crosscheck's, through the cross-check)
@pytest.mark.parametrize("kind,convention", [("temporal", "moshi"), ("mimi", "personaplex")])
def test_stream_with_sacrifice_ticks_jax_matches_torch(kind, convention):
    """Random reset_slot + bump_slot_start pairs (1 to T+1 bumps): the JAX paths follow the
    torch path (the oracle) step for step; before, the JAX bump saturated at offset, so the
    spurious write stayed visible there and the outputs parted (greedy tokens too)."""
    cfg = config(kind, convention)
    T = FRAMES[kind]
    runs = {p: Runner(p, cfg) for p in PATHS}
    rng = np.random.default_rng(5)
    blind = 0  # active rows that saw nothing at all in a step
    for i in range(50):
        if rng.random() < 0.2:
            b = int(rng.integers(B))
            bumps = int(rng.integers(1, T + 2))
            for run in runs.values():
                run.reset_slot(b)
                for _ in range(bumps):
                    run.bump_slot_start(b)
        x = frames(rng, cfg)
        active = rng.random(B) < 0.8
        with layer_tables(runs["torch"].module) as seen:
            ref = runs["torch"].step(x, active)
        blind += int((~seen[0].mask[torch.from_numpy(active)].any(dim=(1, 2, 3))).sum())
        assert all(np.isfinite(r).all() for r in ref), i
        for name, run in runs.items():
            if name == "torch":
                continue
            got = run.step(x, active)
            assert run.offsets() == runs["torch"].offsets(), (name, i)
            for g, r in zip(got, ref):
                assert np.isfinite(g).all() and normwise_rel(g, r) <= 1e-5, (name, i, normwise_rel(g, r))
            if kind == "temporal":
                assert np.array_equal(got[1].argmax(-1), ref[1].argmax(-1)), (name, i)
    assert blind >= 3, "the schedule must step rows that see nothing"


@pytest.mark.parametrize("kind", ["temporal", "mimi"])
def test_row_that_sees_nothing_gets_zero_attention(kind):
    """After reset_slot + bump_slot_start (T bumps), the next step of the row sees no slot: its
    attention is the zero SDPA gives an all-False row, so its output is bit-identical to that of
    a row that never wrote (offset 0, inactive) fed the same frames, on each path; the hidden
    write is not stored (the row's rings stay zero), and the row's next steps are unharmed."""
    cfg = config(kind)
    T = FRAMES[kind]
    rng = np.random.default_rng(1)
    history = [frames(rng, cfg) for _ in range(2)]
    tick, later = frames(rng, cfg), [frames(rng, cfg) for _ in range(2)]
    for path in PATHS + (TWINS if kind == "temporal" else []):  # twins: one stack (interpreted Triton is slow)
        run, fresh = Runner(path, cfg), Runner(path, cfg)
        for x in history:
            run.step(x)
        run.reset_slot(0)
        for _ in range(T):
            run.bump_slot_start(0)
        got = run.step(tick)
        never = fresh.step(tick, np.array([False, True, True]))  # row 0: offset 0, never wrote
        for g, n in zip(got, never):
            assert np.array_equal(g[0], n[0]), path
            assert np.isfinite(g).all(), path
        state = run.module.state if path in TORCH_SIDE else run.state
        assert not np.asarray(state.k)[:, 0].any() and not np.asarray(state.v)[:, 0].any(), path
        if path == "torch":
            ref_later = [run.step(x) for x in later]
        else:
            for x, ref in zip(later, ref_later):
                for g, r in zip(run.step(x), ref):
                    assert normwise_rel(g, r) <= 1e-5, path


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_of_a_query_that_sees_nothing_is_plus_zero(dtype):
    """XLA attention, the Pallas kernel (interpreted) and its reference: a query with no visible
    slot gets exactly +0 (torch's SDPA value, no sign bit), whatever the masked slots hold."""
    Bq, H, T, C, D = 2, 2, 2, 8, 16
    rng = np.random.default_rng(0)  # numpy inputs and one jitted call each: no per-op compiles
    q = rng.standard_normal((Bq, H, T, D), np.float32)
    k = rng.standard_normal((1, Bq, H, C, D), np.float32)
    v = -np.abs(rng.standard_normal((1, Bq, H, C, D), np.float32))  # negative: 0 * v = -0
    k[0, 0, :, 3] = np.inf
    v[0, 0, :, 5] = np.nan
    q, k, v = (jnp.asarray(a.astype(dtype)) for a in (q, k, v))
    positions = np.array([np.full(C, -1), np.arange(C)], np.int32)  # row 0 sees nothing
    q_pos = np.array([[C, C + 1], [C, C + 1]], np.int32)
    mask = (positions[:, None, None, :] >= 0) & (q_pos[:, None, :, None] >= positions[:, None, None, :])
    outs = {"xla": jax.jit(masked_attention)(q, k[0], v[0], mask),
            "pallas": jax.jit(partial(ring_attention, context=C + 4, block_c=4, splits=2))(
                q, k, v, 0, positions, q_pos),
            "native": jax.jit(partial(ring_attention_native, context=C + 4))(q, k, v, 0, positions, q_pos)}
    for name, out in outs.items():
        o = np.asarray(out.astype(jnp.float32))
        assert np.array_equal(o[0], np.zeros_like(o[0])) and not np.signbit(o[0]).any(), name
        assert np.isfinite(o[1]).all() and np.abs(o[1]).max() > 0, name


# ------------------------------------------------------------------------------ 3. session isolation
POISON = {2: np.nan, 3: np.inf, 4: -np.inf}  # old-session steps at which row 1 is fed NaN / +Inf / -Inf


def isolation_run(path, cfg, recycle, poison, steps=6):
    """Old session (`steps` steps), recycle row 1, new session (`steps` steps); returns the new
    session's outputs.

    poison: None (finite old session), "frames" (row 1 fed NaN / +-Inf frames, and the tick frame
    NaN) or "ring" (row 1's rings overwritten with +Inf keys and NaN values before the recycle).
    """
    T = FRAMES[kind_of(cfg)]
    run = Runner(path, cfg)
    rng = np.random.default_rng(2)
    for i in range(steps):
        x = frames(rng, cfg)
        if poison == "frames" and i in POISON:
            x[1] = POISON[i]
        run.step(x)
    if poison == "ring":
        run.poison_ring(1)
    if recycle == "reset_rows":
        run.reset_rows(np.array([False, True, False]))
    else:
        run.reset_slot(1)
    if recycle == "tick":  # the one spurious frame after a recycle, hidden by the bumps
        for _ in range(T):
            run.bump_slot_start(1)
        x = frames(rng, cfg)
        if poison:
            x[1] = np.nan
        run.step(x)
    return [run.step(frames(rng, cfg)) for _ in range(steps)]


@pytest.mark.parametrize("path,kind", [(p, k) for p in PATHS for k in ("temporal", "mimi")]
                         + [(p, "temporal") for p in TWINS])  # the twins: one stack (interpreted Triton is slow)
def test_recycled_row_carries_nothing_of_its_old_session(path, kind):
    """Before: NaN in the new session's first ~5 outputs (a masked weight 0 times an old NaN is
    NaN), on torch, JAX, the drop-in and the Pallas kernel, both stacks (the twin kernels too)."""
    cfg = config(kind)
    twin = path in TWINS  # interpreted Triton is slow: the one case that exercises both mechanisms,
    steps = 2 if twin else 6  # over 2 steps a session each (a poisoned ring shows at the first new step)
    for recycle in ("tick",) if twin else ("reset_rows", "reset_slot", "tick"):
        clean = isolation_run(path, cfg, recycle, None, steps)
        for poison in ("ring",) if twin else ("frames", "ring"):
            dirty = isolation_run(path, cfg, recycle, poison, steps)
            for step, (d, c) in enumerate(zip(dirty, clean)):
                for dd, cc in zip(d, c):
                    assert np.isfinite(dd).all(), (recycle, poison, step)
                    assert np.array_equal(dd, cc), (recycle, poison, step)
        if recycle == "reset_rows":  # positions restart at 0: exactly a fresh stream's outputs
            rng = np.random.default_rng(2)
            for _ in range(steps):  # the old session's frames
                frames(rng, cfg)
            fresh = Runner(path, cfg)
            for c in clean:
                for f, cc in zip(fresh.step(frames(rng, cfg)), c):
                    assert np.array_equal(f[1], cc[1])


@pytest.mark.parametrize("kind", ["temporal", "mimi"])
def test_reset_rows_with_ring_clearing_stays_bit_identical_to_moshi(kind):
    """Our reset_rows (offsets to 0, rings zeroed) against moshi's reset_streaming(mask) (offsets
    only), finite data, convention "moshi", across ring wraps: active rows torch.equal."""
    cfg = config(kind, "moshi")
    T = FRAMES[kind]
    ours = torch_stack(cfg, seed=4)
    theirs, out_norm, text_linear = moshi_stack(cfg, ours.export_weights(None if kind == "temporal"
                                                                         else "encoder_transformer"), B)
    ours.streaming_init(B)
    gen = torch.Generator().manual_seed(9)
    resets = 0
    with torch.no_grad():
        for step in range(80):
            if step % 11 == 10:
                mask = torch.rand(B, generator=gen) < 0.5
                resets += int((mask & (ours.state.offset > cfg.capacity)).sum())
                ours.reset_rows(mask)
                theirs.reset_streaming(mask)
            x = torch.randn(B, T, cfg.dim, generator=gen)
            active = torch.rand(B, generator=gen) < 0.8
            theirs.set_exec_mask(active)
            ref = theirs(x)
            if kind == "temporal":
                ref = out_norm(ref)
                out, logits = ours.step(x, active)
                assert torch.equal(logits[active], text_linear(ref)[:, None][active]), step
            else:
                out = ours.step(x, active)
            assert torch.equal(out[active], ref[active]), step
    assert resets >= 2, "rows must be reset after a ring wrap"


# ------------------------------------------------------------------------------ 4. jitted recycle ops
def test_jitted_recycle_ops_refuse_bad_concrete_arguments_before_donating(tmp_path):
    cfg = config("temporal")
    s = jx.init_state(cfg, 2)
    s = s._replace(k=s.k + 1, v=s.v - 1, offset=jnp.array([5, 3], jnp.int32), start_offset=jnp.array([1, 0], jnp.int32))
    kept = jax.tree.map(np.array, s)
    cases = []
    for op, name in ((jx.jit_reset_slot, "reset_slot"), (jx.jit_bump_slot_start, "bump_slot_start")):
        cases += [(op, 5, IndexError, rf"{name}\(b\): b=5 is out of range for batch_size 2"),
                  (op, -1, IndexError, rf"{name}\(b\): b=-1 is out of range"),
                  (op, np.int64(2), IndexError, "b=2 is out of range"),
                  (op, jnp.int32(2), IndexError, "b=2 is out of range"),
                  (op, 1.0, TypeError, rf"{name}\(b\): b must be an integer"),
                  (op, True, TypeError, "b must be an integer"),
                  (op, jnp.array([0, 1]), TypeError, "b must be an integer")]
    cases += [(jx.jit_reset_rows, jnp.array([True]), ValueError, r"reset_rows\(mask\): mask must have shape \[2\]"),
              (jx.jit_reset_rows, np.array([1, 0]), TypeError, r"reset_rows\(mask\): mask must be a bool array"),
              (jx.jit_reset_rows, [True, False], TypeError, "mask must be a bool array, got list"),
              (jx.jit_reset_rows, np.ones((2, 1), bool), ValueError, "mask must have shape")]
    for op, arg, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            op(s, arg)
        assert not s.k.is_deleted(), (op, arg)  # refused before the donated call
        same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), s, kept)
        assert all(jax.tree.leaves(same)), (op, arg)
    with pytest.raises(TypeError, match=r"reset_slot\(state\): expected a jax_impl.StreamState"):
        jx.jit_reset_slot(tuple(s), 0)
    # accepted: a concrete in-range row, numpy or jax, and a traced one inside the caller's jit
    s = jx.jit_bump_slot_start(s, np.int32(1))
    s = jx.jit_reset_slot(s, jnp.int32(0))
    np.testing.assert_array_equal(s.start_offset, [5, 1])
    assert not np.asarray(s.k[:, 0]).any() and np.asarray(s.k[:, 1]).all()
    s = jax.jit(lambda st, b: jx.jit_reset_slot(st, b))(s, 5)  # traced b out of range: a no-op
    np.testing.assert_array_equal(s.start_offset, [5, 1])
    assert np.asarray(s.k[:, 1]).all()
    old, s = s, jx.jit_reset_rows(s, np.array([False, True]))
    np.testing.assert_array_equal(s.offset, [5, 0])
    assert not np.asarray(s.v).any()
    # the state a call took by donation is refused by name, not by XLA's "buffer has been deleted"
    for op, arg in ((jx.jit_reset_slot, 0), (jx.jit_bump_slot_start, 0), (jx.jit_reset_rows, np.array([True, False])),
                    (lambda st, _: jx.jit_reset_streaming(st), None)):
        with pytest.raises(ValueError, match=r"\(state\): the state was donated to an earlier call"):
            op(old, arg)
    with pytest.raises(TypeError, match=r"reset_streaming\(state\): expected a jax_impl.StreamState, got dict"):
        jx.jit_reset_streaming({"k": s.k})
    # so are the host readers of a state (they gave JAX's "Array has been deleted")
    cfg = config("temporal")
    for name, call in (("state_snapshot(state)", lambda: jx.state_snapshot(cfg, old)),
                       ("write_stream(state)", lambda: jx.write_stream(cfg, old, tmp_path / "s.safetensors")),
                       ("check_headroom(state_or_bound)", lambda: jx.check_headroom(old, 1))):
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}: the state was donated to an earlier call"):
            call()
    assert not (tmp_path / "s.safetensors").exists()


ROWS = [1, np.int64(1), np.uint8(1), np.array(1), jnp.int32(1), torch.tensor(1)]
NOT_ROWS = [True, np.True_, np.array(True), torch.tensor(True), 1.0, torch.tensor(1.0), np.array([1]),
            torch.tensor([1]), jnp.array([1]), "1", None]


@pytest.mark.parametrize("path", ["jit", "jax", "torch", "dropin"])
def test_one_row_index_rule_on_every_side(path):
    """A row index is a Python or numpy integer or a 0-d integer array / tensor (numpy, jax, torch),
    never a bool, on every side: the torch stacks refused np.array(1) and torch.tensor(1), which the
    JAX ops took."""
    cfg = config("mimi")
    if path == "jit":
        state = jx.init_state(cfg, 2)

        def op(name, b):
            nonlocal state
            state = getattr(jx, f"jit_{name}")(state, b)

        def offsets():
            return np.asarray(state.start_offset).tolist()
    else:
        run = Stepper(path, cfg)

        def op(name, b):
            getattr(run.module, name)(b)

        def offsets():
            return run.arrays()["start_offset"].tolist()
    for b in ROWS:
        op("bump_slot_start", b)
        op("reset_slot", b)
    assert offsets() == [0, 0]
    op("bump_slot_start", torch.tensor(1))
    assert offsets() == [0, 1]
    for name in ("reset_slot", "bump_slot_start"):
        for bad in NOT_ROWS:
            with pytest.raises(TypeError, match=rf"^{name}\(b\): b must be an integer row index \(a Python or numpy "
                                                r"integer, or a 0-d integer array or tensor; not a bool\), got "):
                op(name, bad)
        for bad in (2, np.array(2), torch.tensor(-1), jnp.int32(2)):
            with pytest.raises(IndexError, match=rf"^{name}\(b\): b=-?[12] is out of range for batch_size 2"):
                op(name, bad)
    assert offsets() == [0, 1]


def test_streamer_takes_the_masks_the_jitted_ops_take():
    """Streamer.step and Streamer.reset_rows converted active / mask with jnp.asarray before the check:
    a list was taken (the jitted ops and the torch stacks refuse it) and an int64 mask was narrowed,
    then refused as int32. Checked as given now, on both sides."""
    cfg = config("mimi")
    run = Stepper("jax", cfg)
    s = run.module
    x = np.zeros((2, FRAMES["mimi"], cfg.dim), np.float32)
    s.step(x)
    before = run.arrays()
    step = jx.make_step(cfg)
    for call, pattern in ((lambda m: s.reset_rows(m), r"^reset_rows\(mask\): mask must be a bool array, got "),
                          (lambda m: s.step(x, m), r"^step\(active\): active must be a bool array, got "),
                          (lambda m: step(s.params, s.state, x, m), r"^step\(active\): active must be a bool array, got ")):
        for bad, got in (([True, False], "list"), (np.array([1, 0], np.int64), "int64")):
            with pytest.raises(TypeError, match=pattern + got):
                call(bad)
    after = run.arrays()
    assert all(np.array_equal(after[k], before[k]) for k in before)
    stack = torch_stack(cfg)
    stack.streaming_init(2)
    for call in (lambda: stack.reset_rows([True, False]), lambda: stack.step(torch.from_numpy(x), [True, False])):
        with pytest.raises(TypeError, match="must be a torch.bool tensor, got list"):
            call()


def test_streamer_guard_reads_the_offsets_once_it_would_refuse():
    """The overflow guard's bound (+T a step) outlives rows reset since; where it would refuse a step,
    the Streamer reads the offsets once: rows reset one at a time keep streaming, and a row that is
    really at the limit is still refused."""
    cfg = config("temporal")
    s = jx.Streamer(cfg, jx.init_params(cfg, jax.random.key(0)), 2)
    top = jx.state.index_max()
    snap = {**s.snapshot(), "offset": np.array([top, 5], np.int32), "start_offset": np.zeros(2, np.int32)}
    s.restore(snap)
    x = jnp.zeros((2, 1, cfg.dim))
    with pytest.raises(OverflowError):
        s.step(x)
    s.reset_rows(np.array([True, False]))  # the row at the limit starts again; the bound is still `top`
    assert s.offset_bound == top
    s.step(x)
    assert s.offset_bound == 6 and np.asarray(s.state.offset).tolist() == [1, 6]
