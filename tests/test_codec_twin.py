"""The codec on the twin kernels: the JAX codec and the torch codec give identical codes and PCM,
frame by frame, with idle and recycled rows; a row's bits do not depend on the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl.codec import init_codec_state, jit_codec_reset_slot, make_codec_step
from jax_impl.codec_config import with_codec_options
from jax_impl.config import MimiConfig
from torch_bridge.codec import MimiCodec

# mimi-tiny with two SEANet stages and one transformer layer: the twin kernels run interpreted on the
# CPU (Pallas and Triton), where every convolution costs a compile and Python per program
CFG = with_codec_options(jx.CODEC_PRESETS["mimi-tiny"], ratios=(4, 2),
                         transformer=MimiConfig(num_layers=1, dim=16, num_heads=2, context=6, ffn=32,
                                                ring_convention="moshi"))
B = 3


def twin_codec() -> MimiCodec:
    codec = MimiCodec.from_config(CFG, kernels="twin")
    codec.init_weights(generator=torch.Generator().manual_seed(0))
    return codec


def frames(n: int, batch: int = B) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 1, CFG.frame_size, generator=g) for _ in range(n)]


def test_twin_codec_jax_equals_torch_bit_for_bit():
    codec = twin_codec()
    params = codec.jax_params()
    encode, decode = make_codec_step(CFG, kernels="twin", rope_freqs=codec.rope_freqs())
    state = init_codec_state(CFG, B)
    codec.streaming_init(B)
    seen = set()
    for t, pcm in enumerate(frames(3)):
        if t == 2:
            codec.reset_slot(1)
            state = jit_codec_reset_slot(state, 1)
        active = torch.tensor([True, t != 1, True])
        codes = codec.encode_frame(pcm, active)
        codes_j, state = encode(params, state, pcm.numpy(), active.numpy())
        assert np.array_equal(np.asarray(codes_j), codes.numpy()), t
        out = codec.decode_frame(codes, active)
        out_j, state = decode(params, state, codes.numpy(), active.numpy())
        assert np.array_equal(np.asarray(out_j), out.numpy()), t
        seen |= set(codes.flatten().tolist())
    assert len(seen) > CFG.num_codebooks  # the codes vary: not a comparison of constants


def test_twin_codec_rows_do_not_depend_on_the_batch():
    """Row 1 of a batch of 3 and the same stream alone: the same codes and PCM bits (torch side; the
    JAX side gives the torch bits, above)."""
    batch, alone = twin_codec(), twin_codec()
    batch.streaming_init(B)
    alone.streaming_init(1)
    for pcm in frames(2):
        codes = batch.encode_frame(pcm)
        codes_1 = alone.encode_frame(pcm[1:2])
        assert torch.equal(codes[1:2], codes_1)
        assert torch.equal(batch.decode_frame(codes)[1:2], alone.decode_frame(codes_1))


def test_twin_codec_close_to_the_reference():
    """The twin kernels follow their own contract (ELU as exp(x) - 1, fixed sum orders): PCM close
    to the reference codec's on the same weights and codes."""
    twin = twin_codec()
    reference = MimiCodec.from_config(CFG)
    reference.load_state_dict(twin.state_dict())
    twin.streaming_init(B)
    reference.streaming_init(B)
    for pcm in frames(2):
        codes = reference.encode_frame(pcm)
        want = reference.decode_frame(codes)
        got = twin.decode_frame(codes)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_kernels_must_be_known():
    with pytest.raises(ValueError, match="kernels must be one of"):
        MimiCodec.from_config(CFG, kernels="pallas")
    with pytest.raises(ValueError, match="kernels must be one of"):
        make_codec_step(CFG, kernels="pallas")
