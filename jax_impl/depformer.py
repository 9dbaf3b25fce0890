"""The depformer, JAX side: one frame's dep_q inner steps, functional.

    params = jx.depformer.check_depformer_params(cfg, {k: to_jax(v) for k, v in dep.weights().items()})
    step = jx.make_depformer_step(cfg)                       # jitted
    codes, logits = step(params, text_token, transformer_out)    # [B] int, [B, 1, temporal_dim]
    # -> codes [B, dep_q] int32, logits [B, dep_q, card] float32

The parameters are the torch `Depformer`'s buffers under the same names (`buffer_shapes`): each
weight set stored once, `[L, weight_sets, ...]`; step k reads set `step_sets[k]` in place (the
reference path: a `lax.scan`, by a traced index, an array of the step -> set map scanned with the
steps; the twin path: unrolled, by a static one). The steps carry the frame's state: the previous
token and the K/V cache `[L, B, H, dep_q, head_dim]` (zeros at the frame's start, slot k written
at step k, slots 0..k attended: causal over the inner steps, no positional embedding). The same operations as the torch reference, in its order.

`kernels` picks who computes the floats:

- "reference": jax.numpy, the torch reference's operations in its order; the floats differ from
  it by the matmuls' summation order (XLA's, not oneDNN's), the codes agree.
- "twin": every float operation in a Pallas twin kernel (`kernels_pallas.twin_*`, on Pallas's Triton
  backend or its Mosaic GPU backend: `kernels_pallas.backend`), the torch
  `Depformer(kernels="twin")`'s Triton twins in the same order: the same bits (codes and logits),
  and a row's bits do not depend on the batch. Per layer: the RMSNorm and the qkv projection
  with the K/V write into the frame's cache in its epilogue (`twin_linear.linear_rope_write`, no
  rotation, `norm=`: fused into the kernel where its form fuses it, else the norm kernel first, the
  same bits), the attention over the cache (`twin_attention`, the cache as a ring whose slot c
  holds position c, queried at the step index: slots 0..k visible, no positional embedding), the
  out-projection with the residual in its epilogue, the RMSNorm and the gated in-projection
  (`act="silu_gate"`, `norm=`), the down-projection with the residual; `depformer_in` with the
  token's embedding as its residual (where the frame's steps read every weight set, one linear over
  all the sets at the frame's start, `_twin_inputs`, each step adding its embedding as that
  epilogue does), the head a twin linear. The inner steps are unrolled: the
  step, its weight set (read in place at index `layer * weight_sets + set` of the buffers viewed
  as `[L * weight_sets, N, K]`, a reshape, no copy) and the step's tables are constants, so
  between the kernels run only the embedding lookup and the sampler, exact (a gather, integer and
  compare work; the sampler's few float operations are rounded one by one on both sides,
  `jax_impl.sampling`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import backend, twin_attention, twin_linear
from kernels_pallas.contract.norm import TwinNorm

from . import state as st
from .depformer_config import DepformerConfig, buffer_shapes, check_steps
from .kernel_choice import check_head_dim
from .sampling import is_integer_array, sample
from .sampling_config import array_described, check_counter, check_sampling, check_seeds

KERNELS = ("reference", "twin")
F32 = jnp.float32


def check_depformer_params(cfg: DepformerConfig, params: Mapping) -> dict[str, jax.Array]:
    """The parameter dict (jax arrays) after checking its names, shapes and one float dtype."""
    want = buffer_shapes(cfg)
    if set(params) != set(want):
        raise ValueError(f"params: expected the buffers {sorted(want)}, got {sorted(params)} "
                         f"(missing {sorted(set(want) - set(params))}, unexpected {sorted(set(params) - set(want))})")
    out = {k: jnp.asarray(v) for k, v in params.items()}
    bad = [f"{k}: expected {list(want[k])}, got {list(v.shape)}" for k, v in out.items() if v.shape != want[k]]
    if bad:
        raise ValueError("params: wrong shapes: " + "; ".join(bad))
    dtypes = {v.dtype for v in out.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"params: every buffer must have one float dtype (float32, bfloat16, float16), got {dtypes}")
    return out


def _rms_norm_f32(x, alpha, eps):
    """moshi's `rms_norm_f32`: in float32, var = eps + mean(x^2), y = x * (alpha * rsqrt(var))."""
    xf = x.astype(F32)
    var = eps + jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * (alpha.astype(F32) * lax.rsqrt(var))).astype(x.dtype)


