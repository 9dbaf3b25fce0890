"""The JAX path on its own: pure state functions, compile-once, in-place rings, validation,
weights I/O, gradients (float64 finite differences), vmap, overflow guard."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl as jx
from jax_impl.checkpoint import CheckpointError
from jax_impl.config import PRESETS, TemporalConfig, with_options
from jax_impl.ops import pick_kernels
from jax_impl.tables import rope_freqs
from kernels_pallas.contract.numerics import INT32_MAX

TCFG = PRESETS["temporal-small"]
MCFG = PRESETS["mimi-small"]
B = 3
EPS = 1e-6  # central finite differences in float64


@pytest.fixture(scope="module")
def tparams():
    return jx.init_params(TCFG, jax.random.key(0))


@pytest.fixture(scope="module")
def mparams():
    return jx.init_params(MCFG, jax.random.key(1))


# ------------------------------------------------------------------------------ state functions
class TestStateFunctions(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_recycling_semantics(self):
        s = jx.init_state(TCFG, 4)
        chex.assert_shape([s.k, s.v], (2, 4, 4, 24, 16))
        assert s.offset.dtype == jx.state.index_dtype() == jnp.int32
        s = s._replace(offset=jnp.array([5, 7, 0, 3], jnp.int32), start_offset=jnp.array([1, 0, 0, 3], jnp.int32))
        reset_slot = self.variant(jx.reset_slot)
        bump = self.variant(jx.bump_slot_start)
        reset_rows = self.variant(jx.reset_rows)
        s1 = reset_slot(s, jnp.int32(1))
        np.testing.assert_array_equal(s1.start_offset, [1, 7, 0, 3])
        s2 = bump(s, jnp.int32(0))
        np.testing.assert_array_equal(s2.start_offset, [2, 0, 0, 3])
        s3 = reset_rows(s, jnp.array([True, False, False, True]))
        np.testing.assert_array_equal(s3.offset, [0, 7, 0, 0])
        np.testing.assert_array_equal(s3.start_offset, [0, 0, 0, 0])
        chex.assert_trees_all_equal_shapes_and_dtypes(s, s1, s2, s3)
        s4 = self.variant(jx.reset_streaming)(s._replace(k=s.k + 1))
        assert not np.asarray(s4.k).any() and not np.asarray(s4.offset).any()

    def test_traced_out_of_range_is_noop_and_concrete_raises(self):
        s = jx.init_state(TCFG, 2)._replace(offset=jnp.array([3, 3], jnp.int32))
        out = jax.jit(jx.reset_slot)(s, jnp.int32(5))
        np.testing.assert_array_equal(out.start_offset, [0, 0])
        with pytest.raises(IndexError, match="b=5 is out of range"):
            jx.reset_slot(s, 5)
        with pytest.raises(TypeError, match="b must be an integer"):
            jx.reset_slot(s, 1.0)
        # start_offset == offset: the bump is still a plain += 1 (the sacrifice tick), no refusal
        np.testing.assert_array_equal(jx.bump_slot_start(s._replace(start_offset=s.offset), 0).start_offset, [4, 3])
        with pytest.raises(ValueError, match=r"mask must have shape \[2\]"):
            jx.reset_rows(s, jnp.array([True]))
        with pytest.raises(TypeError, match="mask must be a bool"):
            jx.reset_rows(s, jnp.array([1, 0]))


# ------------------------------------------------------------------------------ compile once
def test_thousands_of_steps_compile_once(tparams):
    traces = []

    def counted(params, state, x, active):
        traces.append(1)  # runs only while tracing
        return jx.step_fn(TCFG)(params, state, x, active)

    step = jax.jit(counted, donate_argnums=(1,))
    rs, bump, rr = (jax.jit(f, donate_argnums=(0,)) for f in (jx.reset_slot, jx.bump_slot_start, jx.reset_rows))
    # jit executables are cached per wrapped function, shared with other tests' jits of it: count growth
    before = [f._cache_size() for f in (rs, bump, rr)]
    rng = np.random.default_rng(0)
    state = jx.init_state(TCFG, B)
    x = jnp.asarray(rng.standard_normal((16, B, 1, TCFG.dim)), jnp.float32)
    actives = jnp.asarray(rng.random((16, B)) < 0.7)
    for i in range(2000):
        (_, logits), state = step(tparams, state, x[i % 16], actives[i % 7])
        if i % 13 == 0:
            state = rs(state, jnp.int32(i % B))
        if i % 17 == 0:
            state = bump(state, jnp.int32(i % B))
        if i % 101 == 0:
            state = rr(state, actives[i % 5])
    assert len(traces) == 1
    assert step._cache_size() == 1
    assert all(f._cache_size() - n <= 1 for f, n in zip((rs, bump, rr), before))
    assert np.isfinite(np.asarray(logits)).all()


# ------------------------------------------------------------------------------ in place
def test_donated_ring_is_updated_in_place():
    cfg = with_options(TCFG, num_layers=2, context=64)
    params = jx.init_params(cfg, jax.random.key(0))
    state = jx.init_state(cfg, 2)
    x, active = jnp.ones((2, 1, cfg.dim)), jnp.array([True, False])
    ring = f"f32[{','.join(map(str, state.k.shape))}]"
    for loop in ("scan", "python"):
        donated = jax.jit(jx.step_fn(cfg, layer_loop=loop), donate_argnums=(1,))
        hlo = donated.lower(params, state, x, active).compile().as_text()
        # 1) the compiled program aliases outputs to the donated k and v (and offsets) buffers,
        aliases = re.search(r"input_output_alias=\{([^\n]*)\}", hlo)
        assert aliases and len(re.findall(r"may-alias|must-alias", aliases.group(1))) >= 3, hlo[:400]
        # 2) and copies no full ring (only T slots per layer are scattered);
        assert not [ln for ln in hlo.splitlines() if " copy(" in ln and ring in ln]
        # the same program without donation must copy the rings (so the check above means something).
        plain = jax.jit(jx.step_fn(cfg, layer_loop=loop)).lower(params, state, x, active).compile().as_text()
        assert [ln for ln in plain.splitlines() if " copy(" in ln and ring in ln]
    # 3) at run time the returned ring lives in the donated buffer.
    step = jx.make_step(cfg)
    state = jx.init_state(cfg, 2)
    _, state = step(params, state, x, active)
    ptr_k, ptr_v = state.k.unsafe_buffer_pointer(), state.v.unsafe_buffer_pointer()
    old = state
    _, state = step(params, state, x, active)
    assert old.k.is_deleted() and state.k.unsafe_buffer_pointer() == ptr_k
    assert state.v.unsafe_buffer_pointer() == ptr_v


# ------------------------------------------------------------------------------ validation
def test_bad_inputs_raise_naming_the_argument(tparams):
    step = jx.step_fn(TCFG)
    state = jx.init_state(TCFG, B)
    x = jnp.zeros((B, 1, TCFG.dim))
    with pytest.raises(ValueError, match=r"step\(x\): x must have shape \[B=3, T, dim=64\]"):
        step(tparams, state, jnp.zeros((B, 1, 8)), None)
    with pytest.raises(ValueError, match=r"step\(x\): T = x.shape\[1\] must be in 1..capacity=24"):
        step(tparams, state, jnp.zeros((B, 25, TCFG.dim)), None)
    with pytest.raises(TypeError, match=r"step\(x\): x has dtype int32"):  # bf16 x would widen exactly: taken
        step(tparams, state, x.astype(jnp.int32), None)
    with pytest.raises(TypeError, match=r"step\(active\): active must be a bool"):
        step(tparams, state, x, jnp.ones((B,), jnp.int32))
    with pytest.raises(ValueError, match=r"step\(active\): active must have shape \[3\]"):
        step(tparams, state, x, jnp.ones((2,), bool))
    bad = {"params": {**tparams["params"], "extra": jnp.zeros(3),
                      "layers": {k: v for k, v in tparams["params"]["layers"].items() if k != "in_proj"}}}
    bad["params"]["text_linear"] = jnp.zeros((5, 64))
    with pytest.raises(CheckpointError) as e:
        jax.jit(step)(bad, state, x, None)
    msg = str(e.value)
    assert "missing: layers/in_proj" in msg and "unexpected: extra" in msg and "wrong shape: text_linear" in msg
    with pytest.raises(CheckpointError, match="wrong dtype"):
        step(jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tparams), state, x, None)
    with pytest.raises(ValueError, match=r"step\(state\): rings must be"):
        step(tparams, jx.init_state(MCFG, B), x, None)
    with pytest.raises(TypeError, match=r"init_state\(dtype\): float64 needs jax_enable_x64"):
        jx.init_state(TCFG, B, jnp.float64)  # without x64, JAX would make float32 rings
    jitted = jx.make_step(TCFG)
    jitted(tparams, state, x)  # donates state
    with pytest.raises(ValueError, match=r"step\(state\): the state was donated to an earlier call"):
        jitted(tparams, state, x)


# ------------------------------------------------------------------------------ weights
def test_weights_io(tmp_path, tparams, mparams):
    ck = jx.export_checkpoint(TCFG, tparams)
    back = jx.params_from_checkpoint(TCFG, ck)
    chex.assert_trees_all_equal(back, tparams)
    path = tmp_path / "m.safetensors"
    jx.save_safetensors(MCFG, mparams, path, "encoder_transformer")
    chex.assert_trees_all_equal(jx.load_safetensors(MCFG, path, "encoder_transformer"), mparams)
    flat = jx.weights.stacked_weights(TCFG, tparams)
    chex.assert_trees_all_equal(jx.params_from_stacked(TCFG, {k: np.asarray(v) for k, v in flat.items()}), tparams)
    # one error listing every problem
    bad = dict(ck)
    del bad["transformer.layers.0.self_attn.in_proj_weight"]
    bad["transformer.layers.9.foo"] = np.zeros(1)
    bad["out_norm.alpha"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError) as e:
        jx.params_from_checkpoint(TCFG, bad)
    assert str(e.value).count("\n") == 3
    with pytest.raises(CheckpointError, match="missing: in_proj"):
        jx.params_from_stacked(TCFG, {k: v for k, v in flat.items() if k != "in_proj"})
    bf = jx.params_from_checkpoint(TCFG, {k: v.astype(jnp.bfloat16) for k, v in ck.items()})
    assert jax.tree_util.tree_leaves(bf)[0].dtype == jnp.bfloat16
    wide = jx.params_from_checkpoint(TCFG, {k: v.astype(jnp.bfloat16) for k, v in ck.items()}, dtype=jnp.float32)
    assert jax.tree_util.tree_leaves(wide)[0].dtype == jnp.float32
    with pytest.raises(CheckpointError, match="would narrow"):
        jx.params_from_checkpoint(TCFG, ck, dtype=jnp.bfloat16)


# ------------------------------------------------------------------------------ research use
def _x64():
    return jax.enable_x64(True)


def test_grad_matches_finite_differences_float64():
    cfg = TemporalConfig(dim=8, num_layers=2, num_heads=2, hidden=12, context=3, text_card=5)
    with _x64():
        params = jx.init_params(cfg, jax.random.key(0), jnp.float64)
        params = jax.tree_util.tree_map(lambda a: a * 10 if a.ndim >= 2 else a, params)  # livelier
        rng = np.random.default_rng(0)
        xs, wts = (jnp.asarray(rng.standard_normal((4, 2, 1, cfg.dim))) for _ in range(2))
        actives = jnp.array([[True, True], [True, False], [False, True], [True, True]])
        step = jx.step_fn(cfg)

        def loss(params, xs):
            def one(state, inputs):  # 4 steps: through the ring (context 3: wraps) and an inactive row
                x, active, wt = inputs
                (out, logits), state = step(params, state, x, active)
                return state, jnp.sum(out * wt) + 0.1 * jnp.sum(jnp.tanh(logits))

            # a scan over the steps: one step to compile (and differentiate), not four
            return jnp.sum(jax.lax.scan(one, jx.init_state(cfg, 2, jnp.float64), (xs, actives, wts))[1])

        g_p, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, xs)
        f = jax.jit(loss)
        # jitted once each (not an eager op per leaf): the shifted inputs, the directional derivative
        shift = jax.jit(lambda p, x, up, ux, s: (jax.tree_util.tree_map(lambda a, u: a + s * u, p, up), x + s * ux))
        along = jax.jit(lambda up, ux: sum(jnp.vdot(g, u) for g, u in zip(jax.tree_util.tree_leaves(g_p),
                                                                         jax.tree_util.tree_leaves(up)))
                        + jnp.vdot(g_x, ux))
        for _ in range(3):
            up = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), params)
            ux = jnp.asarray(rng.standard_normal(xs.shape))
            plus, minus = (f(*shift(params, xs, up, ux, s)) for s in (EPS, -EPS))
            fd = (plus - minus) / (2 * EPS)
            an = along(up, ux)
            assert abs(float(fd) - float(an)) <= 1e-6 * max(1.0, abs(float(an))), (float(fd), float(an))
        assert jx.init_state(cfg, 1).offset.dtype == jnp.int64
    assert jx.init_state(cfg, 1).offset.dtype == jnp.int32  # x64 left off for the other tests


def test_vmap_over_sessions_equals_one_big_batch(mparams):
    step = jx.step_fn(MCFG)
    G, b = 3, 2
    x = jax.random.normal(jax.random.key(3), (G, b, 2, MCFG.dim))
    active = jnp.array([[True, False], [True, True], [False, True]])
    states = jax.vmap(lambda _: jx.init_state(MCFG, b))(jnp.arange(G))
    vstep = jax.jit(jax.vmap(step, in_axes=(None, 0, 0, 0)))
    big = jax.jit(step)
    bstate = jx.init_state(MCFG, G * b)
    for _ in range(3):
        vo, states = vstep(mparams, states, x, active)
        bo, bstate = big(mparams, bstate, x.reshape(G * b, 2, -1), active.reshape(-1))
        np.testing.assert_allclose(np.asarray(vo).reshape(G * b, 2, -1), np.asarray(bo), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(states.offset).reshape(-1), np.asarray(bstate.offset))


def test_layer_loops_and_fused_rope_agree(tparams):
    state = jx.init_state(TCFG, B)
    x = jax.random.normal(jax.random.key(4), (B, 1, TCFG.dim))
    a = jnp.array([True, False, True])
    (o1, _), s1 = jax.jit(jx.step_fn(TCFG))(tparams, state, x, a)
    (o2, _), s2 = jax.jit(jx.step_fn(TCFG, layer_loop="python"))(tparams, state, x, a)
    (o3, _), _ = jax.jit(jx.step_fn(TCFG, exact_rope=False))(tparams, state, x, a)
    np.testing.assert_allclose(o1, o2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s1.k, s2.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o1, o3, rtol=1e-5, atol=1e-5)


def test_bfloat16_and_mimi_step(mparams):
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), mparams)
    step = jx.make_step(MCFG)
    state = jx.init_state(MCFG, B, jnp.bfloat16)
    out, state = step(params, state, jnp.ones((B, 10, MCFG.dim), jnp.bfloat16), None)
    assert out.dtype == jnp.bfloat16 and state.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(state.offset, [10, 10, 10])
    tables = jx.step_tables(MCFG, state.offset, state.start_offset, jnp.ones((B,), bool), 2)
    assert tables.cos.dtype == jnp.float32


def test_overflow_guard_refuses_before_stepping(tparams):
    s = jx.Streamer(TCFG, tparams, 2)
    near = INT32_MAX - 2
    s.state = s.state._replace(offset=jnp.full((2,), near, jnp.int32), start_offset=jnp.full((2,), near, jnp.int32))
    s.offset_bound = near
    x = jnp.ones((2, 1, TCFG.dim))
    s.step(x)
    s.step(x)  # offset reaches 2**31 - 1: the last representable position
    np.testing.assert_array_equal(s.state.offset, [INT32_MAX] * 2)
    before = s.state
    with pytest.raises(OverflowError, match="2147483648 > 2147483647"):
        s.step(x)
    assert s.state is before and not before.k.is_deleted()
    s.reset_rows(np.array([True, True]))
    assert s.offset_bound == 0
    s.step(x)
    s.reset_slot(0)
    s.bump_slot_start(0)  # the sacrifice tick: start_offset past offset, no refusal
    np.testing.assert_array_equal(s.state.start_offset - s.state.offset, [1, -1])
    with pytest.raises(IndexError):
        s.reset_slot(2)


def test_vmap_over_the_states_batch_axes_as_the_readme_says(tparams, tmp_path):
    """The README's recipe: one session's step mapped over the rows of a state with
    in_axes StreamState(k=1, v=1, offset=0, start_offset=0) steps as the batched step does; the
    outputs are out [B, T, dim], text_logits [B, 1, T, text_card]; the pure-JAX snapshot API
    round-trips the state through memory and a file."""
    axes = jx.StreamState(k=1, v=1, offset=0, start_offset=0)
    step = jx.step_fn(TCFG)

    def one_session(params, row, x, active):
        state = jax.tree.map(jnp.expand_dims, row, axes)
        (out, logits), state = step(params, state, x[None], active[None])
        return (out[0], logits[0]), jax.tree.map(jnp.squeeze, state, axes)

    per_session = jax.jit(jax.vmap(one_session, in_axes=(None, axes, 0, 0), out_axes=((0, 0), axes)))
    batched = jax.jit(step)
    mapped = state = jx.init_state(TCFG, B)
    for t in range(TCFG.context + 3):  # past a ring wrap, one row idle each step
        x = jax.random.normal(jax.random.key(t), (B, 1, TCFG.dim))
        active = jnp.arange(B) != t % B
        (out, logits), mapped = per_session(tparams, mapped, x, active)
        (out_b, logits_b), state = batched(tparams, state, x, active)
        np.testing.assert_allclose(out, out_b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(logits, logits_b, rtol=1e-6, atol=1e-6)
    chex.assert_shape(out, (B, 1, TCFG.dim))
    chex.assert_shape(logits, (B, 1, 1, TCFG.text_card))
    chex.assert_shape(mapped.k, (TCFG.num_layers, B, TCFG.num_heads, TCFG.capacity, TCFG.head_dim))
    for name in ("offset", "start_offset"):
        assert jnp.array_equal(getattr(mapped, name), getattr(state, name))
    snap = jx.state_snapshot(TCFG, state)
    jx.write_stream(TCFG, state, tmp_path / "s.safetensors")
    for back in (jx.state_from_snapshot(TCFG, snap),
                 jx.state_from_snapshot(TCFG, jx.read_stream(tmp_path / "s.safetensors"))):
        for a, b in zip(back, state, strict=True):
            assert jnp.array_equal(a, b)


def test_step_docstrings_list_every_kernels_value():
    from jax_impl.kernel_choice import JAX_KERNELS

    for fn in (jx.step_fn, jx.make_step):
        assert all(f'"{k}"' in fn.__doc__ for k in JAX_KERNELS), fn.__name__


def test_jax_steps_refuse_torch_tensors_by_name(tparams):
    """A torch tensor given to a JAX step is refused naming the argument (jit's own error named neither
    the argument nor the remedy); `to_jax` shares it without a copy. The steps' outputs are JAX arrays."""
    import torch

    from jax_impl import codec as jc
    from jax_impl import depformer as jd
    from jax_impl import frame as jf
    from jax_impl import speech_frame as jsf
    from jax_impl.speech_frame_config import SPEECH_PRESETS
    from torch_bridge.speech_frame import SpeechFrame

    SPEECH = SPEECH_PRESETS["moshi-tiny"]
    speech = SpeechFrame.from_config(SPEECH)
    lm, codec = SPEECH.lm, SPEECH.codec
    lm_params, codec_params = speech.jax_params().lm, speech.jax_params().codec
    n = 2
    flags, ints = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int32)
    encode, decode = jc.make_codec_step(codec)
    cases = [
        (lambda: jx.make_step(TCFG)(tparams, jx.init_state(TCFG, n), torch.zeros(n, 1, TCFG.dim)), "step(x)"),
        (lambda: jx.make_step(TCFG)(tparams, jx.init_state(TCFG, n), np.zeros((n, 1, TCFG.dim), np.float32), flags),
         "step(active)"),
        (lambda: jf.make_frame_step(lm)(lm_params, jf.init_frame_state(lm, n),
                                        torch.zeros(n, lm.user_codebooks, dtype=torch.int32)), "user_tokens"),
        (lambda: jd.make_depformer_step(lm.depformer)(lm_params["depformer"], ints,
                                                       np.zeros((n, 1, lm.depformer.temporal_dim), np.float32)),
         "text_token"),
        (lambda: encode(codec_params, jc.init_codec_state(codec, n), np.zeros((n, 1, codec.frame_size), np.float32),
                        flags), "encode(active)"),
        (lambda: decode(codec_params, jc.init_codec_state(codec, n), ints[:, None].expand(n, codec.num_codebooks)),
         "decode(codes)"),
        (lambda: jsf.make_speech_frame_step(SPEECH)(speech.jax_params(), jsf.init_speech_frame_state(SPEECH, n),
                                                   np.zeros((n, 1, SPEECH.frame_size), np.float32), flags),
         "step(active)"),
    ]
    for call, name in cases:
        with pytest.raises(TypeError, match=re.escape(f"{name}: expected a JAX or numpy array, got torch.Tensor "
                                                      "(torch_bridge.to_jax shares a tensor with JAX)")):
            call()


