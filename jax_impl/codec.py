"""The Mimi codec in JAX: jitted encode / decode frame steps over one explicit state pytree.

    encode, decode = make_codec_step(cfg)             # jitted, state donated
    state = init_codec_state(cfg, batch_size=4)
    codes, state = encode(params, state, pcm, active)  # pcm [B, 1, frame_size] -> codes int32 [B, num_codebooks]
    pcm, state = decode(params, state, codes, active)  # and back
    state = jit_codec_reset_slot(state, b)             # row b: a fresh session

The same computation as the torch reference (`torch_bridge.codec`, op for op moshi's): the SEANet
convolutions of `codec_config.encoder_plan` / `decoder_plan` with their carries, the two Mimi
transformers through `step.step_fn` (their `StreamState`s inside the `CodecState`), the split
residual quantizer. Codes equal torch's; PCM is close, not bit-identical: the convolutions (matmuls
over their taps) and the matmuls sum in another order than oneDNN's (and the codebook distance
drops the row's constant |x|^2, which cannot change the argmin but rounds differently), so the
floats differ by a few float32 ULPs, normwise ~1e-6 relative (tests/test_codec_jax.py bounds it).

params (`CodecParams`, e.g. `torch_bridge.MimiCodec.jax_params()`, zero-copy views of its buffers):
    convs: checkpoint key -> weight / bias (moshi's names: `encoder.model.0.conv.conv.weight`, ...)
    codebooks [num_codebooks, codebook_size, codebook_dim]: the entries
    input_proj [2, codebook_dim, dimension, 1], output_proj [2, dimension, codebook_dim, 1]: semantic, acoustic
    encoder_transformer, decoder_transformer: the Flax variables of the two `MimiStack`s
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import backend, twin_conv

from . import state as st
from .codec_config import CodecConfig, ConvSpec, carry_slots, decoder_plan, encoder_plan, walk_plan
from .kernel_choice import check_head_dim
from .snapshot import exact_float_cast
from .state import StreamState
from .step import step_fn

_HIGHEST = lax.Precision.HIGHEST


class CodecParams(NamedTuple):
    convs: Mapping[str, jax.Array]
    codebooks: jax.Array
    input_proj: jax.Array
    output_proj: jax.Array
    encoder_transformer: Any
    decoder_transformer: Any


class CodecState(NamedTuple):
    """encoder, decoder: the carries of the convolutions of `encoder_plan` / `decoder_plan`, each side's
    in one row-packed array [B, N] (`codec_config.carry_slots`: a convolution's [C, width] at its
    offset in each row, in the plan's order); first: bool [B] (the downsample pads a row's first active
    frame with its first sample); the two transformers' ring states.

    One array a side rather than one a convolution: a jitted step's host time grows with the arrays
    it takes and returns (~6.5 us each donated on an H200: RESULTS.md, "frame_bench"). The twin
    convolutions read and write their carry in place at its offset (`twin_conv.conv1d(carry_slot=)`),
    so the packed array passes from kernel to kernel without a copy; the transposed convolutions'
    overlap tails are sliced out and written back."""

    encoder: jax.Array
    decoder: jax.Array
    first: jax.Array
    encoder_transformer: StreamState
    decoder_transformer: StreamState

    @property
    def batch_size(self) -> int:
        return self.first.shape[0]


def init_codec_state(cfg: CodecConfig, batch_size: int, dtype=jnp.float32, *, device=None) -> CodecState:
    """A fresh stream of `batch_size` rows: zero carries, fresh transformer rings.

    device: a `jax.Device` (default: JAX's default device). The state is committed there: a step's
    outputs are committed (its params are), and a first call with an uncommitted state would
    compile the step a second time."""
    if not isinstance(cfg, CodecConfig):
        raise TypeError(f"init_codec_state(cfg): cfg must be a CodecConfig, got {type(cfg).__name__}")
    batch_size = st.check_batch_size("init_codec_state", batch_size)
    dtype = st.check_state_dtype("init_codec_state", dtype)
    if device is None:
        device = jax.devices()[0]
    elif not isinstance(device, jax.Device):
        raise TypeError(f"init_codec_state(device): expected a jax.Device, got {type(device).__name__}")

    def carries(plan):
        return jnp.zeros((batch_size, carry_slots(plan)[1]), dtype)

    def make():
        return CodecState(carries(encoder_plan(cfg)), carries(decoder_plan(cfg)), jnp.ones(batch_size, bool),
                          st.init_state(cfg.transformer, batch_size, dtype),
                          st.init_state(cfg.transformer, batch_size, dtype))

    return jax.jit(make, out_shardings=jax.sharding.SingleDeviceSharding(device))()


def _conv(x, w, spec: ConvSpec):
    """torch's conv1d (no padding) as one matmul over the taps: [B, in, L] -> [B, out, T].

    XLA's CPU convolution is slow on these shapes (few samples, wide channels: ~8x on the
    stride-8 stage); the taps gathered as strided slices [B, groups, in / groups, kernel, T] and
    contracted with the weight are a plain dot."""
    g, k, d, s = spec.groups, spec.kernel_size, spec.dilation, spec.stride
    T = (x.shape[-1] - (k - 1) * d - 1) // s + 1
    taps = jnp.stack([x[..., j * d: j * d + (T - 1) * s + 1: s] for j in range(k)], axis=-2)
    taps = taps.reshape(x.shape[0], g, spec.in_channels // g, k, T)
    w = w.reshape(g, spec.out_channels // g, spec.in_channels // g, k)
    y = jnp.einsum("bgikt,goik->bgot", taps, w, precision=_HIGHEST)
    return y.reshape(x.shape[0], spec.out_channels, T)


def _conv_transpose(x, w, spec: ConvSpec):
    """torch's conv_transpose1d (no padding): [B, in, T] -> [B, out, (T - 1) * stride + kernel].

    One matmul, z[b, o, t, j] = sum_i x[b, i, t] w[i, o, j], then the overlap-add: tap j of input
    sample t lands on output sample t * stride + j. The taps (zero-padded to n * stride) are cut in
    n blocks of `stride`, block h shifted by h samples, and the n blocks summed in order. (XLA's
    transposed convolution, the input dilated by the stride, multiplies mostly zeros: ~10x slower.)"""
    g, k, s = spec.groups, spec.kernel_size, spec.stride
    B, T = x.shape[0], x.shape[-1]
    n = -(-k // s)
    x = x.reshape(B, g, spec.in_channels // g, T)
    w = w.reshape(g, spec.in_channels // g, spec.out_channels // g, k)
    z = jnp.einsum("bgit,giok->bgotk", x, w, precision=_HIGHEST).reshape(B, spec.out_channels, T, k)
    z = jnp.pad(z, ((0, 0), (0, 0), (0, 0), (0, n * s - k))).reshape(B, spec.out_channels, T, n, s)
    y = sum(jnp.pad(z[:, :, :, h], ((0, 0), (0, 0), (h, n - 1 - h), (0, 0))) for h in range(n))
    return y.reshape(B, spec.out_channels, (T + n - 1) * s)[..., :(T - 1) * s + k]


def _transposed_carry(y, carry, bias, active):
    """A transposed convolution's output y [B, out, L] with its overlap-add carry [B, out, W]: the
    carry added to y's head; (y without its tail, the tail less the bias where active)."""
    width = carry.shape[-1]
    if not width:
        return y, carry
    y = y.at[..., :width].add(carry)
    tail = y[..., -width:]
    if bias is not None:
        tail = tail - bias[:, None]  # the next frame's head has its own bias
    return y[..., :-width], jnp.where(active[:, None, None], tail, carry)


