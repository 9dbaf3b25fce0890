"""The depformer on the twin kernels: the JAX depformer (Pallas twins) and the torch one (Triton twins)
give identical bits, codes and logits, on the CPU; a row's bits do not depend on the batch; the twin
path's codes against the reference path's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from torch_bridge import to_jax

from .test_depformer import SMALL, frame_inputs, random_depformer


@functools.cache
def jax_step(cfg, kernels="twin", temperature=0.0, top_k=0):
    """One jitted frame per (config, kernels, sampler), shared by the tests (compiled once per shape)."""
    return jx.make_depformer_step(cfg, kernels, temperature=temperature, top_k=top_k)


def as_jax(t: torch.Tensor):
    """A torch input as a JAX array; int64 as int32 (token ids fit; seeds wrap mod 2**32, as the sampler takes them)."""
    return to_jax(t.int() if t.dtype == torch.int64 else t, copy=None)  # a row slice: copied (its layout)


def jax_frame(dep, text, out, audio=None, provided=None, *, kernels="twin", temperature=0.0, top_k=0, **seeds):
    """The JAX depformer on `dep`'s weights (DLPack views): (codes, logits) as torch tensors. Always
    with teacher-forcing arrays (none provided where not given): one compile per shape serves both."""
    B, c = out.shape[0], dep.config
    if audio is None:
        audio, provided = torch.zeros(B, c.dep_q, dtype=torch.int32), torch.zeros(B, c.dep_q, dtype=torch.bool)
    params = jx.check_depformer_params(c, {k: to_jax(v) for k, v in dep.weights().items()})
    codes, logits = jax_step(c, kernels, temperature, top_k)(
        params, *(as_jax(a) for a in (text, out, audio, provided)), **{k: as_jax(v) for k, v in seeds.items()})
    return torch.from_numpy(np.array(codes)).long(), torch.from_numpy(np.array(logits))


def forcing(cfg, B, seed):
    g = torch.Generator().manual_seed(seed)
    audio = torch.randint(-1, cfg.card + 1, (B, cfg.dep_q), generator=g)
    provided = torch.rand(B, cfg.dep_q, generator=g) < 0.4
    return audio, provided


# Each case runs one torch twin frame (the Triton interpreter: seconds; B=2, as its attention costs a
# program a row): between them both configs (16 steps and 8), both dtypes, teacher forcing, sampling
# (forced-sampled samples every step not forced). The LM frame's twin test (tests/test_frame_twin.py)
# steps the other two config x dtype pairs torch vs JAX (personaplex float32 to its early exit, moshi
# bfloat16), so each pair runs somewhere. The JAX frames below share these cases' compiles where the
# shapes match (`jax_step`).
CASES = [("personaplex", torch.bfloat16, "forced"), ("moshi", torch.float32, "forced-sampled")]
SAMPLER = {"temperature": 4.0, "top_k": 12}


def case_frame(convention, dtype, mode, B=2):
    """(depformer on the twins, its inputs as args and keywords) of a case."""
    cfg = SMALL[convention]
    dep = random_depformer(cfg, dtype, seed=7)
    dep.kernels = "twin"
    text, out = frame_inputs(cfg, dtype, B=B)
    audio, provided = forcing(cfg, B, seed=8) if "forced" in mode else (None, None)
    seeds = {"seeds": torch.tensor([5, 2**31 + 6, 7, 8][:B]), "counter": torch.tensor(3)} if "sampled" in mode else {}
    return dep, (text, out, audio, provided), {**SAMPLER, **seeds} if seeds else {}


@pytest.mark.parametrize("convention, dtype, mode", CASES)
def test_twin_jax_and_torch_identical(convention, dtype, mode):
    dep, (text, out, audio, provided), sampling = case_frame(convention, dtype, mode)
    codes, logits = dep(text, out, audio, provided, return_logits=True, **sampling)
    jcodes, jlogits = jax_frame(dep, text, out, audio, provided, **sampling)
    assert torch.equal(jcodes, codes) and torch.equal(jlogits, logits)
    assert logits.dtype == torch.float32 and logits.shape == (2, dep.config.dep_q, dep.config.card)
    assert len(set(codes.flatten().tolist())) > 3
    # the mode did something (JAX's frames, the same bits, compiled once): no forcing, other seeds
    if audio is not None:
        assert not torch.equal(codes, jax_frame(dep, text, out, audio, provided & False, **sampling)[0])
    if sampling:
        assert not torch.equal(codes, jax_frame(dep, text, out, audio, provided,
                                                **{**sampling, "seeds": sampling["seeds"] + 1})[0])


def test_twin_rows_do_not_depend_on_the_batch():
    """Each row of a batch of 2 has the bits it has alone (JAX), and the torch twin's row alone too."""
    dep, (text, out, audio, provided), sampling = case_frame("moshi", torch.float32, "forced-sampled")  # a case's compile
    codes, logits = jax_frame(dep, text, out, audio, provided, **sampling)
    for b in range(2):
        row = {**sampling, "seeds": sampling["seeds"][b:b + 1]}
        one = jax_frame(dep, text[b:b + 1], out[b:b + 1], audio[b:b + 1], provided[b:b + 1], **row)
        assert torch.equal(one[0], codes[b:b + 1]) and torch.equal(one[1], logits[b:b + 1])
    alone = dep(text[1:], out[1:], audio[1:], provided[1:], return_logits=True, **{**sampling, "seeds": sampling["seeds"][1:]})
    assert torch.equal(alone[0], codes[1:]) and torch.equal(alone[1], logits[1:])