# ------------------------------------------------------------------------------ construction-time refusals
ODD_HEAD_DIMS = {"temporal": with_options(TCFG, dim=48, num_heads=4), "mimi": with_options(MCFG, dim=24, num_heads=2)}


@pytest.mark.parametrize("name", ["temporal", "mimi"])
@pytest.mark.parametrize("kernels", ["twin", "pallas"])
def test_steps_refuse_twin_and_pallas_on_a_head_dim_not_a_power_of_two_when_made(name, kernels):
    """kernels "twin" and "pallas" (the Pallas ring attention) take power-of-two head dims only: every
    maker refuses head dim 12 up front, naming itself, the stack and its head dim, before any state
    or compile (the step used to fail at its first call, inside the kernel)."""
    config = ODD_HEAD_DIMS[name]
    stack = "temporal" if name == "temporal" else "Mimi transformer"
    for where, make in (("make_step", lambda: jx.make_step(config, kernels=kernels)),
                        ("step_fn", lambda: jx.step_fn(config, kernels=kernels)),
                        ("Streamer", lambda: jx.Streamer(config, None, B, kernels=kernels))):
        with pytest.raises(ValueError, match=rf"^{where}\(kernels\): kernels='{kernels}' needs power-of-two head "
                                             rf"dims \(.*\); the {stack} stack's is 12 \(head_dim = dim"):
            make()