def _carry_view(packed, slot, channels: int):
    """A convolution's carry [B, channels, width] out of its side's packed state (width 0 without a slot)."""
    if slot is None:
        return jnp.zeros((packed.shape[0], channels, 0), packed.dtype)
    offset, width = slot
    return packed[:, offset:offset + channels * width].reshape(packed.shape[0], channels, width)


def _carry_put(packed, slot, carry):
    """The packed state with a convolution's new carry [B, C, width] in its slot."""
    if slot is None:
        return packed
    return packed.at[:, slot[0]:slot[0] + carry.shape[1] * carry.shape[2]].set(carry.reshape(carry.shape[0], -1))


def _reference_conv_step(spec: ConvSpec, weight, bias, packed, slot, x, active, first, residual):
    carry = _carry_view(packed, slot, spec.carry_channels)
    x = jax.nn.elu(x) if spec.elu else x
    if spec.transposed:
        y = _conv_transpose(x, weight, spec)
        y, carry = _transposed_carry(y if bias is None else y + bias[:, None], carry, bias, active)
        return y, _carry_put(packed, slot, carry)
    rows = active[:, None, None]
    width = carry.shape[-1]
    if width:
        if spec.replicate:
            carry = jnp.where(first[:, None, None] & rows, x[..., :1], carry)
        x = jnp.concatenate([carry, x], axis=-1)
        carry = jnp.where(rows, x[..., -width:], carry)
    y = _conv(x, weight, spec)
    y = y if bias is None else y + bias[:, None]
    return (y if residual is None else residual + y), _carry_put(packed, slot, carry)


