"""The depformer: its config, the torch reference against moshi's `LMModel` depformer (bit for bit),
the checkpoint loader, input checks, and the JAX depformer against the torch reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import types

import numpy as np
import pytest
import torch

from jax_impl.checkpoint import CheckpointError
from jax_impl.depformer_config import DEPFORMER_PRESETS, DepformerConfig
from torch_bridge.depformer import Depformer

SMALL = {"personaplex": DEPFORMER_PRESETS["personaplex-small"], "moshi": DEPFORMER_PRESETS["moshi-small"]}


def _moshi_lm_module():
    """moshi's `models.lm` without running `moshi/__init__.py` or `moshi/models/__init__.py`
    (they import sentencepiece, huggingface_hub, ...)."""
    os.environ.setdefault("NO_TORCH_COMPILE", "1")
    if "moshi" in sys.modules:  # registered already (here or by tests/moshi_oracle.py)
        root = sys.modules["moshi"].__path__[0]
    else:
        spec = importlib.util.find_spec("moshi")
        if spec is None:
            pytest.skip("the `moshi` package is not installed (pip install --no-deps moshi==0.2.13)")
        root = spec.submodule_search_locations[0]
    for name, path in (("moshi", root), ("moshi.models", os.path.join(root, "models"))):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
    from moshi.models import lm

    return lm


def personaplex_expand(weights: dict, cfg: DepformerConfig) -> dict:
    """What PersonaPlex's `get_moshi_lm` does to an 8-set file for dep_q = 16: the fused attention
    projections repeated, sets and tables 8.. copied from 0.."""
    out = dict(weights)
    for key, w in weights.items():
        if ".self_attn." in key:
            out[key] = torch.cat([w] * (cfg.dep_q // cfg.weight_sets), dim=0)
    for new in range(cfg.weight_sets, cfg.dep_q):
        old = new % cfg.weight_sets
        for key, w in weights.items():
            for group in ("gating", "linears", "depformer_in", "depformer_emb"):
                if f"{group}.{old}." in key and (group != "depformer_emb" or new < cfg.dep_q - 1):
                    out[key.replace(f"{group}.{old}.", f"{group}.{new}.")] = w
    return out


def moshi_lm(cfg: DepformerConfig, weights: dict, dtype):
    """moshi's LMModel with this depformer (a one-layer temporal stack beside it, unused),
    loaded as PersonaPlex's loader loads it (`personaplex_expand`)."""
    lm = _moshi_lm_module()
    model = lm.LMModel(
        n_q=cfg.dep_q, dep_q=cfg.dep_q, card=cfg.card, text_card=cfg.text_card, dim=cfg.temporal_dim, num_heads=4,
        num_layers=1, hidden_scale=4.125, norm="rms_norm_f32", gating="silu", positional_embedding="rope",
        causal=True, layer_scale=None, context=8, delays=[0] * (cfg.dep_q + 1), depformer_dim=cfg.dim,
        depformer_dim_feedforward=cfg.hidden * 3 // 2, depformer_num_heads=cfg.num_heads,
        depformer_num_layers=cfg.num_layers, depformer_multi_linear=True, depformer_pos_emb="none",
        depformer_weights_per_step=True, dtype=dtype)
    assert model.depformer.layers[0].gating[0].linear_out.weight.shape == (cfg.dim, cfg.hidden)
    result = model.load_state_dict(personaplex_expand(weights, cfg), strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "depformer" in k or "linears" in k]
    return lm, model.eval()


def moshi_frame(lm, model, text_token, transformer_out, audio_tokens=None, audio_provided=None):
    """moshi's depformer loop (`LMGen.depformer_step`, greedy) collecting the logits as
    PersonaPlex's does, with its teacher forcing."""
    gen = lm.LMGen(model, use_sampling=False)
    prev, codes, logits_all = text_token, [], []
    with torch.no_grad(), model.depformer.streaming(text_token.shape[0]):
        for k in range(model.dep_q):
            logits = model.forward_depformer(k, prev[:, None, None], transformer_out)
            token = lm.sample_token(logits.float(), False)[:, 0, 0]
            codes.append(token)
            logits_all.append(logits[:, 0, 0].float())
            prev = token if audio_tokens is None else torch.where(audio_provided[:, k], audio_tokens[:, k], token)
    codes = torch.stack(codes, 1)
    if audio_tokens is None:
        with torch.no_grad():
            assert torch.equal(gen.depformer_step(text_token, transformer_out), codes)
    return codes, torch.stack(logits_all, 1)