@pytest.mark.parametrize("name", ["temporal", "mimi"])
def test_auto_and_reference_steps_run_a_head_dim_not_a_power_of_two(name):
    """"auto" falls back to "reference" where the Pallas kernels do not apply: an odd head dim steps."""
    config = ODD_HEAD_DIMS[name]
    params = jx.init_params(config, jax.random.key(0))
    x = np.ones((B, 1, config.dim), np.float32)
    for kernels in ("auto", "reference"):
        outputs, state = jx.make_step(config, kernels=kernels)(params, jx.init_state(config, B), x)
        assert np.all(np.isfinite(np.asarray(jax.tree.leaves(outputs)[0])))
        np.testing.assert_array_equal(state.offset, [1] * B)


def test_stack_functions_refuse_a_config_of_another_type_with_a_type_error():
    """A frame's or a codec's config where a stack's is expected: TypeError naming the function and the
    argument (it used to be an AttributeError from deep inside)."""
    from jax_impl.codec_config import CODEC_PRESETS
    from jax_impl.frame_config import FRAME_PRESETS

    frame, codec = FRAME_PRESETS["moshi-small"], CODEC_PRESETS["mimi-tiny"]
    for where, call in (("init_state", lambda c: jx.init_state(c, B)),
                        ("init_params", lambda c: jx.init_params(c, jax.random.key(0))),
                        ("make_step", jx.make_step), ("step_fn", jx.step_fn), ("stack_module", jx.stack_module),
                        ("Streamer", lambda c: jx.Streamer(c, None, B))):
        for bad in (frame, codec):
            with pytest.raises(TypeError, match=rf"^{where}\(config\): config must be a TemporalConfig or a "
                                                rf"MimiConfig \(a stack's config\), got {type(bad).__name__}$"):
                call(bad)