def _twin_conv_step(spec: ConvSpec, weight, bias, packed, slot, x, active, first, residual):
    """The twin kernels' streaming convolution: the ELU, the carry's concatenation and update and the
    taps in one kernel (`twin_conv.taps`, the carry in place in the packed state), then the linear;
    bias and residual after it."""
    if spec.transposed:
        y = twin_conv.conv_transpose1d(x, weight, bias, stride=spec.stride, groups=spec.groups, elu=spec.elu)
        y, carry = _transposed_carry(y, _carry_view(packed, slot, spec.carry_channels), bias, active)
        return y, _carry_put(packed, slot, carry)
    options = {"stride": spec.stride, "dilation": spec.dilation, "residual": residual, "elu": spec.elu}
    if slot is None:
        return twin_conv.conv1d(x, weight, bias, **options), packed
    return twin_conv.conv1d(x, weight, bias, carry=packed, carry_slot=slot, active=active, first=first,
                            replicate=spec.replicate, **options)


def conv_step(spec: ConvSpec, weight, bias, packed, slot, x, active, first, ops: CodecOps | None = None,
              residual=None):
    """One streaming convolution: (y, new packed state); as `torch_bridge.seanet.conv_step`: the ELU on x
    first where `spec.elu`, `residual` added last. packed, slot: the side's row-packed carries and this
    convolution's place in them (`carry_slots`). ops: the kernels' (`codec_ops`; None: the reference ones)."""
    return (ops or REFERENCE_OPS).conv_step(spec, weight, bias, packed, slot, x, active, first, residual)


def run_plan(plan, convs: Mapping[str, jax.Array], packed, slots, x, active, first, ops: CodecOps | None = None):
    """A plan's convolutions on one frame: (y, new packed state); slots: the plan's `carry_slots`
    (`codec_config.walk_plan`, the walk the torch codec runs too, here over the slots, each
    convolution passing the packed state on to the next)."""

    def conv(spec: ConvSpec, h, slot, residual):
        nonlocal packed
        y, packed = conv_step(spec, convs[spec.key + ".weight"], convs.get(spec.key + ".bias"), packed, slot, h,
                              active, first, ops, residual)
        return y, slot

    y, _ = walk_plan(plan, x, slots, conv)
    return y, packed


def quantize(cfg: CodecConfig, params: CodecParams, emb):
    """emb [B, dimension, 1] -> codes int32 [B, num_codebooks]: per book the nearest entry of the residual."""
    codes = []
    groups = (params.codebooks[:cfg.semantic_codebooks], params.codebooks[cfg.semantic_codebooks:])
    for books, proj in zip(groups, params.input_proj, strict=True):
        residual = jnp.einsum("kd,bd->bk", proj[..., 0], emb[..., 0], precision=_HIGHEST)
        for entries in books:
            # |x - e|^2 - |x|^2: the row's own constant does not move the argmin
            dist = jnp.sum(entries * entries, axis=-1) - 2 * jnp.dot(residual, entries.T, precision=_HIGHEST)
            idx = jnp.argmin(dist, axis=-1).astype(jnp.int32)
            residual = residual - entries[idx]
            codes.append(idx)
    return jnp.stack(codes, axis=1)


