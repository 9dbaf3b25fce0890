"""The `moshi` package (PyPI) as an external oracle: its StreamingTransformer at small sizes.

`moshi/__init__.py` imports the whole model zoo (sentencepiece, huggingface_hub, ...); only
`moshi.modules.transformer` is needed, so the package is registered without running its
`__init__`. Installed with `pip install --no-deps moshi` plus einops (see requirements).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

from jax_impl.config import MimiConfig, TemporalConfig


def _import_moshi_transformer():
    os.environ.setdefault("NO_TORCH_COMPILE", "1")  # moshi would torch.compile rope/norm on first use
    if "moshi" not in sys.modules:
        spec = importlib.util.find_spec("moshi")
        if spec is None:
            raise ImportError("the `moshi` package is not installed (pip install --no-deps moshi==0.2.13)")
        package = types.ModuleType("moshi")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["moshi"] = package
    from moshi.modules import transformer

    return transformer


def moshi_stack(config, weights: dict[str, torch.Tensor], batch_size: int, *, device=None, dtype=None):
    """A moshi StreamingTransformer (+ out_norm, text_linear for temporal) in streaming mode.

    weights: our `export_weights(prefix)` (Moshi checkpoint layout). device, dtype: passed to
    moshi's constructors as moshi's own loaders do (its `rms_norm_f32` alphas stay float32).
    Returns (transformer, out_norm or None, text_linear or None).
    """
    tr = _import_moshi_transformer()
    common = {"d_model": config.dim, "num_heads": config.num_heads, "num_layers": config.num_layers,
              "causal": True, "context": config.context, "positional_embedding": "rope",
              "max_period": config.max_period, "device": device, "dtype": dtype}
    if isinstance(config, TemporalConfig):
        # moshi's gating uses hidden = 2 * dim_feedforward // 3 (unless dim_feedforward == 4 * dim)
        dim_feedforward = config.hidden * 3 // 2
        assert 2 * dim_feedforward // 3 == config.hidden and dim_feedforward != 4 * config.dim
        model = tr.StreamingTransformer(dim_feedforward=dim_feedforward, norm="rms_norm_f32", gating="silu",
                                        layer_scale=None, **common)
        prefix = "transformer."
    else:
        assert isinstance(config, MimiConfig)
        model = tr.StreamingTransformer(dim_feedforward=config.ffn, norm="layer_norm", gating="none",
                                        layer_scale=0.01, **common)
        prefix = next(k for k in weights if ".transformer.layers." in k).split("transformer.layers.")[0] + "transformer."
    own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    model.load_state_dict(own, strict=True)
    model.eval()
    model.streaming_forever(batch_size)
    out_norm = text_linear = None
    if isinstance(config, TemporalConfig):
        out_norm = tr.create_norm_fn("rms_norm_f32", config.dim, device=device)
        out_norm.load_state_dict({"alpha": weights["out_norm.alpha"]})
        text_linear = torch.nn.Linear(config.dim, config.text_card, bias=False, device=device, dtype=dtype)
        text_linear.load_state_dict({"weight": weights["text_linear.weight"]})
    return model, out_norm, text_linear


@torch.no_grad()
def prefill_rings(ours, theirs, offset: int, generator=None) -> None:
    """Put both stacks at `offset` (< context) for every row, with the same random K/V in slots 0..C-1.

    ours: one of our torch stacks after `streaming_init`; theirs: the matching `moshi_stack` model.
    Slot c holds position c for c < offset on both sides (the rest is invisible: never written),
    so a run from here crosses the ring's wrap within context - offset positions.
    """
    state = ours.state
    if not 0 < offset < ours.config.context:
        raise ValueError(f"offset must be in 1..context-1, got {offset}")
    state.offset.fill_(offset)
    state.start_offset.zero_()
    for layer, module in enumerate(theirs.layers):
        mha = module.self_attn._streaming_state
        for ring, side in ((state.k[layer], 0), (state.v[layer], 1)):
            ring.copy_(torch.randn(ring.shape, generator=generator, device=ring.device, dtype=torch.float32))
            mha.kv_cache.cache[side].copy_(ring)
        mha.kv_cache.end_offset.fill_(offset)
        mha.offset.fill_(offset)
    theirs._streaming_state.offsets.fill_(offset)


def moshi_lm_module():
    """moshi's `models.lm` (LMModel, LMGen) without running `moshi/__init__.py` or
    `moshi/models/__init__.py` (they import sentencepiece, huggingface_hub, ...)."""
    _import_moshi_transformer()
    if "moshi.models" not in sys.modules:
        package = types.ModuleType("moshi.models")
        package.__path__ = [os.path.join(sys.modules["moshi"].__path__[0], "models")]
        sys.modules["moshi.models"] = package
    from moshi.models import lm

    return lm