def _linear(x, w):
    """x [B, K] @ w[N, K].T -> [B, N] in x's dtype (float32 accumulation)."""
    return jnp.einsum("bk,nk->bn", x, w, preferred_element_type=F32).astype(x.dtype)


def _embed(table, ids):
    """moshi's `ScaledEmbedding`: ids [B] -> [B, dim]; id -1 gives the zero vector."""
    y = jnp.take(table, jnp.clip(ids, 0, table.shape[0] - 1), axis=0)
    return jnp.where((ids == -1)[:, None], jnp.zeros((), y.dtype), y)


def _layer(cfg: DepformerConfig, p, x, layer: int, s, step, cache_k, cache_v):
    """One layer at inner step `step` (traced) with weight set `s` (traced). x [B, dim]."""
    B = x.shape[0]
    H, D = cfg.num_heads, cfg.head_dim
    h = _rms_norm_f32(x, p["norm1_alpha"][layer], cfg.norm_eps)
    q, k, v = jnp.moveaxis(_linear(h, p["in_proj"][layer, s]).reshape(B, 3, H, D), 1, 0)
    cache_k = cache_k.at[layer, :, :, step].set(k)
    cache_v = cache_v.at[layer, :, :, step].set(v)
    scores = jnp.einsum("bhd,bhcd->bhc", q, cache_k[layer], preferred_element_type=F32) / np.sqrt(D).astype(np.float32)
    scores = jnp.where(jnp.arange(cfg.dep_q) <= step, scores, -jnp.inf)
    att = jnp.einsum("bhc,bhcd->bhd", jax.nn.softmax(scores, axis=-1), cache_v[layer].astype(F32)).astype(x.dtype)
    x = x + _linear(att.reshape(B, cfg.dim), p["out_proj"][layer, s])
    h = _rms_norm_f32(x, p["norm2_alpha"][layer], cfg.norm_eps)
    gate = _linear(h, p["linear_in"][layer, s])
    return x + _linear(jax.nn.silu(gate[:, :cfg.hidden]) * gate[:, cfg.hidden:], p["linear_out"][layer, s]), \
        cache_k, cache_v


def _per_set(w, cfg: DepformerConfig):
    """A per-set buffer [L, weight_sets, N, K] as the twin linears' stack [L * weight_sets, N, K] (a reshape)."""
    return w.reshape(cfg.num_layers * cfg.weight_sets, *w.shape[2:])


def _twin_alphas(cfg: DepformerConfig, p) -> tuple[jax.Array, jax.Array]:
    """The two RMSNorms' alphas [L, dim] as the twin linears' `norm=` reads them: repeated per weight
    set, [L * weight_sets, dim], indexed as the linear's weights (once a frame)."""
    return tuple(jnp.repeat(p[name], cfg.weight_sets, axis=0) for name in ("norm1_alpha", "norm2_alpha"))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _twin_layer(cfg: DepformerConfig, pallas_backend: str, p, alphas, x, at, layer, slot, positions, cache_k,
                cache_v):
    """One layer on the Pallas twins (module docstring): x [B, dim] at weight index `at` = layer *
    weight_sets + set and cache layer `layer` (int32 scalars); slot [B, 1] int32: the step (the K/V
    write slot and the query's position); positions [B, dep_q] int32: slot c holds position c;
    cache_k, cache_v [L, B, H, dep_q, head_dim], written in place at `slot` by the qkv projection's
    kernel; alphas: `_twin_alphas`; pallas_backend: the one the twins run on (`kernels_pallas.backend`;
    static: a layer traced per backend). Jitted: an unrolled frame traces and lowers it once, and its
    calls pass constants (XLA inlines them and folds the index arithmetic: no work between kernels)."""
    del pallas_backend  # read by the twins themselves when traced
    B = x.shape[0]
    norm1, norm2 = (TwinNorm("rms", a, None, cfg.norm_eps) for a in alphas)
    q, cache_k, cache_v = twin_linear.linear_rope_write(
        x, _per_set(p["in_proj"], cfg), at, None, None, cache_k, cache_v, slot, jnp.ones((B, 1), bool),
        norm=norm1, ring_layer=layer)
    att = twin_attention.attention(q, cache_k, cache_v, layer, positions, slot, context=cfg.dep_q)
    x = twin_linear.linear(att.reshape(B, cfg.dim), _per_set(p["out_proj"], cfg), at, residual=x)
    gated = twin_linear.linear(x, _per_set(p["linear_in"], cfg), at, act="silu_gate", norm=norm2)
    return twin_linear.linear(gated, _per_set(p["linear_out"], cfg), at, residual=x), cache_k, cache_v