def dequantize(cfg: CodecConfig, params: CodecParams, codes):
    """codes [B, num_codebooks] -> the latent [B, dimension, 1]: the entries summed, projected, added."""
    s = cfg.semantic_codebooks
    out = 0
    for first, books, proj in zip((0, s), (params.codebooks[:s], params.codebooks[s:]), params.output_proj,
                                  strict=True):
        if not books.shape[0]:
            continue
        total = sum(jnp.take(books[i], codes[:, first + i], axis=0, mode="fill", fill_value=jnp.nan)
                    for i in range(books.shape[0]))
        out = out + jnp.einsum("dk,bk->bd", proj[..., 0], total, precision=_HIGHEST)
    return out[..., None]


def twin_quantize(cfg: CodecConfig, params: CodecParams, emb):
    """`quantize` on the twin kernels (`kernels_pallas.twin_conv`): the projection a twin conv1d, each
    book's code the twin `nearest`, the residual minus the entry (`torch_bridge.quantizer.encode_twin`)."""
    codes = []
    groups = (params.codebooks[:cfg.semantic_codebooks], params.codebooks[cfg.semantic_codebooks:])
    for books, proj in zip(groups, params.input_proj, strict=True):
        if not books.shape[0]:
            continue
        residual = twin_conv.conv1d(emb, proj)[..., 0]
        for entries in books:
            idx = twin_conv.nearest(residual, entries)
            residual = residual - entries[idx]
            codes.append(idx)
    return jnp.stack(codes, axis=1)


def twin_dequantize(cfg: CodecConfig, params: CodecParams, codes):
    """`dequantize` on the twin kernels: per quantizer the entries summed in book order from +0, its
    output projection a twin conv1d; semantic part plus acoustic part (`quantizer.decode_twin`)."""
    s = cfg.semantic_codebooks
    out = None
    for first, books, proj in zip((0, s), (params.codebooks[:s], params.codebooks[s:]), params.output_proj,
                                  strict=True):
        if not books.shape[0]:
            continue
        total = jnp.zeros((), books.dtype)
        for i in range(books.shape[0]):
            total = total + jnp.take(books[i], codes[:, first + i], axis=0, mode="fill", fill_value=jnp.nan)
        part = twin_conv.conv1d(total[..., None], proj)
        out = part if out is None else out + part
    return out


class CodecOps(NamedTuple):
    """The float operations of a codec step: conv_step(spec, weight, bias, packed, slot, x, active, first,
    residual) -> (y, packed) (`conv_step`); quantize(cfg, params, emb); dequantize(cfg, params, codes)."""

    conv_step: Any
    quantize: Any
    dequantize: Any


REFERENCE_OPS = CodecOps(_reference_conv_step, quantize, dequantize)
TWIN_OPS = CodecOps(_twin_conv_step, twin_quantize, twin_dequantize)
CODEC_KERNELS = ("reference", "twin")


def codec_ops(kernels: str) -> CodecOps:
    """The ops of `kernels` ("reference" or "twin"); ValueError naming the argument otherwise."""
    if kernels not in CODEC_KERNELS:
        raise ValueError(f"kernels must be one of {CODEC_KERNELS} for the codec, got {kernels!r}")
    return TWIN_OPS if kernels == "twin" else REFERENCE_OPS


def check_codec_options(op: str, cfg, kernels) -> CodecOps:
    """The ops of `kernels` after checking a codec step's maker `op`'s arguments, before anything is
    traced: cfg a `CodecConfig` (TypeError), kernels one of CODEC_KERNELS, and for "twin" a transformer
    head dim the twins take (ValueError, `kernel_choice.check_head_dim`)."""
    if not isinstance(cfg, CodecConfig):
        raise TypeError(f"{op}(cfg): cfg must be a CodecConfig, got {type(cfg).__name__}")
    ops = codec_ops(kernels)
    check_head_dim(f"{op}(kernels)", cfg, kernels)
    return ops


