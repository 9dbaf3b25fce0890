"""The torch Mimi codec: bit-exact with moshi's streaming `MimiModel`, per-row activity and recycling,
row isolation, and every bad input refused with nothing changed."""

from __future__ import annotations

import pytest
import torch

import jax_impl as jx
from jax_impl.checkpoint import CheckpointError
from tests.moshi_oracle import moshi_loaders, moshi_mimi, moshi_mimi_config
from torch_bridge.codec import MimiCodec


def codec_like(mimi, cfg) -> MimiCodec:
    codec = MimiCodec.from_config(cfg)
    codec.load_weights(mimi.state_dict())
    return codec


def pcm_frames(cfg, n: int, batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 1, cfg.frame_size, generator=g) for _ in range(n)]


def state_of(codec: MimiCodec) -> dict[str, torch.Tensor]:
    """Every tensor of a streaming codec's state, copied."""
    s = codec.state
    out = {f"encoder.{i}": t for i, t in enumerate(s.encoder)}
    out |= {f"decoder.{i}": t for i, t in enumerate(s.decoder)}
    out["first"] = s.first
    for name in ("encoder_transformer", "decoder_transformer"):
        ts = getattr(codec, name).state
        out |= {f"{name}.{k}": getattr(ts, k) for k in ("k", "v", "offset", "start_offset")}
    return {k: v.clone() for k, v in out.items()}


def assert_rows_equal(a: dict, b: dict, rows) -> None:
    for key, value in a.items():
        axis = 1 if key.endswith((".k", ".v")) else 0
        assert torch.equal(value.index_select(axis, rows), b[key].index_select(axis, rows)), key


def test_default_config_is_moshis_mimi():
    assert moshi_mimi_config(jx.CodecConfig()) == moshi_loaders()._mimi_config


@pytest.mark.parametrize(("name", "frames"), [("mimi-tiny", 12), ("mimi-small", 8), ("mimi", 2)])
def test_bit_exact_with_moshi_frame_by_frame(name, frames):
    """Codes and PCM torch.equal with moshi's streaming encode / decode, across the tiny rings' wraps."""
    cfg = jx.CODEC_PRESETS[name]
    mimi = moshi_mimi(cfg)
    codec = codec_like(mimi, cfg)
    batch = 3 if name != "mimi" else 2
    codec.streaming_init(batch)
    seen = set()
    with torch.no_grad(), mimi.streaming(batch):
        for pcm in pcm_frames(cfg, frames, batch):
            expected_codes = mimi.encode(pcm)
            codes = codec.encode_frame(pcm)
            assert codes.dtype == torch.int64 and torch.equal(codes, expected_codes[..., 0])
            # decode moshi's codes shifted by a row, so the decoder sees other codes than the encoder made
            other = expected_codes.roll(1, 0)
            assert torch.equal(codec.decode_frame(other[..., 0]), mimi.decode(other))
            seen |= set(codes.flatten().tolist())
    assert len(seen) > cfg.num_codebooks  # the codes vary: the comparison is not of constants


def test_active_rows_match_moshis_exec_mask():
    """Inactive rows keep their state as moshi's exec_mask does (before the ring wraps: moshi writes an
    inactive row's k, v into the ring, the project does not)."""
    cfg = jx.CODEC_PRESETS["mimi-small"]
    mimi = moshi_mimi(cfg)
    codec = codec_like(mimi, cfg)
    codec.streaming_init(3)
    masks = [[True, False, True], [False, True, True], [True, True, False], [True, True, True]]
    with torch.no_grad(), mimi.streaming(3):
        for mask, pcm in zip(masks, pcm_frames(cfg, len(masks), 3), strict=True):
            active = torch.tensor(mask)
            mimi.set_exec_mask(active)
            expected, codes = mimi.encode(pcm)[..., 0], codec.encode_frame(pcm, active)
            assert torch.equal(codes[active], expected[active]) and not codes[~active].any()
            pcm_out = codec.decode_frame(expected, active)
            assert torch.equal(pcm_out[active], mimi.decode(expected[..., None])[active])
            assert not pcm_out[~active].any()


def test_inactive_row_state_unchanged():
    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    codec = MimiCodec.from_config(cfg)
    codec.streaming_init(3)
    frames = pcm_frames(cfg, 4, 3)
    for pcm in frames[:2]:
        codec.decode_frame(codec.encode_frame(pcm))
    before = state_of(codec)
    active = torch.tensor([True, False, True])
    codec.decode_frame(codec.encode_frame(frames[2], active), active)
    after = state_of(codec)
    assert_rows_equal(before, after, torch.tensor([1]))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def run(codec, frames, recycle_at=None, row=1):
    out = []
    for t, pcm in enumerate(frames):
        if t == recycle_at:
            codec.reset_slot(row)
        codes = codec.encode_frame(pcm)
        out.append((codes, codec.decode_frame(codes)))
    return out