def _twin_layers(cfg: DepformerConfig, p, alphas, x, s, step, cache_k, cache_v):
    """The layers of inner step `step` with weight set s (ints when unrolled, else traced) on the twins."""
    B = x.shape[0]
    static = isinstance(step, int)
    slot = np.full((B, 1), step, np.int32) if static else jnp.full((B, 1), step, jnp.int32)
    positions = np.broadcast_to(np.arange(cfg.dep_q, dtype=np.int32), (B, cfg.dep_q))
    pallas_backend = backend.gpu_backend()
    for layer in range(cfg.num_layers):
        at = np.int32(layer * cfg.weight_sets + s) if static else layer * cfg.weight_sets + s
        x, cache_k, cache_v = _twin_layer(cfg, pallas_backend, p, alphas, x, at, np.int32(layer), slot, positions, cache_k,
                                          cache_v)
    return x, cache_k, cache_v


def depformer_frame(cfg: DepformerConfig, params, text_token, transformer_out, audio_tokens=None, audio_provided=None,
                    seeds=None, counter=0, *, temperature: float = 0.0, top_k: int = 0, kernels: str = "reference",
                    steps: int | None = None, unroll: bool | None = None):
    """One frame (traceable): codes [B, dep_q] int32 and logits [B, dep_q, card] float32.

    text_token [B] int; transformer_out [B, 1, temporal_dim] (the params' dtype); audio_tokens
    [B, dep_q] int and audio_provided [B, dep_q] bool (teacher forcing) or None; seeds [B],
    counter: sampling (`jax_impl.sampling`, step k at counter * dep_q + k) when temperature > 0.
    kernels: "reference" or "twin" (module docstring).
    steps (static): run the first `steps` inner steps only (1..dep_q, `check_steps`; None: all); codes [B, steps].
    unroll (static): the inner steps as a Python loop (the step, its weight set and embedding table
    static: no loop bookkeeping, no index arithmetic between the kernels) rather than a `lax.scan`;
    the same bits. None: unrolled on the twins compiled for the GPU; a scan elsewhere (interpreted on
    the CPU, each unrolled kernel is a loop of its own to compile: 6 s against 67 s at the small preset).
    """
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    check_steps(steps, cfg.dep_q)
    params = check_depformer_params(cfg, params)  # traced: shapes and dtypes, once a compile
    twin = kernels == "twin"
    if unroll is None:
        unroll = twin and jax.default_backend() == "gpu"
    B = transformer_out.shape[0]
    dtype = params["in_proj"].dtype
    x_in = transformer_out[:, 0]
    alphas = _twin_alphas(cfg, params) if twin else None
    shape = (cfg.num_layers, B, cfg.num_heads, cfg.dep_q, cfg.head_dim)
    caches = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    inputs = _twin_inputs(cfg, params, x_in, steps) if twin else None

    def step(prev, k, s, table, cache_k, cache_v):
        """Inner step k with weight set s and embedding table `table` (step k - 1's; 0 at k = 0)
        -> (token [B], logits [B, card] float32, cache_k, cache_v)."""
        if not cfg.emb_tables:  # one inner step (dep_q 1): the text token's embedding alone
            token_in = _embed(params["text_emb"], prev)
        elif isinstance(k, int):
            token_in = _embed(params["text_emb"] if k == 0 else params["emb"][table], prev)
        else:
            token_in = jnp.where(k == 0, _embed(params["text_emb"], prev), _embed(params["emb"][table], prev))
        if twin:
            if inputs is None:
                x = twin_linear.linear(x_in, params["depformer_in"], s, residual=token_in)
            else:  # the input projection's epilogue: its residual add, as the kernel makes it
                x = twin_linear.add_residual(inputs[:, s], token_in)
            x, cache_k, cache_v = _twin_layers(cfg, params, alphas, x, s, k, cache_k, cache_v)
            logits = twin_linear.linear(x, params["linears"], s).astype(F32)
        else:
            x = _linear(x_in, params["depformer_in"][s]) + token_in
            for layer in range(cfg.num_layers):
                x, cache_k, cache_v = _layer(cfg, params, x, layer, s, k, cache_k, cache_v)
            logits = _linear(x, params["linears"][s]).astype(F32)
        draw_counter = jnp.asarray(counter, jnp.uint32) * jnp.uint32(cfg.dep_q) + jnp.asarray(k).astype(jnp.uint32)
        return sample(logits, seeds, draw_counter, temperature=temperature, top_k=top_k), logits, cache_k, cache_v

    prev = text_token.astype(jnp.int32)
    tables = (0, *cfg.step_tables)
    if unroll:
        codes, logits_all = [], []
        for k, s in enumerate(cfg.step_sets[:steps]):
            token, logits, *caches = step(prev, k, s, tables[k], *caches)
            codes.append(token)
            logits_all.append(logits)
            prev = token if audio_tokens is None else \
                jnp.where(audio_provided[:, k], audio_tokens[:, k].astype(jnp.int32), token)
        return jnp.stack(codes, axis=1), jnp.stack(logits_all, axis=1)

    if audio_tokens is None:
        audio_tokens = jnp.zeros((B, cfg.dep_q), jnp.int32)
        audio_provided = jnp.zeros((B, cfg.dep_q), bool)
    xs = (jnp.arange(cfg.dep_q), jnp.asarray(cfg.step_sets, jnp.int32), jnp.asarray(tables, jnp.int32),
          audio_tokens.T.astype(jnp.int32), audio_provided.T)
    xs = tuple(a[:steps] for a in xs)

    def scan_step(carry, xs_k):
        prev, cache_k, cache_v = carry
        k, s, table, forced, provided = xs_k
        token, logits, cache_k, cache_v = step(prev, k, s, table, cache_k, cache_v)
        return (jnp.where(provided, forced, token), cache_k, cache_v), (token, logits)

    _, (codes, logits) = lax.scan(scan_step, (prev, *caches), xs)
    return codes.T, jnp.swapaxes(logits, 0, 1)