def _transformer_options(kernels: str, rope_freqs) -> dict:
    """The transformers' `step_fn` options: the twin step with torch's RoPE table, or the default."""
    return {"kernels": "twin", "rope_freqs": rope_freqs} if kernels == "twin" else {"rope_freqs": rope_freqs}


def _check_active(op: str, active, batch: int):
    return jnp.ones(batch, bool) if active is None else st.check_row_flags(op, "active", active, batch)


def _check_state(op: str, state) -> None:
    if not isinstance(state, CodecState):
        raise TypeError(f"{op}(state): expected a jax_impl.codec.CodecState, got {type(state).__name__}")
    st.check_live(f"{op}(state)", state)


def check_pcm(op: str, pcm, batch: int, frame_size: int, dtype) -> None:
    """Refuse, naming `op` and pcm, anything but an array [batch, 1, frame_size] of a float dtype that
    casts to the state's `dtype` exactly (ValueError for the shape, TypeError for the type or dtype). On the
    host before a call as well as when traced: jit would narrow a float64 numpy array to float32
    before a traced check could see it."""
    shape, pdtype = getattr(pcm, "shape", None), getattr(pcm, "dtype", None)
    if shape is None or pdtype is None:
        raise TypeError(f"{op}(pcm): pcm must be an array [B={batch}, 1, {frame_size}], got {type(pcm).__name__}")
    if tuple(shape) != (batch, 1, frame_size):
        raise ValueError(f"{op}(pcm): pcm must have shape [B={batch}, 1, frame_size={frame_size}] (rank 3), got "
                         f"{list(shape)}")
    try:
        name, want = jnp.dtype(pdtype).name, jnp.dtype(dtype).name
    except TypeError:
        raise TypeError(f"{op}(pcm): pcm must be a JAX or numpy array, got a {type(pcm).__name__} of dtype "
                        f"{pdtype}") from None
    if not jnp.issubdtype(pdtype, jnp.floating) or not exact_float_cast(name, want):
        raise TypeError(f"{op}(pcm): pcm has dtype {name}; the state holds {want} and takes only a float dtype "
                        f"that casts to it exactly")


def encode_fn(cfg: CodecConfig, *, kernels: str = "reference", rope_freqs: tuple[float, ...] | None = None):
    """The pure encode step `(params, state, pcm, active=None) -> (codes int32 [B, num_codebooks], state)`.

    pcm [B, 1, frame_size], of the state's dtype or one that widens to it exactly; inactive rows get
    zero codes and keep their state. Bad arguments raise when traced, naming the argument.
    kernels: "reference" (XLA; close to the torch reference codec) or "twin" (the twin kernels: the
    bits of `torch_bridge.MimiCodec(kernels="twin")`, whose `rope_freqs()` to pass)."""
    ops = check_codec_options("encode_fn", cfg, kernels)
    plan = encoder_plan(cfg)
    slots = carry_slots(plan)[0]
    transformer = step_fn(cfg.transformer, **_transformer_options(kernels, rope_freqs))

    def encode(params: CodecParams, state: CodecState, pcm, active=None):
        _check_state("encode", state)
        B, dtype = state.batch_size, state.encoder_transformer.k.dtype
        check_pcm("encode", pcm, B, cfg.frame_size, dtype)
        active = _check_active("encode", active, B)
        x = jnp.asarray(pcm).astype(dtype)
        emb, carries = run_plan(plan[:-1], params.convs, state.encoder, slots[:-1], x, active, state.first, ops)
        out, tr_state = transformer(params.encoder_transformer, state.encoder_transformer, emb.swapaxes(1, 2),
                                    active)
        down = plan[-1]
        emb, carries = conv_step(down, params.convs[down.key + ".weight"], None, carries, slots[-1],
                                 out.swapaxes(1, 2), active, state.first, ops)
        codes = jnp.where(active[:, None], ops.quantize(cfg, params, emb), 0)
        return codes, state._replace(encoder=carries, first=state.first & ~active, encoder_transformer=tr_state)

    return encode


