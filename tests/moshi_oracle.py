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


def _stub_missing(package: str, modules: dict[str, dict]) -> None:
    """Register empty modules (name -> attributes) for `package` when it is not installed."""
    if package in sys.modules or importlib.util.find_spec(package) is not None:
        return
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


def moshi_mimi_config(cfg) -> dict:
    """moshi's `loaders._mimi_config` layout for a `CodecConfig` (the default gives moshi's own)."""
    tr = cfg.transformer
    seanet = {"channels": 1, "dimension": cfg.dimension, "causal": True, "n_filters": cfg.n_filters,
              "n_residual_layers": cfg.n_residual_layers, "activation": "ELU", "compress": cfg.compress,
              "dilation_base": cfg.dilation_base, "disable_norm_outer_blocks": 0, "kernel_size": cfg.kernel_size,
              "residual_kernel_size": cfg.residual_kernel_size, "last_kernel_size": cfg.last_kernel_size,
              "norm": "none", "pad_mode": "constant", "ratios": list(cfg.ratios), "true_skip": True}
    quantizer = {"dimension": cfg.codebook_dim, "n_q": cfg.total_codebooks, "bins": cfg.codebook_size,
                 "input_dimension": cfg.dimension, "output_dimension": cfg.dimension}
    transformer = {"d_model": tr.dim, "num_heads": tr.num_heads, "num_layers": tr.num_layers, "causal": True,
                   "layer_scale": 0.01, "context": tr.context, "conv_layout": True, "max_period": tr.max_period,
                   "gating": "none", "norm": "layer_norm", "positional_embedding": "rope",
                   "dim_feedforward": tr.ffn, "input_dimension": cfg.dimension, "output_dimensions": [cfg.dimension]}
    return {"sample_rate": cfg.sample_rate, "channels": 1, "frame_rate": cfg.frame_rate, "seanet": seanet,
            "quantizer": quantizer, "transformer": transformer}


def moshi_loaders():
    """`moshi.models.loaders`, its missing imports (huggingface_hub, sentencepiece) stubbed: the
    codec needs neither, only the model zoo's downloader and text tokenizer do."""
    _import_moshi_transformer()
    _stub_missing("huggingface_hub", {"huggingface_hub": {"hf_hub_download": None},
                                      "huggingface_hub.errors": {"EntryNotFoundError": LookupError}})
    _stub_missing("sentencepiece", {"sentencepiece": {"SentencePieceProcessor": object}})
    from moshi.models import loaders

    return loaders


@torch.no_grad()
def moshi_mimi(cfg, seed: int = 0, codebook_std: float = 0.02):
    """moshi's `MimiModel` for a `CodecConfig` (`get_mimi(None, ...)`: moshi's random init), its
    codebooks made random too (moshi leaves them all zero: every code would be 0), at about the
    scale of the latent of random weights (~0.01-0.05), so that the codes vary."""
    loaders = moshi_loaders()
    torch.manual_seed(seed)
    mimi = loaders.get_mimi(None, moshi_mimi_config(cfg), num_codebooks=cfg.num_codebooks)
    for name, module in mimi.named_modules():
        if name.endswith("._codebook"):
            module.embedding_sum.normal_(std=codebook_std)
            module.cluster_usage.uniform_(0.5, 2.0)
            module.register_buffer("_embedding", None, persistent=False)  # moshi's cached entries
    return mimi