def _check_ids(name: str, ids, high: int) -> None:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < -1 or ids.max() > high):
        raise ValueError(f"{name} must hold token ids in 0..{high} or -1 (no token), got {ids[(ids < -1) | (ids > high)][0]}")


def make_depformer_step(cfg: DepformerConfig, kernels: str = "reference", *, temperature: float = 0.0, top_k: int = 0,
                        unroll: bool | None = None):
    """A jitted frame: step(params, text_token, transformer_out, audio_tokens=None, audio_provided=None,
    seeds=None, counter=0) -> (codes [B, dep_q] int32, logits [B, dep_q, card] float32).

    The arguments are checked (shapes, dtypes, token ids: 0..text_card / 0..card or -1) before
    anything runs. kernels: "reference" or "twin" (module docstring). temperature, top_k: the
    sampler's (static; temperature 0: greedy). unroll: `depformer_frame`'s (None: unrolled on the
    twins on the GPU).
    """
    if not isinstance(cfg, DepformerConfig):
        raise TypeError(f"cfg must be a DepformerConfig, got {type(cfg).__name__}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    check_head_dim("make_depformer_step(kernels)", cfg, kernels)
    check_sampling(temperature, top_k, cfg.card)
    frame = jax.jit(backend.traced_on(functools.partial(depformer_frame, cfg, temperature=temperature, top_k=top_k,
                                                        kernels=kernels, unroll=unroll)))

    def step(params, text_token, transformer_out, audio_tokens=None, audio_provided=None, seeds=None, counter=0):
        if not isinstance(params, Mapping) or "in_proj" not in params:
            raise ValueError(f"params must be the depformer's buffers by name (check_depformer_params), got "
                             f"{type(params).__name__}")
        dtype = params["in_proj"].dtype
        for name, x in (("text_token", text_token), ("transformer_out", transformer_out),
                        ("audio_tokens", audio_tokens), ("audio_provided", audio_provided)):
            if hasattr(x, "dtype"):  # another framework's array (no array at all: the checks below name it)
                st.check_array(name, x)
        if not hasattr(transformer_out, "dtype") or jnp.ndim(transformer_out) != 3 \
                or jnp.shape(transformer_out)[1:] != (1, cfg.temporal_dim) or not jnp.shape(transformer_out)[0]:
            raise ValueError(f"transformer_out must have shape [B >= 1, 1, {cfg.temporal_dim}], got "
                             f"{array_described(transformer_out)}")
        if transformer_out.dtype != dtype:
            raise ValueError(f"transformer_out must be {dtype} (the params'), got {transformer_out.dtype}")
        B = transformer_out.shape[0]
        if not is_integer_array(text_token) or jnp.shape(text_token) != (B,):
            raise ValueError(f"text_token must be an integer array [{B}], got {array_described(text_token)}")
        _check_ids("text_token", text_token, cfg.text_card)
        if (audio_tokens is None) != (audio_provided is None):
            raise ValueError("audio_tokens and audio_provided go together: pass both or neither")
        if audio_tokens is not None:
            if not is_integer_array(audio_tokens) or getattr(audio_provided, "dtype", None) != jnp.bool_ \
                    or jnp.shape(audio_tokens) != (B, cfg.dep_q) or jnp.shape(audio_provided) != (B, cfg.dep_q):
                raise ValueError(f"audio_tokens (int) and audio_provided (bool) must have shape [{B}, {cfg.dep_q}], "
                                 f"got {array_described(audio_tokens)} and {array_described(audio_provided)}")
            _check_ids("audio_tokens (where provided)", np.asarray(audio_tokens)[np.asarray(audio_provided)], cfg.card)
        counter = check_counter(counter, B, is_integer_array)
        counter = np.uint32(counter) if isinstance(counter, int) else counter  # any int: its value mod 2**32
        if temperature:
            check_seeds(seeds, B, is_integer_array)
        return frame(params, text_token, transformer_out, audio_tokens, audio_provided, seeds if temperature else None,
                     counter)

    return step


def _twin_inputs(cfg: DepformerConfig, params, x_in, steps: int | None):
    """The twin input projections of every weight set, [B, weight_sets, dim] in the params' dtype, from
    one linear over the sets' weights viewed as [weight_sets * dim, temporal_dim] (a reshape, no copy),
    where the frame's steps read every set; else None (each step projects its own).

    They depend on the temporal output alone, not on the tokens the steps draw: one launch reads each
    set's 8 MB once, where the steps' own launches read a set each (PersonaPlex's 16 steps read 8 sets
    twice). The same bits: a column's sum is the same whatever the columns beside it (the twin linear's
    tiles change the speed, never the bits), and the step then adds the token's embedding as the
    kernel's epilogue does (`twin_linear.add_residual`)."""
    if set(cfg.step_sets[:steps]) != set(range(cfg.weight_sets)):
        return None
    w = params["depformer_in"]
    y = twin_linear.linear(x_in, w.reshape(w.shape[0] * w.shape[1], w.shape[2]))
    return y.reshape(x_in.shape[0], w.shape[0], w.shape[1])
