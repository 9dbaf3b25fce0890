"""LoRA adapters of the temporal stack (`jax_impl.lora`): a fresh adapter leaves the step bit for
bit, an adapted step is the step of the merged weights, gradients reach the adapters (the same with
each layer rematerialized), bad adapters are refused, and the README's fine-tuning example trains."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_impl as jx

TCFG = jx.PRESETS["temporal-small"]
B, T = 2, 3


@pytest.fixture(scope="module")
def params():
    return jx.init_params(TCFG, jax.random.key(0))


def trained_lora(rank: int = 3) -> jx.LoRA:
    """Adapters with every a and b random (a fresh one has b = 0: its a gets no gradient)."""
    lora = jx.init_lora(TCFG, jax.random.key(1), rank)
    keys = iter(jax.random.split(jax.random.key(2), 8))
    return jax.tree.map(lambda a: 0.1 * jax.random.normal(next(keys), a.shape, a.dtype), lora)


def inputs(dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(3), (B, T, TCFG.dim), dtype)
    return jx.init_state(TCFG, B, dtype), x


def test_fresh_adapters_leave_the_step_bit_for_bit(params):
    """B = 0: the adapted linears round the same float32 sums once, on bf16 frozen weights."""
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    state, x = inputs(jnp.bfloat16)
    step = jax.jit(jx.step_fn(TCFG, kernels="reference"))
    (out, logits), new = step(params, state, x)
    (out_l, logits_l), new_l = step(jx.with_lora(params, jx.init_lora(TCFG, jax.random.key(1), 4)), state, x)
    for a, b in ((out, out_l), (logits, logits_l), (new.k, new_l.k), (new.v, new_l.v)):
        assert jnp.array_equal(a, b)


def test_adapted_step_is_the_step_of_the_merged_weights(params):
    """W + scale * B A on the in-projection's q and v rows and the FFN's linears (float32)."""
    lora = trained_lora()
    ad, s = lora.adapters, lora.scale
    delta = {k: s * jnp.einsum("lor,lri->loi", ad[k]["b"], ad[k]["a"]) for k in ad}
    layers = dict(params["params"]["layers"])
    q, k, v = jnp.split(layers["in_proj"].reshape(TCFG.num_layers, 3 * TCFG.dim, TCFG.dim), 3, axis=1)
    layers["in_proj"] = jnp.concatenate([q + delta["q"], k, v + delta["v"]], axis=1).reshape(
        layers["in_proj"].shape)
    for name in ("linear_in", "linear_out"):
        layers[name] = layers[name] + delta[name].reshape(layers[name].shape)
    merged = {"params": {**params["params"], "layers": layers}}
    state, x = inputs()
    step = jax.jit(jx.step_fn(TCFG, kernels="reference"))
    (out_l, logits_l), new_l = step(jx.with_lora(params, lora), state, x)
    (out_m, logits_m), new_m = step(merged, state, x)
    assert not np.allclose(out_l, step(params, state, x)[0][0], atol=1e-3)  # the adapters do something
    np.testing.assert_allclose(out_l, out_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits_l, logits_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_l.v, new_m.v, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_adapter_and_remat_gives_the_same(params):
    """jax.grad through a step: finite and non-zero on every a and b; each layer under jax.checkpoint
    (`remat_layers`) recomputes the same gradients. (Through streamed steps: the README's example.)"""
    lora = trained_lora()
    state, x = inputs()
    targets = jax.random.randint(jax.random.key(4), (B, T), 0, TCFG.text_card)

    def grads(remat):
        step = jx.step_fn(TCFG, kernels="reference", remat_layers=remat)

        def loss(lora):
            (_, logits), _ = step(jx.with_lora(params, lora), state, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, 0], targets).mean()

        return jax.jit(jax.grad(loss))(lora)

    plain, remat = grads(False), grads(True)
    assert isinstance(plain, jx.LoRA) and plain.scale == lora.scale
    for g in jax.tree.leaves(plain):
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), plain, remat)


