"""External oracle: our torch stacks, convention "moshi", against the `moshi` package.

Float32 on CPU, 320 steps that cross several ring wraps, random active masks. Both compute
the same ops in the same order (rope, rms_norm_f32, SDPA with a bool mask over the whole
ring), so active rows must agree bit for bit: torch.equal. Moshi writes the K/V of inactive
rows into its ring too (their offset does not advance); we keep those slots unchanged. The
slot Moshi overwrote is the next one the row writes, so no active output can differ.
"""

import pytest
import torch

from jax_impl.config import PRESETS, with_options
from torch_bridge import MimiTransformer, TemporalStreaming

from .moshi_oracle import moshi_stack

STEPS = 320
B = 3


@pytest.mark.parametrize("stack", ["temporal", "mimi"])
def test_active_rows_bit_identical_to_moshi(stack):
    gen = torch.Generator().manual_seed(7)
    if stack == "temporal":
        config = with_options(PRESETS["temporal-small"], ring_convention="moshi")
        ours = TemporalStreaming.from_config(config)
        T = 1
    else:
        config = with_options(PRESETS["mimi-small"], ring_convention="moshi")
        ours = MimiTransformer.from_config(config)
        T = 2
    ours.init_weights(generator=gen)
    prefix = None if stack == "temporal" else "encoder_transformer"
    theirs, out_norm, text_linear = moshi_stack(config, ours.export_weights(prefix), B)
    ours.streaming_init(B)

    wrapped = False
    with torch.no_grad():
        for step in range(STEPS):
            x = torch.randn(B, T, config.dim, generator=gen)
            active = torch.rand(B, generator=gen) < 0.8
            active[0] = True  # row 0 streams every step: it crosses ring wraps early
            theirs.set_exec_mask(active)
            ref = theirs(x)
            if stack == "temporal":
                ref = out_norm(ref)
                ref_logits = text_linear(ref)[:, None]
                out, logits = ours.step(x, active)
                assert torch.equal(logits[active], ref_logits[active]), f"text_logits differ at step {step}"
            else:
                out = ours.step(x, active)
            assert torch.equal(out[active], ref[active]), (
                f"step {step}: max abs diff {(out[active] - ref[active]).abs().max().item()}")
            wrapped |= bool((ours.state.offset > config.context).any())
    assert wrapped, "the run must cross a ring wrap"
    assert int(ours.state.offset[0]) == STEPS * T