def decode_fn(cfg: CodecConfig, *, kernels: str = "reference", rope_freqs: tuple[float, ...] | None = None):
    """The pure decode step `(params, state, codes, active=None) -> (pcm [B, 1, frame_size], state)`.

    codes [B, num_codebooks], int32 or int64, each in 0..codebook_size-1 (`make_codec_step`'s decode
    checks concrete codes on the host; traced, an entry out of range is gathered as NaN: that row's PCM
    is NaN, never a wrapped code). Inactive rows get zeros and keep their state. kernels, rope_freqs:
    as `encode_fn`'s."""
    ops = check_codec_options("decode_fn", cfg, kernels)
    plan = decoder_plan(cfg)
    slots = carry_slots(plan)[0]
    transformer = step_fn(cfg.transformer, **_transformer_options(kernels, rope_freqs))

    def decode(params: CodecParams, state: CodecState, codes, active=None):
        _check_state("decode", state)
        B = state.batch_size
        check_codes_layout(cfg, codes, B)
        active = _check_active("decode", active, B)
        codes = jnp.where(active[:, None], jnp.asarray(codes), 0)
        emb = ops.dequantize(cfg, params, codes)
        up = plan[0]
        emb, carries = conv_step(up, params.convs[up.key + ".weight"], None, state.decoder, slots[0], emb, active,
                                 state.first, ops)
        out, tr_state = transformer(params.decoder_transformer, state.decoder_transformer, emb.swapaxes(1, 2),
                                    active)
        pcm, carries = run_plan(plan[1:], params.convs, carries, slots[1:], out.swapaxes(1, 2), active, state.first,
                                ops)
        pcm = jnp.where(active[:, None, None], pcm, 0)
        return pcm, state._replace(decoder=carries, decoder_transformer=tr_state)

    return decode


def check_codes_layout(cfg: CodecConfig, codes, batch: int) -> None:
    st.check_array("decode(codes)", codes)
    dtype = jnp.dtype(codes.dtype)
    if dtype not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64)):
        raise TypeError(f"decode(codes): codes must be int32 or int64, got {dtype}")
    if tuple(jnp.shape(codes)) != (batch, cfg.num_codebooks):
        raise ValueError(f"decode(codes): codes must have shape [B={batch}, num_codebooks={cfg.num_codebooks}], "
                         f"got {list(jnp.shape(codes))}")


def check_codes_range(cfg: CodecConfig, codes, active=None) -> None:
    """Host check of concrete codes (active rows): every code in 0..codebook_size-1, else ValueError."""
    values = np.asarray(codes)
    bad = (values < 0) | (values >= cfg.codebook_size)
    if active is not None:
        bad &= np.asarray(active)[:, None]
    if bad.any():
        row, book = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"decode(codes): codes must be in 0..{cfg.codebook_size - 1} (codebook_size); "
                         f"codes[{row}, {book}] = {int(values[row, book])}")


def codec_offsets(state: CodecState) -> dict[str, jax.Array]:
    """The transformers' offset arrays [B] by name: encoder_transformer.offset (`downsample_stride` positions
    an encode), decoder_transformer.offset (as many a decode)."""
    return {"encoder_transformer.offset": state.encoder_transformer.offset,
            "decoder_transformer.offset": state.decoder_transformer.offset}


def _on_state_device(state: CodecState, x):
    """x committed to the state's device: a jitted step compiles per placement of its arguments, and
    a host or uncommitted array (numpy, `jnp.asarray`) would otherwise make a second program beside
    the one for committed arrays (a step's own outputs)."""
    if isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                                     and not x.committed):
        return jax.device_put(x, state.first.sharding)
    return x


