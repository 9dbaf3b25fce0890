"""`CodecConfig`: Mimi's defaults, the derived sizes, the validation, the layer plan's checkpoint names."""

from __future__ import annotations

import pytest

import jax_impl as jx
from jax_impl.codec_config import codec_weight_shapes, decoder_plan, encoder_plan, plan_convs
from jax_impl.config import MimiConfig


def test_defaults_are_mimi_as_shipped():
    cfg = jx.CodecConfig()
    assert (cfg.sample_rate, cfg.frame_rate, cfg.frame_size, cfg.hop_length) == (24000, 12.5, 1920, 960)
    assert (cfg.downsample_stride, cfg.dimension, cfg.n_filters, cfg.ratios) == (2, 512, 64, (8, 6, 5, 4))
    assert (cfg.num_codebooks, cfg.total_codebooks, cfg.codebook_size, cfg.codebook_dim) == (8, 32, 2048, 256)
    assert cfg.transformer == MimiConfig(ring_convention="moshi")
    assert jx.CODEC_PRESETS["mimi"] == cfg


def test_plan_strides_and_carries():
    cfg = jx.CodecConfig()
    enc = plan_convs(encoder_plan(cfg))
    assert [c.stride for c in enc if c.stride > 1] == [4, 5, 6, 8, 2]
    assert enc[0].weight_shape == (64, 1, 7) and enc[-2].weight_shape == (512, 1024, 3)
    dec = plan_convs(decoder_plan(cfg))
    assert dec[0].weight_shape == (512, 1, 4) and dec[0].carry == 2 and dec[0].carry_channels == 512
    assert [c.carry for c in dec if c.transposed] == [2, 8, 6, 5, 4]
    # the dilated residual conv keeps 2 samples, the kernel-1 conv none
    assert [c.carry for c in enc[1:3]] == [2, 0]
    # 14 biased convolutions a side, the two resampling weights, 2 projections and 32 codebooks x 3 buffers
    # a quantizer: with the transformers' 160, the 318 tensors of a moshi MimiModel.state_dict()
    assert len(codec_weight_shapes(cfg)) == 2 * (14 * 2 + 1) + 2 * 2 + 32 * 3


@pytest.mark.parametrize("name", list(jx.CODEC_PRESETS))
def test_presets_are_consistent(name):
    cfg = jx.CODEC_PRESETS[name]
    assert cfg.frame_size == cfg.hop_length * cfg.downsample_stride
    assert cfg.transformer.dim == cfg.dimension


@pytest.mark.parametrize(("changes", "names"), [
    ({"n_filters": 0}, "n_filters"),
    ({"ratios": [8, 6]}, "ratios"),
    ({"ratios": (8, -1)}, "ratios"),
    ({"frame_rate": float("nan")}, "frame_rate"),
    ({"frame_rate": 10**400}, "frame_rate"),
    ({"frame_rate": 11.0}, "frame_rate"),
    ({"dimension": 256}, "transformer.dim"),
    ({"num_codebooks": 33}, "num_codebooks"),
    ({"num_codebooks": 0}, "num_codebooks"),
    ({"total_codebooks": 1}, "total_codebooks"),
    ({"compress": 3}, "compress"),
    ({"transformer": "mimi"}, "transformer"),
    ({"codebook_size": True}, "codebook_size"),
])
def test_bad_fields_are_named(changes, names):
    with pytest.raises((ValueError, TypeError), match=names.replace(".", r"\.")):
        jx.with_codec_options(jx.CodecConfig(), **changes)
