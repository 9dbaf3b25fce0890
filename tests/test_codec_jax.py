"""The JAX Mimi codec against the torch reference: codes equal, PCM within a tight normwise bound, with
per-row activity and recycling; row isolation; bad inputs refused with the donated state intact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl.codec import codec_reset_slot, init_codec_state, jit_codec_reset_slot, make_codec_step
from tests.moshi_oracle import moshi_mimi
from torch_bridge.codec import MimiCodec

# float32: the convolutions (matmuls over their taps) and matmuls sum in another order than oneDNN's, a
# few ULPs per layer (measured 1.4e-7 to 5.4e-7 normwise, max|jax - torch| / max|torch| per frame).
PCM_MAX_REL = 2e-6
B = 3


def torch_codec(name: str) -> MimiCodec:
    cfg = jx.CODEC_PRESETS[name]
    codec = MimiCodec.from_config(cfg)
    codec.load_weights(moshi_mimi(cfg).state_dict())
    return codec


def frames(cfg, n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, 1, cfg.frame_size, generator=g) for _ in range(n)]


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_jax_codec_matches_torch():
    """Codes equal and PCM close at every frame, rows idle and recycled on both sides alike (mimi-tiny,
    10 frames; mimi-small, the real frame geometry, is the codec cross-check's size on the CPU:
    tests/test_crosscheck_codec.py runs it through the command line, codes identical, PCM close)."""
    name, n = "mimi-tiny", 10
    codec = torch_codec(name)
    cfg = codec.config
    params = codec.jax_params()
    encode, decode = make_codec_step(cfg)
    state = init_codec_state(cfg, B)
    codec.streaming_init(B)
    for t, pcm in enumerate(frames(cfg, n)):
        if t == 3:
            codec.reset_slot(2)
            state = jit_codec_reset_slot(state, 2)
        active = torch.tensor([True, t % 3 != 1, True])
        codes = codec.encode_frame(pcm, active)
        codes_j, state = encode(params, state, jnp.asarray(pcm.numpy()), jnp.asarray(active.numpy()))
        assert codes_j.dtype == jnp.int32 and np.array_equal(np.asarray(codes_j), codes.numpy()), t
        out = codec.decode_frame(codes, active)
        out_j, state = decode(params, state, jnp.asarray(codes.numpy()), jnp.asarray(active.numpy()))
        assert out_j.shape == (B, 1, cfg.frame_size) and rel(out_j, out.numpy()) < PCM_MAX_REL, t
        assert not np.asarray(out_j)[~active.numpy()].any()


def run(cfg, params, pcms, state):
    encode, decode = make_codec_step(cfg)
    every = jnp.ones(B, bool)  # as the other tests pass it: one compiled step for all
    outs = []
    for pcm in pcms:
        codes, state = encode(params, state, pcm, every)
        pcm_out, state = decode(params, state, codes, every)
        outs.append((np.asarray(codes), np.asarray(pcm_out)))
    return outs, state


def test_nan_in_one_row_reaches_no_other_row():
    codec = torch_codec("mimi-tiny")
    cfg, params = codec.config, codec.jax_params()
    clean = [jnp.asarray(f.numpy()) for f in frames(cfg, 6, seed=4)]
    poisoned = [f.at[0, 0, 3].set(jnp.nan) if i == 1 else f for i, f in enumerate(clean)]
    got, state = run(cfg, params, poisoned, init_codec_state(cfg, B))
    want, _ = run(cfg, params, clean, init_codec_state(cfg, B))
    for (codes, pcm), (codes_c, pcm_c) in zip(got, want, strict=True):
        assert np.array_equal(codes[1:], codes_c[1:]) and np.array_equal(pcm[1:], pcm_c[1:])
    assert jnp.isnan(state.encoder_transformer.k[:, 0]).any()
    # recycled, the row is a fresh session again: the bits of a fresh stream
    state = jit_codec_reset_slot(state, 0)
    again, _ = run(cfg, params, clean[:3], state)
    fresh, _ = run(cfg, params, clean[:3], init_codec_state(cfg, B))
    for (codes, pcm), (codes_f, pcm_f) in zip(again, fresh, strict=True):
        assert np.array_equal(codes[0], codes_f[0]) and np.array_equal(pcm[0], pcm_f[0])


def test_bad_inputs_are_refused_and_the_state_stays_valid():
    codec = torch_codec("mimi-tiny")
    cfg, params = codec.config, codec.jax_params()
    encode, decode = make_codec_step(cfg)
    pcm = jnp.asarray(frames(cfg, 1)[0].numpy())
    codes = jnp.zeros((B, cfg.num_codebooks), jnp.int32)
    state = init_codec_state(cfg, B)
    bad = [
        (encode, (pcm[..., :-1],), ValueError, "frame_size"),
        (encode, (pcm[:, 0],), ValueError, "shape"),
        (encode, (pcm.astype(jnp.int32),), TypeError, "dtype"),
        (encode, (np.asarray(pcm, np.float64),), TypeError, "pcm has dtype float64"),  # jit would narrow it
        (encode, (pcm, jnp.ones(B)), TypeError, "active"),
        (encode, (pcm, jnp.ones(B + 1, bool)), ValueError, "active"),
        (decode, (codes + cfg.codebook_size,), ValueError, "codebook_size"),
        (decode, (codes.at[1, 2].set(-1),), ValueError, r"codes\[1, 2\] = -1"),
        (decode, (codes.astype(jnp.float32),), TypeError, "int32 or int64"),
        (decode, (codes[:, :-1],), ValueError, "num_codebooks"),
        (jit_codec_reset_slot, (B,), IndexError, "out of range"),
        (codec_reset_slot, (-1,), IndexError, "out of range"),
    ]
    for fn, args, error, match in bad:
        with pytest.raises(error, match=match):
            fn(*((params, state) if fn in (encode, decode) else (state,)), *args)
    with pytest.raises(TypeError, match=r"init_codec_state\(device\)"):
        init_codec_state(cfg, B, device="cpu")
    # nothing was donated: the state still steps, to the bits of a fresh one
    got, _ = run(cfg, params, [pcm], state)
    want, _ = run(cfg, params, [pcm], init_codec_state(cfg, B))
    assert all(np.array_equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    for fn, args in ((encode, (params, state, pcm)), (decode, (params, state, codes)), (jit_codec_reset_slot, (state, 0))):
        with pytest.raises(ValueError, match="donated to an earlier call"):  # `run` stepped (and donated) it
            fn(*args)


@pytest.mark.parametrize("side", ["encode", "decode"])
def test_a_frame_past_the_offsets_dtype_is_refused(side):
    """A frame from one below the index dtype's largest offset (downsample_stride positions a frame)
    steps to it; the next raises OverflowError naming the transformer's offset, its row and
    jit_codec_reset_slot, before the donated call: every state array bit-equal, nothing donated. The
    other step, which does not move that offset, still steps; so does the recycled row."""
    from jax_impl.state import index_max

    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    params = MimiCodec.from_config(cfg).jax_params()
    steps = dict(zip(("encode", "decode"), make_codec_step(cfg), strict=True))
    inputs = {"encode": jnp.asarray(frames(cfg, 1)[0].numpy()), "decode": jnp.zeros((B, cfg.num_codebooks), jnp.int32)}
    other = "decode" if side == "encode" else "encode"
    T, top, ring = cfg.downsample_stride, index_max(), f"{side}r_transformer"
    state = init_codec_state(cfg, B)
    near = [jnp.array([0, top - T, 5], getattr(state, ring).offset.dtype) for _ in range(2)]
    state = state._replace(**{ring: getattr(state, ring)._replace(offset=near[0], start_offset=near[1])})
    _, state = steps[side](params, state, inputs[side])
    assert np.asarray(getattr(state, ring).offset).tolist() == [T, top, 5 + T]
    before = [np.array(a) for a in jax.tree.leaves(state)]
    with pytest.raises(OverflowError, match=rf"{side}\(state\): {ring}.offset\[1\] is {top}: {T} more .* would "
                                            rf"pass {top}.*jit_codec_reset_slot"):
        steps[side](params, state, inputs[side])
    assert not any(a.is_deleted() for a in jax.tree.leaves(state))
    assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(state), strict=True))
    _, state = steps[other](params, state, inputs[other])
    _, state = steps[side](params, jit_codec_reset_slot(state, 1), inputs[side])
    assert np.asarray(getattr(state, ring).offset).tolist() == [2 * T, T, 5 + 2 * T]


def test_steps_compile_once_whatever_the_inputs_placement():
    """Host, uncommitted and committed inputs, a fresh or recycled state: after the first frame no step
    is lowered again (a step's outputs are committed; an uncommitted first state or input would
    otherwise make a second program)."""
    codec = torch_codec("mimi-tiny")
    cfg, params = codec.config, codec.jax_params()
    encode, decode = make_codec_step(cfg)
    state = init_codec_state(cfg, B)
    every = np.ones(B, bool)
    pcm = frames(cfg, 1)[0].numpy()
    codes, state = encode(params, state, pcm, every)
    _, state = decode(params, state, codes, every)
    lowered = []

    def listen(event, duration, **kwargs):
        if event.endswith("jaxpr_to_mlir_module_duration"):
            lowered.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for x, active in [(pcm, every), (jnp.asarray(pcm), jnp.asarray(every)), (jax.device_put(pcm), every)]:
            codes, state = encode(params, state, x, active)
            _, state = decode(params, state, np.asarray(codes), active)
            _, state = decode(params, state, codes, jnp.asarray(active))
        state = jit_codec_reset_slot(state, 1)
        codes, state = encode(params, state, pcm, every)
        _, state = decode(params, init_codec_state(cfg, B), codes, every)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert not [name for name in lowered if "encode" in name or "decode" in name], lowered


# ------------------------------------------------------------------------------ construction-time refusals
def odd_head_dim_codec():
    """mimi-tiny with a transformer of head dim 12 (dim 24, 2 heads)."""
    return jx.with_codec_options(jx.CODEC_PRESETS["mimi-tiny"], dimension=24,
                                 transformer=jx.MimiConfig(num_layers=1, dim=24, num_heads=2, context=6, ffn=32,
                                                           ring_convention="moshi"))


def test_codec_steps_refuse_twin_on_a_head_dim_not_a_power_of_two_when_made():
    """make_codec_step, encode_fn and decode_fn refuse kernels="twin" on a transformer of head dim 12 up
    front, naming themselves, the stack and its head dim; the reference steps take it."""
    from jax_impl.codec import decode_fn, encode_fn

    cfg = odd_head_dim_codec()
    for where, make in (("make_codec_step", make_codec_step), ("encode_fn", encode_fn), ("decode_fn", decode_fn)):
        with pytest.raises(ValueError, match=rf"^{where}\(kernels\): kernels='twin' needs power-of-two head dims "
                                             rf"\(.*\); the transformer stack's is 12 \(head_dim = dim 24 // num_heads 2\)"):
            make(cfg, kernels="twin")
        make(cfg, kernels="reference")
        with pytest.raises(TypeError, match=rf"^{where}\(cfg\): cfg must be a CodecConfig, got MimiConfig$"):
            make(cfg.transformer)


def test_init_codec_state_refuses_a_stacks_config_by_name():
    with pytest.raises(TypeError, match=r"^init_codec_state\(cfg\): cfg must be a CodecConfig, got TemporalConfig$"):
        init_codec_state(jx.PRESETS["temporal-small"], 2)