def test_twin_codes_against_the_reference():
    """float32: the greedy codes equal the reference path's, the logits within 1e-5 normwise
    (at most 3.0e-6 measured: the twins' summation order). bfloat16: the twin frame forced to the
    reference's codes, so every step sees the reference's inputs: 187 of the 192 steps (97.4%; 6
    models x 2 rows x 16 steps) chose the reference's token, each other one at a near tie of the
    reference's bfloat16 logits (top-2 gap at most 0.0049 of their scale: a step or two of bfloat16)."""
    cfg = SMALL["personaplex"]
    agree, total = 0, 0
    for seed in range(6):
        for dtype in (torch.float32, torch.bfloat16):
            dep = random_depformer(cfg, dtype, seed=10 + seed)
            text, out = frame_inputs(cfg, dtype, B=2, seed=20 + seed)
            ref_codes, ref_logits = jax_frame(dep, text, out, kernels="reference")
            scale = ref_logits.abs().max()
            if dtype == torch.float32:
                codes, logits = jax_frame(dep, text, out)
                assert torch.equal(codes, ref_codes)
                assert (logits - ref_logits).abs().max() / scale < 1e-5
                continue
            codes, _ = jax_frame(dep, text, out, ref_codes, torch.ones_like(ref_codes, dtype=torch.bool))
            top2 = ref_logits.topk(2, dim=-1).values
            gap = (top2[..., 0] - top2[..., 1]) / scale
            assert (gap[codes != ref_codes] < 0.01).all(), gap[codes != ref_codes]
            agree += int((codes == ref_codes).sum())
            total += codes.numel()
    assert agree / total >= 0.95, agree / total


def test_twin_bad_kernels():
    cfg = SMALL["moshi"]
    with pytest.raises(ValueError, match="kernels must be one of \\('reference', 'twin'\\), got 'fast'"):
        jx.make_depformer_step(cfg, "fast")
    with pytest.raises(ValueError, match="kernels must be one of"):
        jx.depformer.depformer_frame(cfg, {}, jnp.zeros(1, jnp.int32), jnp.zeros((1, 1, cfg.temporal_dim)),
                                     kernels="fast")


def test_twin_unrolled_steps_have_the_bits_of_the_scan():
    """The twin frame's inner steps unrolled (the GPU's default: static steps and sets, no loop)
    give the scan's bits, teacher forcing and sampling included (the first 2 steps: one compile of
    a few kernels, interpreted)."""
    dep, (text, out, audio, provided), sampling = case_frame("moshi", torch.float32, "forced-sampled")
    cfg = dep.config
    params = jx.check_depformer_params(cfg, {k: to_jax(v) for k, v in dep.weights().items()})
    args = [as_jax(a) for a in (text, out, audio, provided, sampling["seeds"], sampling["counter"])]
    frames = [jax.jit(functools.partial(jx.depformer_frame, cfg, kernels="twin", steps=2, unroll=unroll,
                                        temperature=sampling["temperature"], top_k=sampling["top_k"]))(params, *args)
              for unroll in (False, True)]
    for a, b in zip(*frames):
        assert a.shape[1] == 2 and np.array_equal(np.asarray(a), np.asarray(b))
    codes, logits = dep(text, out, audio, provided, return_logits=True, steps=2, **sampling)
    assert np.array_equal(np.asarray(frames[1][0]), codes.numpy()) and np.array_equal(np.asarray(frames[1][1]),
                                                                                      logits.numpy())


def test_one_inner_step_runs_on_both_sides():
    """dep_q = 1 (no audio table: the text token's embedding alone feeds the one step): the twins'
    codes and logits identical; before, the JAX frame indexed an empty table stack while tracing."""
    cfg = jx.DepformerConfig(dim=16, num_layers=1, num_heads=2, hidden=24, dep_q=1, weight_sets=1, card=3,
                             text_card=5, temporal_dim=16)
    dep = random_depformer(cfg, torch.float32)
    dep.kernels = "twin"
    text, out = torch.tensor([1, -1, 4]), torch.randn(3, 1, cfg.temporal_dim, generator=torch.Generator().manual_seed(0))
    codes, logits = dep(text, out, return_logits=True)
    jcodes, jlogits = jax_frame(dep, text, out)
    assert codes.shape == (3, 1) and torch.equal(jcodes, codes) and torch.equal(jlogits, logits)