def test_bad_adapters_are_refused(params):
    state, x = inputs()
    lora = jx.init_lora(TCFG, jax.random.key(1), 2)
    with pytest.raises(ValueError, match="not 'twin'"):
        jx.step_fn(TCFG, kernels="twin")(jx.with_lora(params, lora), state, x)
    wrong = jx.LoRA({**lora.adapters, "v": {"a": lora.adapters["v"]["a"], "b": lora.adapters["q"]["b"][:, :5]}},
                    lora.scale)
    with pytest.raises(ValueError, match=r"lora.adapters\['v'\]\['b'\].*out=64"):
        jx.step_fn(TCFG, kernels="reference")(jx.with_lora(params, wrong), state, x)
    with pytest.raises(TypeError, match="temporal stack only"):
        mcfg = jx.PRESETS["mimi-small"]
        jx.step_fn(mcfg, kernels="reference")(jx.with_lora(jx.init_params(mcfg, jax.random.key(0)), lora),
                                             jx.init_state(mcfg, B), jnp.zeros((B, 2, mcfg.dim)))
    with pytest.raises(TypeError, match=r"init_lora\(config\): adapters apply to the temporal stack only"):
        jx.init_lora(jx.PRESETS["mimi-small"], jax.random.key(1), 2)
    with pytest.raises(ValueError, match="rank"):
        jx.init_lora(TCFG, jax.random.key(1), 0)
    with pytest.raises(ValueError, match="targets"):
        jx.init_lora(TCFG, jax.random.key(1), 2, targets=("q", "k"))
    with pytest.raises(TypeError, match=r"init_lora\(targets\): expected a sequence of target names, got the string"):
        jx.init_lora(TCFG, jax.random.key(1), 2, targets="qv")
    for scale, kind in (("2", TypeError), (True, TypeError), (float("nan"), ValueError), (10**400, ValueError)):
        with pytest.raises(kind, match=r"init_lora\(scale\)"):
            jx.init_lora(TCFG, jax.random.key(1), 2, scale=scale)
    for dtype in (jnp.int32, np.float64):  # float64 without jax_enable_x64 would be made float32
        with pytest.raises(TypeError, match=r"init_lora\(dtype\)"):
            jx.init_lora(TCFG, jax.random.key(1), 2, dtype=dtype)
    step = jx.step_fn(TCFG, kernels="reference")
    extra = jx.LoRA({**lora.adapters, "q": {**lora.adapters["q"], "alpha": 1.0}}, lora.scale)
    with pytest.raises(ValueError, match=r"lora.adapters\['q'\]: expected a dict with the keys 'a' and 'b'"):
        step(jx.with_lora(params, extra), state, x)
    wide = jx.LoRA({**lora.adapters, "q": {k: np.asarray(v, np.float64) for k, v in lora.adapters["q"].items()}},
                   lora.scale)
    with pytest.raises(TypeError, match=r"lora.adapters\['q'\]\['a'\]: float64 needs jax_enable_x64"):
        step(jx.with_lora(params, wide), state, x)
    # adapters under another key would be dropped: the step refuses the key
    with pytest.raises(jx.CheckpointError, match=r"step\(params\): unexpected top-level keys \['LoRA'\]"):
        step({**params, "LoRA": lora}, state, x)
    with pytest.raises(jx.CheckpointError, match=r"variables: unexpected top-level keys \['lora'\]"):
        jx.export_checkpoint(TCFG, jx.with_lora(params, lora))


def test_float64_adapters_are_not_rounded_onto_float32_activations(params):
    """With jax_enable_x64, float64 adapters on a float32 step would be rounded to float32 in the sum."""
    state, x = inputs()
    lora = jx.init_lora(TCFG, jax.random.key(1), 2)
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), lora)
        with pytest.raises(TypeError, match="adapters of float64 on float32 activations would be rounded"):
            jx.step_fn(TCFG, kernels="reference")(jx.with_lora(params, wide), state, x)


def readme_example() -> str:
    """The README's fine-tuning example: the first python block of its section."""
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("## Fine-tuning: LoRA adapters", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_fine_tuning_example_trains_the_adapters_only():
    """The example as written: its loss falls over its 10 AdamW steps, every adapter's b moves off
    zero, and the frozen params are still the ones it made."""
    ns: dict = {}
    exec(compile(readme_example(), "README.md (fine-tuning)", "exec"), ns)  # noqa: S102 (the README's own code)
    losses = ns["losses"]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1, losses
    for ad in ns["lora"].adapters.values():
        assert float(jnp.abs(ad["b"]).max()) > 0
    fresh = jx.init_params(ns["cfg"], jax.random.key(0))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), ns["params"], fresh)