def test_a_ring_no_device_holds_is_refused_before_xla_sees_its_shape():
    """A shape whose size overflows ended the process inside XLA (absl: overflow in static extent
    product); every field within int32, the product is checked first."""
    config = with_options(TCFG, context=2**31 - 1, num_layers=2**20)
    with pytest.raises(ValueError, match=r"init_state\(batch_size\): a ring of \[1048576, 1048576, 4, 2147483647, 16\] float32 "
                                         r"\(batch_size 1048576\) is more bytes than any device holds"):
        jx.init_state(config, 2**20)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 JAX devices: run with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=2 (bash run.sh test sets it)")
def test_streamer_refuses_a_state_over_several_devices(tparams):
    """jx.Streamer took a state split over devices and stepped and recycled it with XLA gathering the
    whole ring across them; it is ShardedStreamer's (the sessions step and recycle ops), which still
    takes it. Streamer itself keeps a state on one device, where convert() can move it too."""
    from jax_impl import sharding as sh

    mesh = sh.session_mesh()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    for device in (sh.session_shardings(mesh), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())):
        with pytest.raises(ValueError, match=r"^Streamer\(device\): the state would span 2 devices; .*use "
                                             r"jax_impl\.sharding\.ShardedStreamer"):
            jx.Streamer(TCFG, tparams, 2, device=device)
    s = jx.Streamer(TCFG, tparams, 2, device=jx.StreamState(*[one] * 4))
    x = np.ones((2, 1, TCFG.dim), np.float32)
    s.step(x)
    before = jax.tree.map(np.array, s.state)
    with pytest.raises(ValueError, match=r"^convert\(device\): the state would span 2 devices"):
        s.convert(tparams, device=sh.session_shardings(mesh).k)
    assert s.state.k.devices() == {jax.devices()[1]}
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), s.state, before)))
    sharded = sh.ShardedStreamer(TCFG, tparams, 2, mesh=mesh)
    sharded.step(x)
    sharded.reset_slot(1)
    assert len(sharded.state.k.sharding.device_set) == 2
    assert np.asarray(sharded.state.start_offset).tolist() == [0, 1]