@pytest.mark.parametrize("poison", [False, True])
def test_reset_slot_starts_a_fresh_session(poison):
    """After reset_slot(1), row 1 gives the bits of a fresh stream fed the same frames, even when its old
    session was NaN / Inf."""
    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    codec = MimiCodec.from_config(cfg)
    fresh = MimiCodec.from_config(cfg)
    fresh.load_state_dict(codec.state_dict())
    old, new = pcm_frames(cfg, 5, 3, seed=2), pcm_frames(cfg, 6, 3, seed=3)
    if poison:
        old[2][1, 0, ::3] = float("nan")
        old[3][1, 0, 1] = float("inf")
    codec.streaming_init(3)
    fresh.streaming_init(3)
    got = run(codec, old + new, recycle_at=len(old))[len(old):]
    want = run(fresh, new)
    for (codes, pcm), (codes_f, pcm_f) in zip(got, want, strict=True):
        assert torch.equal(codes[1], codes_f[1]) and torch.equal(pcm[1], pcm_f[1])
        assert torch.isfinite(pcm[1]).all()


def test_nan_in_one_row_reaches_no_other_row():
    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    codec = MimiCodec.from_config(cfg)
    clean = MimiCodec.from_config(cfg)
    clean.load_state_dict(codec.state_dict())
    frames = pcm_frames(cfg, 8, 3, seed=4)
    poisoned = [f.clone() for f in frames]
    poisoned[1][0, 0, 5] = float("nan")
    codec.streaming_init(3)
    clean.streaming_init(3)
    for (codes, pcm), (codes_c, pcm_c) in zip(run(codec, poisoned), run(clean, frames), strict=True):
        assert torch.equal(codes[1:], codes_c[1:]) and torch.equal(pcm[1:], pcm_c[1:])
    # the poisoned row's own state holds the NaN (its codes are argmins, finite), no other row's does
    state = state_of(codec)
    rows = {k: t.movedim(1 if k.endswith((".k", ".v")) else 0, 0) for k, t in state.items() if t.is_floating_point()}
    assert any(torch.isnan(t[0]).any() for t in rows.values())
    assert not any(torch.isnan(t[1:]).any() for t in rows.values())


def bad_calls(cfg):
    good = torch.zeros(2, 1, cfg.frame_size)
    codes = torch.zeros(2, cfg.num_codebooks, dtype=torch.int64)
    return [
        ("encode_frame", (good[..., :-1],), ValueError, "frame_size"),
        ("encode_frame", (good[:, 0],), ValueError, "shape"),
        ("encode_frame", (good.double(),), TypeError, "dtype"),
        ("encode_frame", (good.long(),), TypeError, "dtype"),
        ("encode_frame", (good.numpy(),), TypeError, "torch.Tensor"),
        ("encode_frame", (good, torch.ones(2)), TypeError, "active"),
        ("encode_frame", (good, torch.ones(3, dtype=torch.bool)), ValueError, "active"),
        ("decode_frame", (codes + cfg.codebook_size,), ValueError, "codebook_size"),
        ("decode_frame", (codes - 1,), ValueError, r"codes\[0, 0\] = -1"),
        ("decode_frame", (codes.float(),), TypeError, "int32 or int64"),
        ("decode_frame", (codes[:, :-1],), ValueError, "num_codebooks"),
        ("reset_slot", (2,), IndexError, "out of range"),
        ("reset_slot", (True,), TypeError, "row index"),
    ]


def test_bad_inputs_are_refused_and_change_nothing():
    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    codec = MimiCodec.from_config(cfg)
    with pytest.raises(RuntimeError, match="streaming_init"):
        codec.encode_frame(torch.zeros(2, 1, cfg.frame_size))
    codec.streaming_init(2)
    for pcm in pcm_frames(cfg, 2, 2):
        codec.decode_frame(codec.encode_frame(pcm))
    before = state_of(codec)
    for method, args, error, match in bad_calls(cfg):
        with pytest.raises(error, match=match):
            getattr(codec, method)(*args)
        after = state_of(codec)
        assert all(torch.equal(before[k], after[k]) for k in before), (method, match)


@pytest.mark.parametrize("side", ["encode", "decode"])
def test_a_frame_past_the_offsets_dtype_is_refused(side):
    """As the JAX codec's steps (tests/test_codec_jax.py), whose index dtype bounds the offsets here too
    (int64 alone would go on): a frame from one below the largest offset steps to it, the next raises
    OverflowError naming the transformer's offset, its row and reset_slot, nothing changed; the other
    step, which does not move that offset, still steps; so does the recycled row."""
    from jax_impl.state import index_max

    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    codec = MimiCodec.from_config(cfg)
    codec.streaming_init(3)
    T, top, name = cfg.downsample_stride, index_max(), f"{side}r_transformer"
    ring = getattr(codec, name).state
    for t in (ring.offset, ring.start_offset):
        t.copy_(torch.tensor([0, top - T, 5]))
    pcm, codes = pcm_frames(cfg, 1, 3)[0], torch.zeros(3, cfg.num_codebooks, dtype=torch.int64)
    calls = {"encode": lambda: codec.encode_frame(pcm), "decode": lambda: codec.decode_frame(codes)}
    calls[side]()
    assert ring.offset.tolist() == [T, top, 5 + T]
    before = state_of(codec)
    with pytest.raises(OverflowError, match=rf"{side}_frame: {name}.offset\[1\] is {top}: {T} more .* would "
                                            rf"pass {top}.*reset_slot"):
        calls[side]()
    after = state_of(codec)
    assert all(torch.equal(before[k], after[k]) for k in before)
    calls["decode" if side == "encode" else "encode"]()
    codec.reset_slot(1)
    calls[side]()
    assert ring.offset.tolist() == [2 * T, T, 5 + 2 * T]