def random_depformer(cfg, dtype, seed=0) -> Depformer:
    dep = Depformer.from_config(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    dep.init_weights(std=0.3, generator=g)
    with torch.no_grad():
        dep.norm1_alpha.copy_(1 + 0.1 * torch.randn(dep.norm1_alpha.shape, generator=g))
    return dep


def frame_inputs(cfg, dtype, B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, cfg.text_card + 1, (B,), generator=g)
    text[0] = -1
    out = torch.randn(B, 1, cfg.temporal_dim, generator=g).to(dtype)
    return text, out


# ----------------------------------------------------------------------------- config
def test_config_defaults_and_maps():
    c = DepformerConfig()
    assert (c.dim, c.num_layers, c.num_heads, c.hidden, c.dep_q, c.weight_sets, c.card, c.text_card,
            c.temporal_dim, c.norm_eps) == (1024, 6, 16, 2816, 16, 8, 2048, 32000, 4096, 1e-8)
    assert c.step_sets == (*range(8), *range(8)) and c.emb_tables == 8
    assert c.step_tables == (*range(8), *range(7))
    m = DEPFORMER_PRESETS["moshi"]
    assert m.dep_q == 8 and m.step_sets == tuple(range(8)) and m.emb_tables == 7


@pytest.mark.parametrize("change, match", [
    ({"dim": 0}, "DepformerConfig.dim must be a positive int"),
    ({"num_heads": 5}, "divisible by num_heads"),
    ({"weight_sets": 17}, "weight_sets .* at most dep_q"),
    ({"dep_q": 2.0}, "DepformerConfig.dep_q must be a positive int"),
    ({"norm_eps": float("nan")}, "DepformerConfig.norm_eps"),
    ({"norm_eps": 10**400}, "DepformerConfig.norm_eps"),  # past float64: too large, not an OverflowError
    ({"card": True}, "DepformerConfig.card"),
])
def test_config_refuses(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DepformerConfig(), **change)


def test_config_is_framework_free_and_exported():
    import jax_impl

    assert jax_impl.DepformerConfig is DepformerConfig
    with open(sys.modules[DepformerConfig.__module__].__file__) as f:
        source = f.read()
    assert "import jax" not in source and "import torch" not in source


# ----------------------------------------------------------------------------- torch vs moshi
@pytest.mark.parametrize("convention", ["personaplex", "moshi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_matches_moshi_bit_for_bit(convention, dtype):
    cfg = SMALL[convention]
    dep = random_depformer(cfg, dtype)
    lm, model = moshi_lm(cfg, dep.export_weights(), dtype)
    text, out = frame_inputs(cfg, dtype)
    codes, logits = dep(text, out, return_logits=True)
    want_codes, want_logits = moshi_frame(lm, model, text, out)
    assert codes.dtype == torch.int64 and codes.shape == (3, cfg.dep_q)
    assert logits.dtype == torch.float32 and logits.shape == (3, cfg.dep_q, cfg.card)
    assert torch.equal(codes, want_codes) and torch.equal(logits, want_logits)
    assert torch.equal(dep(text, out), codes)
    assert len(set(codes.flatten().tolist())) > 3  # the weights make the steps choose different tokens


def test_teacher_forcing_matches_personaplex():
    cfg, dtype = SMALL["personaplex"], torch.float32
    dep = random_depformer(cfg, dtype, seed=2)
    lm, model = moshi_lm(cfg, dep.export_weights(), dtype)
    text, out = frame_inputs(cfg, dtype)
    g = torch.Generator().manual_seed(3)
    audio = torch.randint(-1, cfg.card + 1, (3, cfg.dep_q), generator=g)
    provided = torch.rand(3, cfg.dep_q, generator=g) < 0.5
    audio[~provided] = -2  # where not provided: not read (PersonaPlex passes its cache's placeholders)
    codes, logits = dep(text, out, audio, provided, return_logits=True)
    want_codes, want_logits = moshi_frame(lm, model, text, out, audio, provided)
    assert torch.equal(codes, want_codes) and torch.equal(logits, want_logits)
    assert not torch.equal(codes, dep(text, out))  # the forcing changed the frame


# ----------------------------------------------------------------------------- loading
def test_load_released_and_moshi_names():
    cfg = SMALL["personaplex"]
    src = random_depformer(cfg, torch.float32, seed=4)
    released = src.export_weights()
    for weights in (released, personaplex_expand(released, cfg),
                    moshi_lm(cfg, released, torch.float32)[1].state_dict()):
        dep = Depformer.from_config(cfg)
        dep.load_weights(weights)
        assert all(torch.equal(a, b) for a, b in zip(dep.weights().values(), src.weights().values()))
    bf16 = Depformer.from_config(cfg, dtype=torch.bfloat16)
    bf16.load_weights({k: v.bfloat16() for k, v in released.items()})
    widened = Depformer.from_config(cfg)
    widened.load_weights(bf16.export_weights())  # bf16 -> f32: exact
    assert torch.equal(widened.in_proj, bf16.in_proj.float())


def _refused(dep, weights, *needles):
    before = {k: v.clone() for k, v in dep.weights().items()}
    with pytest.raises(CheckpointError) as err:
        dep.load_weights(weights)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert all(torch.equal(before[k], v) for k, v in dep.weights().items())  # nothing written


def test_load_refuses_and_changes_nothing():
    cfg = SMALL["personaplex"]
    released = random_depformer(cfg, torch.float32, seed=5).export_weights()
    dep = random_depformer(cfg, torch.float32, seed=6)
    missing = {k: v for k, v in released.items() if not k.startswith("linears.3.")}
    missing["depformer_in.1.weight"] = torch.zeros(3, 3)
    missing["depformer.layers.0.norm1.alpha"] = released["depformer.layers.0.norm1.alpha"].double()
    _refused(dep, missing, "missing: linears.3.weight", "wrong shape: depformer_in.1.weight",
             "wrong dtype: depformer.layers.0.norm1.alpha: float64")
    # a Moshi file (7 audio tables) has no table for inner step 8 of a 16-step depformer
    moshi_file = {k: v for k, v in released.items() if k != "depformer_emb.7.weight"}
    _refused(dep, moshi_file, "missing: depformer_emb.7.weight (the audio table feeding inner step 8)")
    # an expanded file whose set 9 is not a copy of set 1
    expanded = personaplex_expand(released, cfg)
    expanded["linears.9.weight"] = expanded["linears.9.weight"] + 1
    _refused(dep, expanded, "not a copy: linears.9.weight")
    _refused(dep, {**released, "depformer.layers.5.norm1.alpha": released["depformer.layers.0.norm1.alpha"]},
             "unexpected: depformer.layers.5.norm1.alpha")
    narrow = Depformer.from_config(cfg, dtype=torch.bfloat16)
    _refused(narrow, released, "casting float32 to it would narrow it")


# ----------------------------------------------------------------------------- input checks
def test_bad_inputs_raise_clear_errors():
    cfg = SMALL["personaplex"]
    dep = random_depformer(cfg, torch.float32)
    text, out = frame_inputs(cfg, torch.float32)
    audio = torch.zeros(3, cfg.dep_q, dtype=torch.long)
    provided = torch.ones(3, cfg.dep_q, dtype=torch.bool)
    cases = [
        ((text, out[:, :, :5]), ValueError, "transformer_out must have shape"),
        ((text, out.double()), ValueError, "transformer_out must be torch.float32"),
        ((text[:2], out), ValueError, "text_token must have shape \\[3\\]"),
        ((text.float(), out), TypeError, "text_token must be an integer"),
        ((torch.full((3,), cfg.text_card + 1), out), ValueError, "text_token must hold token ids in 0..50 or -1"),
        ((torch.full((3,), -2), out), ValueError, "text_token must hold token ids"),
        ((text, out, audio), ValueError, "audio_tokens and audio_provided go together"),
        ((text, out, audio + cfg.card + 1, provided), ValueError, "audio_tokens \\(where provided\\) must hold"),
        ((text, out, audio, provided.long()), TypeError, "audio_provided must be a torch.bool"),
        ((text, out, audio[:, :3], provided), ValueError, "audio_tokens must have shape"),
        ((text.bool(), out), TypeError, "text_token must be an integer"),
        ((text[:0], out[:0]), ValueError, "transformer_out must have shape \\[B >= 1, 1, 48\\]"),
    ]
    for args, kind, match in cases:
        with pytest.raises(kind, match=match):
            dep(*args)
    # an unsigned dtype is read by its values (uint8 ids compared with -1 as uint8 would wrap)
    ids = text.clamp(min=0)
    assert torch.equal(dep(ids.to(torch.uint8), out), dep(ids, out))
    # uint64's largest value is not -1 (no token), which int64 would read it as
    with pytest.raises(ValueError, match=f"text_token must hold token ids in 0..50 or -1 \\(no token\\), got {2**64 - 1}"):
        dep(torch.full((3,), 2**64 - 1, dtype=torch.uint64), out)
    with pytest.raises(TypeError, match="dtype must be one of"):
        Depformer.from_config(cfg, dtype=torch.float64)
    with pytest.raises(ValueError, match="kernels must be one of"):
        Depformer.from_config(cfg, kernels="fast")


def test_sampled_frame_is_deterministic_and_greedy_at_top1():
    cfg = SMALL["personaplex"]
    dep = random_depformer(cfg, torch.float32)
    text, out = frame_inputs(cfg, torch.float32)
    seeds = torch.tensor([3, 4, 5])
    a = dep(text, out, temperature=0.9, top_k=10, seeds=seeds, counter=7)
    assert torch.equal(a, dep(text, out, temperature=0.9, top_k=10, seeds=seeds, counter=7))
    assert not torch.equal(a, dep(text, out, temperature=0.9, top_k=10, seeds=seeds, counter=8))
    assert torch.equal(dep(text, out, temperature=0.9, top_k=1, seeds=seeds), dep(text, out))
    with pytest.raises(ValueError, match="seeds must be an integer array \\[3\\]"):
        dep(text, out, temperature=0.9)
    with pytest.raises(ValueError, match="seeds must be an integer array \\[3\\]"):
        dep(text, out, temperature=0.9, seeds=seeds.bool())
    with pytest.raises(TypeError, match="counter must be an int or an integer array"):
        dep(text, out, temperature=0.9, seeds=seeds, counter=0.5)
    with pytest.raises(ValueError, match="counter must have shape \\[\\] or \\[3\\]"):
        dep(text, out, temperature=0.9, seeds=seeds, counter=torch.zeros(2, dtype=torch.long))
    # counters are taken mod 2**32, whatever their int or dtype: a uint8 counter is not multiplied in uint8
    assert torch.equal(a, dep(text, out, temperature=0.9, top_k=10, seeds=seeds, counter=7 + 2**32))
    assert torch.equal(dep(text, out, temperature=0.9, seeds=seeds, counter=torch.full((3,), 200, dtype=torch.uint8)),
                       dep(text, out, temperature=0.9, seeds=seeds, counter=200))
    with pytest.raises(ValueError, match="top_k must be an int in 0..40"):
        dep(text, out, temperature=0.9, top_k=41, seeds=seeds)


def test_steps_refused_alike_on_both_sides():
    """`steps` is checked (`check_steps`) on both sides, the scan and the unrolled JAX frame alike: no
    slice from the end, no bool, no empty frame."""
    import jax.numpy as jnp

    import jax_impl as jx

    cfg = SMALL["moshi"]
    dep = random_depformer(cfg, torch.float32)
    params = _jax_params(dep)
    text, out = frame_inputs(cfg, torch.float32)
    jtext, jout = jnp.asarray(text.numpy()), jnp.asarray(out.numpy())
    for steps in (-1, 0, 9, True, 2.0):
        match = f"steps must be an int in 1..8 or None, got {steps!r}"
        with pytest.raises(ValueError, match=re.escape(match)):
            dep(text, out, steps=steps)
        for unroll in (False, True):
            with pytest.raises(ValueError, match=re.escape(match)):
                jx.depformer_frame(cfg, params, jtext, jout, steps=steps, unroll=unroll)
    codes = dep(text, out, steps=3)
    assert codes.shape == (3, 3) and torch.equal(codes, dep(text, out)[:, :3])
    assert np.array_equal(np.asarray(jx.depformer_frame(cfg, params, jtext, jout, steps=3)[0]), codes.numpy())


# ----------------------------------------------------------------------------- JAX vs torch
def _jax_params(dep):
    import jax_impl as jx
    from torch_bridge import to_jax

    return jx.check_depformer_params(dep.config, {k: to_jax(v) for k, v in dep.weights().items()})


@pytest.mark.parametrize("convention", ["personaplex", "moshi"])
def test_jax_matches_torch(convention):
    import jax.numpy as jnp

    import jax_impl as jx

    cfg = SMALL[convention]
    dep = random_depformer(cfg, torch.float32, seed=7)
    params = _jax_params(dep)
    text, out = frame_inputs(cfg, torch.float32, B=4)
    g = torch.Generator().manual_seed(8)
    audio = torch.randint(0, cfg.card, (4, cfg.dep_q), generator=g)
    provided = torch.rand(4, cfg.dep_q, generator=g) < 0.3
    step = jx.make_depformer_step(cfg)
    for forcing in ((), (audio, provided)):
        codes, logits = dep(text, out, *forcing, return_logits=True)
        jcodes, jlogits = step(params, jnp.asarray(text.numpy()), jnp.asarray(out.numpy()),
                               *(jnp.asarray(t.numpy()) for t in forcing))
        assert np.array_equal(np.asarray(jcodes), codes.numpy())
        rel = np.abs(np.asarray(jlogits) - logits.numpy()).max() / np.abs(logits.numpy()).max()
        assert rel < 2e-6, rel  # matmul summation order (XLA vs oneDNN); measured 1.3e-6 and 1.4e-6 here
    sampler = jx.make_depformer_step(cfg, temperature=0.8, top_k=10)
    seeds = torch.tensor([1, 2, 3, 4])
    jcodes, _ = sampler(params, jnp.asarray(text.numpy()), jnp.asarray(out.numpy()), seeds=jnp.asarray(seeds.numpy()),
                        counter=5)
    assert np.array_equal(np.asarray(jcodes), dep(text, out, temperature=0.8, top_k=10, seeds=seeds, counter=5).numpy())


def test_jax_bad_inputs():
    import jax.numpy as jnp

    import jax_impl as jx

    cfg = SMALL["moshi"]
    params = _jax_params(random_depformer(cfg, torch.float32))
    text, out = jnp.zeros(2, jnp.int32), jnp.zeros((2, 1, cfg.temporal_dim))
    step = jx.make_depformer_step(cfg)
    with pytest.raises(ValueError, match="transformer_out must have shape"):
        step(params, text, out[:, :, :3])
    with pytest.raises(ValueError, match="text_token must hold token ids in 0..50 or -1"):
        step(params, text + 51, out)
    with pytest.raises(ValueError, match="transformer_out must be float32"):
        step(params, text, out.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="audio_tokens and audio_provided go together"):
        step(params, text, out, jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="seeds must be an integer array \\[2\\]"):
        jx.make_depformer_step(cfg, temperature=1.0)(params, text, out)
    with pytest.raises(ValueError, match="seeds must be an integer array \\[2\\]"):
        jx.make_depformer_step(cfg, temperature=1.0)(params, text, out, seeds=[1, 2])
    with pytest.raises(ValueError, match="params: wrong shapes: emb"):
        jx.check_depformer_params(cfg, {**params, "emb": params["emb"][:1]})
    # the step checks its params when it is traced: a table of fewer sets would be read clamped
    with pytest.raises(ValueError, match="params: wrong shapes: linears"):
        step({**params, "linears": params["linears"][:1]}, text, out)
    with pytest.raises(ValueError, match="one float dtype"):
        step({**params, "emb": params["emb"].astype(jnp.bfloat16)}, text, out)
    with pytest.raises(ValueError, match="text_token must be an integer array \\[2\\], got list"):
        step(params, [0, 0], out)
    with pytest.raises(ValueError, match="audio_tokens \\(int\\) and audio_provided \\(bool\\)"):
        step(params, text, out, [[0] * 8] * 2, jnp.ones((2, 8), bool))
    with pytest.raises(TypeError, match="counter must be an int or an integer array, got float"):
        step(params, text, out, counter=0.5)
    sampler, seeds = jx.make_depformer_step(cfg, temperature=1.0), jnp.asarray([1, 2])
    assert np.array_equal(sampler(params, text, out, seeds=seeds, counter=5 + 2**32)[0],
                          sampler(params, text, out, seeds=seeds, counter=5)[0])


# ------------------------------------------------------------------------------ construction-time refusals
ODD_HEAD_DIM = dataclasses.replace(SMALL["moshi"], dim=48, num_heads=4)  # head dim 12


def test_twin_depformer_refuses_a_head_dim_not_a_power_of_two_when_built():
    """Depformer(kernels="twin") on head dim 12 is refused by the constructor, naming the stack and its
    head dim (it used to fail at the first frame, in the twin attention); the reference kernels take it."""
    with pytest.raises(ValueError, match=r"^Depformer\(kernels\): kernels='twin' needs power-of-two head dims "
                                         r"\(.*\); the depformer stack's is 12 \(head_dim = dim 48 // num_heads 4\)"):
        Depformer.from_config(ODD_HEAD_DIM, kernels="twin")
    dep = Depformer.from_config(ODD_HEAD_DIM)
    text, out = frame_inputs(ODD_HEAD_DIM, torch.float32)
    assert dep(text, out).shape == (text.shape[0], ODD_HEAD_DIM.dep_q)


def test_jax_depformer_step_refuses_twin_on_a_head_dim_not_a_power_of_two_when_made():
    import jax_impl as jx

    try:
        jx.make_depformer_step(ODD_HEAD_DIM, "twin")
    except ValueError as err:
        assert str(err).startswith("make_depformer_step(kernels): kernels='twin' needs power-of-two head dims")
        assert "the depformer stack's is 12 (head_dim = dim 48 // num_heads 4)" in str(err)
    else:
        raise AssertionError("make_depformer_step(kernels='twin') took head dim 12")
    jx.make_depformer_step(ODD_HEAD_DIM, "reference")