def _state_makers():
    """(the name a refusal carries, make(n), read() -> the batch size made; read None where nothing is
    kept) of every state maker, both sides."""
    from jax_impl import codec as jc
    from jax_impl import frame as jf
    from jax_impl import speech_frame as jsf
    from jax_impl.speech_frame_config import SPEECH_PRESETS
    from torch_bridge import MimiTransformer, TemporalStreaming
    from torch_bridge.codec import MimiCodec
    from torch_bridge.frame import LMFrame
    from torch_bridge.speech_frame import SpeechFrame

    speech = SPEECH_PRESETS["moshi-tiny"]
    stack, mimi = TemporalStreaming.from_config(TCFG), MimiTransformer.from_config(MCFG)
    frame, codec, whole = LMFrame.from_config(speech.lm), MimiCodec.from_config(speech.codec), SpeechFrame.from_config(speech)
    return [
        ("init_state", lambda n: jx.init_state(TCFG, n).batch_size, None),
        ("init_frame_state", lambda n: jf.init_frame_state(speech.lm, n).batch_size, None),
        ("init_codec_state", lambda n: jc.init_codec_state(speech.codec, n).batch_size, None),
        ("init_speech_frame_state", lambda n: jsf.init_speech_frame_state(speech, n).batch_size, None),
        ("TemporalStreaming.streaming_init", stack.streaming_init, lambda: stack.state.batch_size),
        ("MimiTransformer.streaming_init", mimi.streaming_init, lambda: mimi.state.batch_size),
        ("LMFrame.streaming_init", frame.streaming_init, lambda: frame.batch_size),
        ("MimiCodec.streaming_init", codec.streaming_init, lambda: codec.state.batch_size),
        ("SpeechFrame.streaming_init", whole.streaming_init, lambda: whole.batch_size),
    ]


