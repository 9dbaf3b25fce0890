"""The JAX-backed depformer drop-in (`torch_bridge.JaxDepformer`, `from_torch(depformer)`) against the
torch module it was made from, and the JAX reference path against the torch reference in bfloat16."""

from __future__ import annotations

import pytest
import torch

from torch_bridge import Depformer, JaxDepformer, from_torch

from .test_depformer import SMALL, frame_inputs, random_depformer
from .test_depformer_twin import case_frame


def test_dropin_on_the_twins_is_identical():
    """`from_torch` of a twin depformer: a JAX-backed drop-in on the same buffers with the torch module's
    bits, whole and at an early exit. float32 (the interpreter's cheaper dtype): the drop-in only wraps
    the JAX twin frame, whose bits in both dtypes tests/test_depformer_twin.py holds to torch's."""
    dep, (text, out, audio, provided), sampling = case_frame("moshi", torch.float32, "forced-sampled")
    dropin = from_torch(dep)
    assert type(dropin) is JaxDepformer and dropin.kernels == "twin"
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(dropin.weights().values(), dep.weights().values()))
    codes, logits = dep(text, out, audio, provided, return_logits=True, **sampling)
    jcodes, jlogits = dropin(text, out, audio, provided, return_logits=True, **sampling)
    assert jcodes.dtype == torch.int64 and jlogits.dtype == torch.float32
    assert torch.equal(jcodes, codes) and torch.equal(jlogits, logits)
    # an early exit after the first codebooks: the first steps' bits, as the torch module's
    early, early_logits = dropin(text, out, audio, provided, return_logits=True, steps=3, **sampling)
    assert torch.equal(early, codes[:, :3]) and torch.equal(early_logits, logits[:, :3])
    with pytest.raises(ValueError, match="steps must be an int in 1..8"):
        dropin(text, out, steps=9)


def test_dropin_reference_matches_the_torch_module():
    """The drop-in on the reference path: the torch module's codes and logits, forced or not, sampled
    (seeds and counters past 32 bits); edits of the shared buffers seen, a conversion followed. One
    config: the JAX reference path against torch on both is tests/test_depformer.py's test_jax_matches_torch,
    and the drop-in's wrapping does not depend on the config."""
    cfg = SMALL["moshi"]
    dep = random_depformer(cfg, torch.float32, seed=7)
    dropin = from_torch(dep)
    assert dropin.kernels == "reference"
    text, out = frame_inputs(cfg, torch.float32, B=4)
    g = torch.Generator().manual_seed(8)
    audio = torch.randint(-1, cfg.card + 1, (4, cfg.dep_q), generator=g)
    provided = torch.rand(4, cfg.dep_q, generator=g) < 0.3
    audio[~provided] = 2**40  # not read where not provided
    for forcing in ((None, None), (audio, provided)):
        codes, logits = dep(text, out, *forcing, return_logits=True)
        jcodes, jlogits = dropin(text, out, *forcing, return_logits=True)
        assert torch.equal(jcodes, codes)
        rel = float((jlogits - logits).abs().max() / logits.abs().max())
        assert rel < 2e-6, rel  # the JAX reference path's bound (tests/test_depformer.py); 1.3e-6 here
    sampling = {"temperature": 0.8, "top_k": 10, "seeds": torch.tensor([1, -2, 2**33 + 3, 4]), "counter": 2**32 + 5}
    assert torch.equal(dropin(text, out, **sampling), dep(text, out, **sampling))
    counter = torch.tensor([0, 1, 2, 3])
    assert torch.equal(dropin(text, out, **{**sampling, "counter": counter}), dep(text, out, **{**sampling, "counter": counter}))
    # an in-place edit of the shared buffers is seen; a conversion is followed
    dep.init_weights(std=0.3, generator=torch.Generator().manual_seed(9))
    assert torch.equal(dropin(text, out), dep(text, out))
    dropin.bfloat16()
    params = dropin.jax_params()
    assert params["in_proj"].dtype == "bfloat16" and params["in_proj"].unsafe_buffer_pointer() == dropin.in_proj.data_ptr()
    assert dropin(text, out.bfloat16()).shape == (4, cfg.dep_q)


