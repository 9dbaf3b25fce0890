"""The LM frame on the twin kernels: the JAX frame step (Pallas twins) and the torch `LMFrame` (Triton
twins) give identical bits, every output and every state tensor, frame after frame; a row alone has
its bits among 4; the embeddings' sum is the same on both sides; `crosscheck --stack depformer|frame`
on the twins says so."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import frame as jf
from jax_impl.frame_config import FRAME_PRESETS, UNGENERATED_TOKEN
from torch_bridge import to_torch
from torch_bridge.frame import LMFrame, frame_input, jax_frame_params

ALONE = 3  # the row also stepped alone (JAX, B=1) in the batch of 4: its bits among 4 are its bits alone
FRAMES = 4
CONTEXT = 2  # the temporal ring wraps at a row's third frame (offset > context), the delays (up to 2) pass by it


def small(preset: str):
    """The preset with a short ring, so a few frames wrap it."""
    cfg = FRAME_PRESETS[preset]
    return dataclasses.replace(cfg, temporal=dataclasses.replace(cfg.temporal, context=CONTEXT))


def same(ours: torch.Tensor, theirs) -> bool:
    """Bit for bit: floats of one dtype equal, integers equal whatever their width."""
    theirs = to_torch(theirs)
    if ours.dtype.is_floating_point or theirs.dtype.is_floating_point:
        return ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    return torch.equal(ours.long(), theirs.long())


def state_pairs(frame: LMFrame, state: jf.FrameState, rows=slice(None)) -> dict:
    """Every state tensor of both sides (torch rows `rows`)."""
    ts = frame.temporal.state
    return {"token_cache": (frame.token_cache[rows], state.token_cache),
            "frame_offset": (frame.frame_offset[rows], state.frame_offset),
            **{n: (getattr(ts, n)[:, rows], getattr(state.temporal, n)) for n in ("k", "v")},
            **{n: (getattr(ts, n)[rows], getattr(state.temporal, n)) for n in ("offset", "start_offset")}}


# Between them: PersonaPlex's config (16 depformer steps) and Moshi's (8, with the caller's codebooks),
# both dtypes, greedy and sampled, a batch of 2 and one of 4. Each exits the depformer early (2 steps: the
# text-fed first step and an audio-fed one; the rest of the audio is the caller's): each step costs the
# Triton interpreter ~0.3 s at B=4, about what the temporal stack costs, and a whole depformer is the same
# code with more steps (its twins' test, tests/test_depformer_twin.py; the frame without an exit:
# tests/test_frame.py). The costs: the interpreter's programs (a program a row in the attention; bfloat16's
# twice float32's) and the JAX frame's compile (a few seconds a shape).
SAMPLED = {"temperature": 0.9, "top_k": 6, "text_temperature": 0.8, "text_top_k": 12}
CASES = [("personaplex-small", torch.float32, SAMPLED, 4), ("moshi-small", torch.bfloat16, {}, 2)]
DEP_Q_EXIT = 2


def frames(cfg, B: int, sampled: bool):
    """The frames of a run, the same for every side: (t, recycle, user, active, tail, seeds) each, where
    recycle is what runs before frame t: ("slot", 1) (reset_slot then bump_slot_start), ("rows", mask)
    or None. Idle rows, a recycled slot, reset rows; the delays pass (row 1's, after its recycle) and
    the ring wraps (offset past CONTEXT) in FRAMES frames: the tests check that they do."""
    g = torch.Generator().manual_seed(6)
    seeds = torch.tensor([3, 2**31 + 9, 4, 77][:B]) if sampled else None
    for t in range(FRAMES):
        recycle = ("slot", 1) if t == 1 else ("rows", torch.arange(B) % 3 == 0) if t == 2 else None  # rows 0 (and 3)
        active = torch.ones(B, dtype=torch.bool)
        active[0], active[B - 1] = t != 3, t != 0  # row 0 idle after its reset, the last row before any frame
        user = torch.randint(-1, cfg.card + 1, (B, cfg.user_codebooks), generator=g)
        tail = torch.randint(0, cfg.card, (B, cfg.dep_q - DEP_Q_EXIT), generator=g)
        yield t, recycle, user, active, tail, seeds


def jax_args(user, active, tail, seeds, rows=slice(None)):
    """A frame's inputs as the JAX frame step takes them (rows `rows`)."""
    return (user[rows].int().numpy(), active[rows].numpy(), tail[rows].int().numpy(),
            None if seeds is None else seeds[rows].numpy().astype(np.uint32))


def jax_recycle(state, recycle, rows=slice(None)):
    """`recycle` (see `frames`) on a JAX frame state holding rows `rows` of the batch."""
    if recycle is None:
        return state
    what, arg = recycle
    if what == "rows":
        return jf.jit_reset_rows(state, arg[rows].numpy())
    return jf.jit_bump_slot_start(jf.jit_reset_slot(state, arg), arg)


@functools.cache
def jax_frame_step(cfg, rope_freqs, **sampling):
    """The JAX frame on the twins, exiting at DEP_Q_EXIT: one jitted function a config and sampler,
    shared by the tests (in one process, a shape compiles once)."""
    return jf.make_frame_step(cfg, kernels="twin", rope_freqs=rope_freqs, dep_q_exit=DEP_Q_EXIT, **sampling)


def twin_frame(preset: str, dtype):
    """The torch frame on the twins (random weights) and its parameters as the JAX frame takes them."""
    cfg = small(preset)
    frame = LMFrame.from_config(cfg, dtype=dtype, kernels="twin")
    frame.init_weights(std=0.3, generator=torch.Generator().manual_seed(5))
    return cfg, frame, jax_frame_params(frame)


@pytest.mark.parametrize("preset, dtype, sampling, B", CASES)
def test_twin_frame_jax_and_torch_identical(preset, dtype, sampling, B):
    """4 frames side by side (the delays pass, the ring wraps), idle rows, reset_slot + bump_slot_start
    and reset_rows: every output and state tensor identical after every frame."""
    torch.set_num_threads(1)
    cfg, frame, params = twin_frame(preset, dtype)
    step = jax_frame_step(cfg, frame.temporal.rope_freqs(), **sampling)
    frame.streaming_init(B)
    state = jf.init_frame_state(cfg, B, params["text_emb"].dtype)
    text_seen = set()
    for t, recycle, user, active, tail, seeds in frames(cfg, B, bool(sampling)):
        if recycle is not None and recycle[0] == "slot":
            frame.reset_slot(recycle[1])
            frame.bump_slot_start(recycle[1])
        elif recycle is not None:
            frame.reset_rows(recycle[1])
        state = jax_recycle(state, recycle)
        ours = frame.step(user, active, replace_audio=tail, seeds=seeds, dep_q_exit=DEP_Q_EXIT, **sampling)
        theirs, state = step(params, state, *jax_args(user, active, tail, seeds))
        for name in ours._fields:
            assert same(getattr(ours, name), getattr(theirs, name)), f"{name} differs at frame {t}"
        for name, (a, b) in state_pairs(frame, state).items():
            assert same(a, b), f"state {name} differs after frame {t}"
        text_seen.update(ours.text[active].tolist())
        assert torch.equal(ours.audio[active, DEP_Q_EXIT:], tail[active])
    assert ours.audio_logits.shape == (B, DEP_Q_EXIT, cfg.card)
    assert int(frame.temporal.state.offset.max()) > CONTEXT, "the ring must wrap"
    assert (ours.tokens[1] != UNGENERATED_TOKEN).all(), "row 1's delays must have passed"
    assert len(text_seen) > 2


def test_twin_frame_row_alone_has_its_bits_in_the_batch():
    """The JAX frame on the twins: row 3 of a batch of 4 and the same row stepped alone (B=1) through
    the frames above (sampled, its seed; idle at frame 0, reset with rows 0 and 3 at frame 2): the same bits,
    every output and state tensor, after every frame (the batch's bits are the torch frame's, above)."""
    cfg, frame, params = twin_frame("personaplex-small", torch.float32)
    step = jax_frame_step(cfg, frame.temporal.rope_freqs(), **SAMPLED)
    batch, alone = (jf.init_frame_state(cfg, B, params["text_emb"].dtype) for B in (4, 1))
    row = slice(ALONE, None)
    for t, recycle, *args in frames(cfg, 4, True):
        if recycle is not None and recycle[0] == "rows":
            alone = jax_recycle(alone, recycle, row)
        batch = jax_recycle(batch, recycle)
        ours, batch = step(params, batch, *jax_args(*args))
        mine, alone = step(params, alone, *jax_args(*args, rows=row))
        for name in ours._fields:
            assert same(to_torch(getattr(ours, name))[row], getattr(mine, name)), f"{name}: row {ALONE}, frame {t}"
        for name in ("token_cache", "frame_offset"):
            assert same(to_torch(getattr(batch, name))[row], getattr(alone, name)), f"{name} after frame {t}"
        for name in ("k", "v"):
            assert same(to_torch(getattr(batch.temporal, name))[:, row], getattr(alone.temporal, name)), name
        for name in ("offset", "start_offset"):
            assert same(to_torch(getattr(batch.temporal, name))[row], getattr(alone.temporal, name)), name
    assert int(alone.frame_offset[0]) == 2, "the row is idle at frame 0 and reset at frame 2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frame_input_same_sum_both_sides(dtype):
    """The temporal stack's input: the twin sum (float32 upcasts left to right, rounded once) has the
    same bits in torch and JAX, batch or not; in float32 it is the reference's sum; in bfloat16 the
    reference's per-add roundings give other bits, which this test would see."""
    cfg = FRAME_PRESETS["personaplex-small"]
    frame = LMFrame.from_config(cfg, dtype=dtype)
    frame.init_weights(std=1.0, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    tokens = torch.cat([torch.randint(-1, cfg.text_card + 1, (64, 1), generator=g),
                        torch.randint(-1, cfg.card + 1, (64, cfg.n_q), generator=g)], 1)
    params = jax_frame_params(frame)
    jax_input = jax.jit(jf.frame_input, static_argnums=2)
    twin = frame_input(frame.text_emb, frame.emb, tokens, "twin")
    assert twin.shape == (64, 1, cfg.temporal.dim) and twin.dtype == dtype
    assert same(twin, jax_input(params, jnp.asarray(tokens.int().numpy()), "twin"))
    assert same(twin[5:6], jax_input(params, jnp.asarray(tokens[5:6].int().numpy()), "twin"))
    reference = frame_input(frame.text_emb, frame.emb, tokens, "reference")
    assert torch.equal(twin, reference) == (dtype == torch.float32)


def test_twin_frame_refuses_bad_kernels():
    """An unknown kernels name, and the twins on a head dim they do not take, are refused up front,
    on both sides, naming the argument."""
    cfg = FRAME_PRESETS["moshi-small"]
    odd = dataclasses.replace(cfg, temporal=dataclasses.replace(cfg.temporal, num_heads=4))  # head dim 12
    for make in (lambda c, k: LMFrame.from_config(c, kernels=k), lambda c, k: jf.make_frame_step(c, kernels=k)):
        with pytest.raises(ValueError, match="kernels must be one of"):
            make(cfg, "pallas")
        with pytest.raises(ValueError, match="kernels='twin' needs power-of-two head dims.*temporal stack's is 12"):
            make(odd, "twin")
        make(odd, "reference")


def test_frame_refused_by_a_kernel_changes_nothing(monkeypatch):
    """A frame whose temporal step raises (as the Triton twins do on the CPU without TRITON_INTERPRET)
    leaves the token cache and the offsets as they were, the caller's codebooks included."""
    cfg = FRAME_PRESETS["moshi-small"]
    frame = LMFrame.from_config(cfg)
    frame.streaming_init(2)
    user = torch.ones(2, cfg.user_codebooks, dtype=torch.long)
    frame.step(user)
    saved = frame.token_cache.clone(), frame.frame_offset.clone()

    def refuse(*args):
        raise RuntimeError("this kernel cannot run here")

    monkeypatch.setattr(frame.temporal, "step", refuse)
    with pytest.raises(RuntimeError, match="cannot run here"):
        frame.step(user + 1)
    assert torch.equal(frame.token_cache, saved[0]) and torch.equal(frame.frame_offset, saved[1])


def test_crosscheck_depformer_and_frame_twin(capsys, monkeypatch, tmp_path):
    """`crosscheck --stack depformer|frame` runs the twin kernels by default, on the CPU a few steps
    (`default_steps`): the depformer's run (one frame) reports every tensor bit-identical, in its JSON
    too; `--stack frame` hands `crosscheck_lm` the same defaults (the twin frames themselves:
    `test_twin_frame_jax_and_torch_identical`, every tensor after every frame; the frame's run through
    the command line: `--kernels reference`'s, tests/test_frame.py)."""
    import torch_bridge.crosscheck_lm as lm
    from torch_bridge.cli import main

    assert lm.default_steps("frame", "twin", "cpu") < lm.default_steps("frame", "reference", "cpu")
    run, calls, reports = lm.crosscheck_lm, [], []

    def recording(stack, **kwargs):  # runs the depformer; the frame is handed the depformer's report
        calls.append((stack, kwargs["kernels"], kwargs["steps"], kwargs["batch"]))
        if stack == "depformer":
            reports.append(run(stack, **kwargs))
        return reports[0]

    monkeypatch.setattr(lm, "crosscheck_lm", recording)
    out_json = tmp_path / "r.json"
    for argv in (["--stack", "depformer", "--steps", "1", "--json", str(out_json)], ["--stack", "frame"]):
        assert main(["crosscheck", *argv, "--batch", "1", "--require", "identical", "-q"]) == 0
        out = capsys.readouterr().out
        assert "kernels twin" in out and "verdict: every tensor bit-identical at every step" in out
    assert calls == [("depformer", "twin", 1, 1), ("frame", "twin", None, 1)]  # None: default_steps
    report = json.loads(out_json.read_text())
    assert report["kernels"] == "twin" and report["holds"]["identical"] is True and report["steps"] == 1
    assert all(r["identical"] for r in report["tensors"].values())
    with pytest.raises(ValueError, match="kernels must be one of"):
        run("depformer", kernels="pallas")