def test_every_state_maker_takes_one_batch_size_rule():
    """`config.check_batch_size`, on both sides: a Python or numpy integer >= 1, not a bool, named by the
    maker refusing it; a refused streaming_init leaves the stream it had."""
    for name, make, read in _state_makers():
        for n in (2, np.int64(2), np.int32(2), np.uint8(2)):
            made = make(n) if read is None else (make(n), read())[1]
            assert made == 2 and type(made) is int, name
        for bad in (0, -1, np.int64(0), True, np.bool_(True), 2.0, np.float32(2), "2", None):
            with pytest.raises(ValueError, match=rf"^{re.escape(name)}\(batch_size\): batch_size must be a positive int "
                                                 r"\(a Python or numpy integer, not a bool\), got "):
                make(bad)
        assert read is None or read() == 2, name


# ------------------------------------------------------------------------------ step options
def test_rope_freqs_is_checked_where_the_step_is_made(tparams):
    """rope_freqs must be None or head_dim/2 finite numbers: a 1-entry table was broadcast (other
    outputs), a 3-entry one failed at the first step, a list or array failed in the step cache
    ("unhashable"). A list or float32 array is taken as the tuple of its exact values."""
    table = rope_freqs(TCFG.head_dim, TCFG.max_period)  # float32 [8]
    makers = {"make_step": lambda f: jx.make_step(TCFG, kernels="reference", rope_freqs=f),
              "step_fn": lambda f: jx.step_fn(TCFG, rope_freqs=f),
              "stack_module": lambda f: jx.stack_module(TCFG, rope_freqs=f),
              "Streamer": lambda f: jx.Streamer(TCFG, tparams, 2, rope_freqs=f)}
    for where, make in makers.items():
        for bad in ((1.0,), (1.0, 0.5, 0.25), (float("nan"),) * 8, np.ones((2, 4), np.float32)):
            with pytest.raises((ValueError, TypeError), match=rf"^{where}\(rope_freqs\): expected"
                                                              r"|entry 0 must be a finite"):
                make(bad)
        for bad in ("abcdefgh", ("a",) * 8, np.arange(8)):
            with pytest.raises(TypeError, match=rf"^{where}\(rope_freqs\): "):
                make(bad)
    step = jx.make_step(TCFG, kernels="reference", rope_freqs=tuple(table.tolist()))
    assert jx.make_step(TCFG, kernels="reference", rope_freqs=list(table)) is step
    assert jx.make_step(TCFG, kernels="reference", rope_freqs=table) is step
    x = np.ones((2, 1, TCFG.dim), np.float32)
    (out, _), _ = step(tparams, jx.init_state(TCFG, 2), x)
    (default, _), _ = jx.make_step(TCFG, kernels="reference")(tparams, jx.init_state(TCFG, 2), x)
    np.testing.assert_array_equal(out, default)
    s = jx.Streamer(TCFG, tparams, 2)
    with pytest.raises(ValueError, match=r"^convert\(rope_freqs\): expected head_dim/2 = 8 frequencies, got 1$"):
        s.convert(tparams, rope_freqs=(0.5,))
    assert s._step_options["rope_freqs"] is None