def test_reference_bfloat16_jax_against_torch():
    """The JAX reference path against the torch reference in bfloat16, each step forced to torch's
    codes (so both see the same inputs). Measured over 12 models (both configs, B=4): the logits
    within 4.7% of their scale, normwise (bfloat16 roundings after differently ordered sums, carried
    through the layers); 15 of 576 steps chose another token, each where torch's top-2 logits were
    within 0.02 of their scale (a near tie: a few bfloat16 steps at that scale); every other step
    the same token. The test holds the codes equal wherever the gap is 0.025 of the scale or more."""
    for convention in ("personaplex", "moshi"):
        cfg = SMALL[convention]
        for seed in range(2):
            dep = random_depformer(cfg, torch.bfloat16, seed=30 + seed)
            text, out = frame_inputs(cfg, torch.bfloat16, B=4, seed=40 + seed)
            codes = dep(text, out)
            forced = (codes, torch.ones_like(codes, dtype=torch.bool))
            tcodes, tlogits = dep(text, out, *forced, return_logits=True)
            jcodes, jlogits = from_torch(dep)(text, out, *forced, return_logits=True)
            scale = tlogits.abs().max()
            assert (jlogits - tlogits).abs().max() / scale < 0.08
            top2 = tlogits.topk(2, dim=-1).values
            near_tie = (top2[..., 0] - top2[..., 1]) / scale < 0.025
            assert near_tie.float().mean() < 0.3  # most steps are compared (near ties: 16-25% of them here)
            assert torch.equal(jcodes[~near_tie], tcodes[~near_tie])


def test_dropin_bad_input_names_the_argument_and_changes_nothing():
    cfg = SMALL["moshi"]
    dep = random_depformer(cfg, torch.float32)
    dropin = from_torch(dep)
    text, out = frame_inputs(cfg, torch.float32)
    before = dropin(text, out, return_logits=True)
    cases = [
        ((text[:2], out), {}, ValueError, "text_token must have shape \\[3\\]"),
        ((text, out.bfloat16()), {}, ValueError, "transformer_out must be torch.float32"),
        ((text, out), {"temperature": 1.0}, ValueError, "seeds must be an integer array \\[3\\]"),
        ((text, out), {"temperature": 1.0, "seeds": torch.ones(3)}, ValueError, "seeds must be an integer array"),
        ((text, out), {"temperature": 1.0, "seeds": torch.ones(3, dtype=torch.long, device="meta")}, ValueError,
         "seeds is on meta"),
        ((text, out), {"temperature": -1.0}, ValueError, "temperature must be 0 \\(greedy\\) or a float > 0"),
        ((text, out), {"counter": 1.5}, TypeError, "counter must be an int or an integer array"),
        ((text, out), {"counter": torch.zeros(3)}, TypeError, "counter must be an int or an integer array"),
        ((text, out), {"counter": torch.zeros(3, 2, dtype=torch.long)}, ValueError, "counter must have shape"),
        ((text, out, torch.zeros(3, cfg.dep_q, dtype=torch.long)), {}, ValueError, "audio_tokens and audio_provided"),
    ]
    for args, kwargs, kind, match in cases:
        with pytest.raises(kind, match=match):
            dropin(*args, **kwargs)
    after = dropin(text, out, return_logits=True)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    with pytest.raises(TypeError, match="already JAX-backed"):
        from_torch(dropin)
    with pytest.raises(TypeError, match="expected a Depformer"):
        JaxDepformer.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="kernels must be one of"):
        from_torch(dep, kernels="fast")
    assert type(JaxDepformer.from_config(cfg, kernels="twin")) is JaxDepformer
    assert isinstance(JaxDepformer.from_config(cfg), Depformer)