def make_codec_step(cfg: CodecConfig, *, kernels: str = "reference", rope_freqs: tuple[float, ...] | None = None):
    """(encode, decode): `encode_fn` / `decode_fn` jitted with the state donated (updated in place; keep
    only the returned state). A refused call raises with the caller's state untouched and valid: the
    shape and dtype checks raise while tracing, before anything runs, and decode reads concrete codes
    on the host for their range before the donated call. Host or uncommitted pcm, codes and active
    are committed to the state's device first (`init_codec_state` commits the state): one program
    each for every call. kernels, rope_freqs: as `encode_fn`'s.

    A step that would take a transformer's offset past the index dtype (`state.OffsetBounds`: int32's
    2**31 - 1 positions, ~2.7 years of frames at `downsample_stride` = 2; no device read a step) raises
    OverflowError before the call, the state untouched: `jit_codec_reset_slot` the row first."""
    check_codec_options("make_codec_step", cfg, kernels)
    return _codec_steps(cfg, kernels, None if rope_freqs is None else tuple(rope_freqs))


@backend.per_backend
def _codec_steps(cfg: CodecConfig, kernels: str, rope_freqs: tuple[float, ...] | None):
    """`make_codec_step`'s pair, made once per (config, kernels, RoPE table) however it is asked for."""
    codec_ops(kernels)  # ValueError naming kernels, before anything is traced
    jit_encode = jax.jit(backend.traced_on(encode_fn(cfg, kernels=kernels, rope_freqs=rope_freqs)), donate_argnums=(1,))
    jit_decode = jax.jit(backend.traced_on(decode_fn(cfg, kernels=kernels, rope_freqs=rope_freqs)), donate_argnums=(1,))

    T = cfg.downsample_stride  # the transformers' positions a frame

    def stepped(op: str, moved: str, jitted, params, state, x, active):
        """jitted(...) after checking the room of the offsets (`moved` advances T positions,
        `state.OffsetBounds.step`)."""
        return st.OFFSET_BOUNDS.step(f"{op}(state)", "jit_codec_reset_slot", codec_offsets,
                                     lambda name: T if name == moved else 0, state,
                                     lambda s: jitted(params, s, _on_state_device(s, x), _on_state_device(s, active)))

    def encode(params, state, pcm, active=None):
        _check_state("encode", state)
        check_pcm("encode", pcm, state.batch_size, cfg.frame_size, state.encoder_transformer.k.dtype)
        _check_active("encode", active, state.batch_size)
        return stepped("encode", "encoder_transformer.offset", jit_encode, params, state, pcm, active)

    def decode(params, state, codes, active=None):
        _check_state("decode", state)
        check_codes_layout(cfg, codes, state.batch_size)
        rows = _check_active("decode", active, state.batch_size)
        if not isinstance(codes, jax.core.Tracer):
            check_codes_range(cfg, codes, None if isinstance(rows, jax.core.Tracer) else rows)
        return stepped("decode", "decoder_transformer.offset", jit_decode, params, state, codes, active)

    return encode, decode


def codec_reset_slot(state: CodecState, b) -> CodecState:
    """Row b starts a fresh session: its carries zeroed, its first-frame flag set, both transformers'
    row reset to position 0 with zeroed rings (`state.reset_rows`)."""
    row = st.row_mask("reset_slot", state.encoder_transformer, b)

    def clear(carries):
        return jnp.where(row[:, None], jnp.zeros((), carries.dtype), carries)

    return CodecState(clear(state.encoder), clear(state.decoder), state.first | row,
                      st.reset_rows(state.encoder_transformer, row), st.reset_rows(state.decoder_transformer, row))


_jit_codec_reset_slot = jax.jit(codec_reset_slot, donate_argnums=(0,))


def jit_codec_reset_slot(state: CodecState, b) -> CodecState:
    """`codec_reset_slot` jitted once for every row (b traced), state donated; a concrete b is checked
    on the host first (IndexError / TypeError, state untouched)."""
    _check_state("reset_slot", state)
    if not isinstance(b, jax.core.Tracer):
        st.check_row("reset_slot", state.encoder_transformer, b)
    return _jit_codec_reset_slot(state, b)