@pytest.fixture(scope="module")
def tiny_checkpoint():
    cfg = jx.CODEC_PRESETS["mimi-tiny"]
    return cfg, moshi_mimi(cfg).state_dict()


@pytest.mark.parametrize(("change", "lines"), [
    (lambda sd: sd.pop("decoder.model.0.conv.conv.bias"), ["missing: decoder.model.0.conv.conv.bias"]),
    (lambda sd: sd.pop("quantizer.rvq_rest.vq.layers.2._codebook.embedding_sum"),
     ["missing: quantizer.rvq_rest.vq.layers.2._codebook.embedding_sum"]),
    (lambda sd: sd.__setitem__("encoder.model.0.conv.conv.weight", torch.zeros(4, 1, 5)),
     ["wrong shape: encoder.model.0.conv.conv.weight: expected [4, 1, 7], got [4, 1, 5]"]),
    (lambda sd: sd.__setitem__("upsample.convtr.convtr.convtr.weight", torch.zeros(16, 1, 4, dtype=torch.float64)),
     ["wrong dtype: upsample.convtr.convtr.convtr.weight: float64"]),
    (lambda sd: sd.__setitem__("quantizer.extra", torch.zeros(1)), ["unexpected: quantizer.extra"]),
    (lambda sd: sd.__setitem__("decoder.model.0.conv.conv.weight", sd["decoder.model.0.conv.conv.weight"].to_sparse()),
     ["not dense: decoder.model.0.conv.conv.weight: layout torch.sparse_coo"]),
    (lambda sd: sd.__setitem__("decoder_transformer.transformer.layers.0.linear1.weight",
                               sd["decoder_transformer.transformer.layers.0.linear1.weight"].to("meta")),
     ["no data: decoder_transformer.transformer.layers.0.linear1.weight: a meta tensor"]),
    (lambda sd: (sd.pop("encoder_transformer.transformer.layers.1.linear1.weight"),
                 sd.__setitem__("decoder.model.0.conv.conv.bias", "x")),
     ["missing: encoder_transformer.transformer.layers.1.linear1.weight",
      "not a tensor: decoder.model.0.conv.conv.bias: str"]),
])
def test_bad_checkpoints_list_every_problem_and_load_nothing(tiny_checkpoint, change, lines):
    cfg, good = tiny_checkpoint
    codec = MimiCodec.from_config(cfg)
    weights = {k: v.clone() for k, v in codec.state_dict().items()}
    bad = dict(good)
    change(bad)
    with pytest.raises(CheckpointError) as err:
        codec.load_weights(bad, source="tokenizer.safetensors")
    assert str(err.value).startswith("tokenizer.safetensors")
    for line in lines:
        assert line in str(err.value)
    assert all(torch.equal(weights[k], v) for k, v in codec.state_dict().items())


def test_load_takes_numpy_and_bfloat16_exactly(tiny_checkpoint):
    cfg, good = tiny_checkpoint
    a, b = MimiCodec.from_config(cfg), MimiCodec.from_config(cfg)
    halved = {k: v.bfloat16() for k, v in good.items()}
    a.load_weights(halved)
    b.load_weights({k: (v.float().numpy() if k.startswith("encoder.") else v) for k, v in halved.items()})
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert torch.equal(a.encoder_model_0_conv_conv_weight, good["encoder.model.0.conv.conv.weight"].bfloat16().float())


# ------------------------------------------------------------------------------ construction-time refusals
def test_twin_codec_refuses_a_transformer_head_dim_not_a_power_of_two_when_built():
    """MimiCodec(kernels="twin") with a transformer of head dim 12: refused by the constructor, naming the
    codec, the stack and its head dim (it used to fail at the first frame); the reference codec takes it."""
    cfg = jx.with_codec_options(jx.CODEC_PRESETS["mimi-tiny"], dimension=24,
                                transformer=jx.MimiConfig(num_layers=1, dim=24, num_heads=2, context=6, ffn=32,
                                                          ring_convention="moshi"))
    with pytest.raises(ValueError, match=r"^MimiCodec\(kernels\): kernels='twin' needs power-of-two head dims "
                                         r"\(.*\); the transformer stack's is 12 \(head_dim = dim 24 // num_heads 2\)"):
        MimiCodec.from_config(cfg, kernels="twin")
    codec = MimiCodec.from_config(cfg)
    codec.streaming_init(2)
    assert codec.encode_frame(torch.zeros(2, 1, cfg.frame_size)).shape == (2, cfg.num_codebooks)