def test_bool_and_capture_options_are_type_checked(tparams):
    """A string where a bool is expected acted as True (donate="False" donated), a string or misspelt
    capture captured nothing, a list capture or layer_loop failed in the step cache ("unhashable")."""
    for kw, err, msg in (({"donate": "False"}, TypeError, r"make_step\(donate\): expected a bool, got str"),
                         ({"exact_rope": "False"}, TypeError, r"make_step\(exact_rope\): expected a bool"),
                         ({"capture": "intermediates"}, TypeError, r"make_step\(capture\): expected a tuple"),
                         ({"capture": ("intermediate",)}, ValueError,
                          r"make_step\(capture\): a stack sows only into \['intermediates'\], got \['intermediate'\]"),
                         ({"layer_loop": ["scan"]}, ValueError, r"layer_loop must be one of")):
        with pytest.raises(err, match=msg):
            jx.make_step(TCFG, **kw)
    with pytest.raises(TypeError, match=r"^step_fn\(remat_layers\): expected a bool, got str 'no'"):
        jx.step_fn(TCFG, remat_layers="no")
    with pytest.raises(TypeError, match=r"^Streamer\(exact_rope\): expected a bool"):
        jx.Streamer(TCFG, tparams, 2, exact_rope="False")
    x = np.ones((2, 1, TCFG.dim), np.float32)
    state = jx.init_state(TCFG, 2)
    _, _, captured = jx.make_step(TCFG, donate=np.bool_(False), capture=["intermediates"])(tparams, state, x)
    assert not state.k.is_deleted()
    assert captured["intermediates"]["tables"][0].end_offset.tolist() == [1, 1]


def test_stack_modules_check_kernels_and_head_dims_where_made(mparams):
    """The Flax stacks ran the reference layer for any kernels value ("bogus", "auto", None); they take
    the names they run ("auto" is the step's to resolve) and refuse a head dim their kernels do not take."""
    for bad in ("bogus", "auto", None):
        with pytest.raises(ValueError, match=r"^stack_module\(kernels\): kernels must be one of "
                                             r"\['reference', 'pallas', 'twin'\]"):
            jx.stack_module(MCFG, kernels=bad)
        with pytest.raises(ValueError, match=r"^MimiStack\(kernels\): kernels must be one of"):
            jx.MimiStack(MCFG, kernels=bad)
    with pytest.raises(ValueError, match=r"^stack_module\(kernels\): kernels='twin' needs power-of-two head dims"):
        jx.stack_module(ODD_HEAD_DIMS["mimi"], kernels="twin")
    with pytest.raises(ValueError, match=r"^TemporalStack\(kernels\): kernels='pallas' needs power-of-two"):
        jx.TemporalStack(ODD_HEAD_DIMS["temporal"], kernels="pallas")
    s, x = jx.init_state(MCFG, 2), jnp.ones((2, 1, MCFG.dim))
    assert jx.stack_module(MCFG, kernels="reference").apply(mparams, s, x, None)[0].shape == (2, 1, MCFG.dim)


def test_options_the_kernels_would_ignore_are_refused():
    """remat_layers=True on "twin" (its layer program ran without jax.checkpoint) and exact_rope=False on
    "pallas" / "twin" (their RoPE is exact always) were accepted and ignored."""
    with pytest.raises(ValueError, match=r"^step_fn\(remat_layers, kernels\): remat_layers=True .*kernels='twin'"):
        jx.step_fn(TCFG, kernels="twin", remat_layers=True)
    for kernels in ("pallas", "twin"):
        for make in (jx.make_step, jx.step_fn, jx.stack_module):
            with pytest.raises(ValueError, match=rf"^{make.__name__}\(exact_rope, kernels\): exact_rope=False .*"
                                                 rf"kernels='{kernels}'"):
                make(TCFG, kernels=kernels, exact_rope=False)
    assert pick_kernels("auto", TCFG, 2, 1, exact_rope=False) == "reference"
    jx.step_fn(TCFG, kernels="auto", exact_rope=False)
    jx.step_fn(TCFG, kernels="pallas", remat_layers=True)


def test_streamer_refuses_adapters_its_step_would_refuse_when_made(tparams, mparams):
    """LoRA adapters with kernels="twin", or on the Mimi stack, were refused only when the step was
    first traced; Streamer refuses them where it takes the params."""
    lora = jx.init_lora(TCFG, jax.random.key(2), rank=2)
    with pytest.raises(ValueError, match=r"^lora: adapters run on kernels 'reference' or 'pallas', not 'twin'"):
        jx.Streamer(TCFG, jx.with_lora(tparams, lora), 2, kernels="twin")
    with pytest.raises(TypeError, match=r"^lora: adapters apply to the temporal stack only, got a MimiConfig"):
        jx.Streamer(MCFG, jx.with_lora(mparams, lora), 2)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 JAX devices: run with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=2 (bash run.sh test sets it)")
def test_streamer_refuses_params_committed_to_another_device(tparams):
    """Params committed to one device with the state on another failed only at the first step
    (jit: "incompatible devices"); Streamer and convert refuse them, nothing changed."""
    d0, d1 = jax.devices()[:2]
    on_d0 = jax.device_put(tparams, d0)
    with pytest.raises(ValueError, match=r"^Streamer\(params, device\): params\['params'\]\['layers'\]\['in_proj'\] "
                                         r"is committed to \['cpu:0'\], the state to cpu:1"):
        jx.Streamer(TCFG, on_d0, 2, device=d1)
    s = jx.Streamer(TCFG, on_d0, 2, device=d0)
    x = np.ones((2, 1, TCFG.dim), np.float32)
    s.step(x)
    with pytest.raises(ValueError, match=r"^convert\(params, device\): params.* is committed to \['cpu:0'\], the "
                                         r"state to cpu:1"):
        s.convert(on_d0, device=d1)
    assert s.state.k.devices() == {d0} and s.params is on_d0
    s.convert(jax.device_put(tparams, d1), device=d1)
    s.step(x)
    assert s.state.k.devices() == {d1}
    np.testing.assert_array_equal(s.state.offset, [2, 2])


def test_layer_loops_give_the_same_bits_where_the_docs_say():
    """layer_loop "python" and "scan" are bit-identical in float32 (kernels "reference") and on the twin
    kernels in bfloat16 (`step_fn`'s docstring; bf16 on "reference" may differ by XLA's excess precision)."""
    for kernels, dtype in (("reference", jnp.float32), ("twin", jnp.bfloat16)):
        params = jx.init_params(TCFG, jax.random.key(0), dtype)
        x = jax.random.normal(jax.random.key(1), (2, 1, TCFG.dim)).astype(dtype)
        outs = {}
        for loop in ("scan", "python"):
            step, state = jx.make_step(TCFG, layer_loop=loop, kernels=kernels), jx.init_state(TCFG, 2, dtype)
            for _ in range(2):
                (out, _), state = step(params, state, x)
            outs[loop] = (np.asarray(out.astype(jnp.float32)), np.asarray(state.k.astype(jnp.float32)))
        np.testing.assert_array_equal(outs["scan"][0], outs["python"][0])
        np.testing.assert_array_equal(outs["scan"][1], outs["python"][1])
