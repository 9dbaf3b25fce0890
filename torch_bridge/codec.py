"""`MimiCodec`: the Mimi codec around the project's Mimi transformers, streaming one frame a call.

Torch reference, bit-exact on the CPU in float32 with moshi 0.2.13's streaming `MimiModel.encode` /
`decode` (`with mimi.streaming(B)`), frame by frame:

    encode_frame: pcm [B, 1, frame_size] -> SEANet encoder -> encoder transformer (T = 2 frames)
                  -> downsample -> quantizer -> codes int64 [B, num_codebooks]
    decode_frame: codes -> quantizer -> upsample -> decoder transformer -> SEANet decoder
                  -> pcm [B, 1, frame_size]

The convolutions are `seanet.py`, the quantizer `quantizer.py`, the transformers two
`MimiTransformer`s (`encoder_transformer`, `decoder_transformer`). kernels="twin" runs all of it on
the twin kernels instead (`kernels_triton.twin_conv`, the transformers' twins): the bits of the JAX
codec's kernels="twin" (`jax_impl.codec`), not moshi's. Weights are buffers named by
`conv_buffer_name(checkpoint key)`, `codebooks`, `input_proj` / `output_proj` [2, ...] (semantic, acoustic).

Streaming state (`CodecState`): each convolution's carry (`seanet.py`), the downsample's first-frame
flags, and the transformers' rings. Per row: `active` (an inactive row's state does not move and
its outputs are zeros) and `reset_slot(b)` (a fresh session in row b: carries zeroed, the
transformers' rows reset, so nothing of the old session, a NaN neither, reaches the new one).
Rows never mix: a NaN in one row's PCM reaches no other row. A frame that would take a transformer's
offset past the JAX codec's index dtype (int32 unless jax's x64 mode is on) raises OverflowError with
nothing changed (`check_room`), as the JAX codec's steps do: `reset_slot` the row first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from jax_impl.checkpoint import (
    MIMI_PREFIXES,
    CheckpointError,
    check_checkpoint,
    check_fit,
)
from jax_impl.codec_config import (
    CodecConfig,
    codec_weight_shapes,
    decoder_plan,
    encoder_plan,
    quantizer_keys,
)
from jax_impl.config import check_batch_size
from jax_impl.kernel_choice import check_head_dim
from jax_impl.snapshot import dtype_name, exact_float_cast, row_index

from . import quantizer, seanet
from .frame import check_offset_room
from .layers import check_triton_device
from .model import FLOAT_DTYPES, MimiTransformer
from .weights import ExactLoads, as_tensor, source_problem

# "reference": torch's ops, bit-exact with moshi; "twin": the twin kernels (`kernels_triton.twin_conv`
# and the transformers' twins), bit-identical with the JAX codec's kernels="twin".
CODEC_KERNELS = ("reference", "twin")


def conv_buffer_name(key: str) -> str:
    """The buffer holding checkpoint tensor `key` (`encoder.model.0.conv.conv.weight` -> `encoder_model_0_conv_conv_weight`)."""
    return key.replace(".", "_")


@dataclass
class CodecState:
    """A streaming codec's state besides its transformers' own (`encoder_transformer.state`, ...).

    encoder, decoder: the carries of `plan_convs(encoder_plan)` / `(decoder_plan)`, in order, [B, C, width].
    first: bool [B], True until a row's first active frame (the downsample's replicate padding).
    """

    encoder: list[torch.Tensor]
    decoder: list[torch.Tensor]
    first: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.first.shape[0]


class MimiCodec(ExactLoads, nn.Module):
    """The Mimi codec, streaming (inference only: weights are buffers, calls run under no_grad)."""

    def __init__(self, config: CodecConfig, dtype: torch.dtype = torch.float32, device=None,
                 kernels: str = "reference"):
        super().__init__()
        if not isinstance(config, CodecConfig):
            raise TypeError(f"config must be a CodecConfig, got {type(config).__name__}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        if kernels not in CODEC_KERNELS:
            raise ValueError(f"kernels must be one of {CODEC_KERNELS} for the codec, got {kernels!r}")
        check_head_dim("MimiCodec(kernels)", config, kernels)
        if kernels == "twin":
            check_triton_device(device, "MimiCodec(kernels='twin')")
        self.config = config
        self.kernels = kernels
        self.encoder_plan, self.decoder_plan = encoder_plan(config), decoder_plan(config)
        self._conv_keys = [key for key in codec_weight_shapes(config) if not key.startswith("quantizer.")]
        shapes = codec_weight_shapes(config)
        for key in self._conv_keys:
            self.register_buffer(conv_buffer_name(key), torch.empty(shapes[key], dtype=dtype, device=device))
        c = config
        self.register_buffer("codebooks", torch.empty(c.num_codebooks, c.codebook_size, c.codebook_dim,
                                                      dtype=dtype, device=device))
        self.register_buffer("input_proj", torch.empty(2, c.codebook_dim, c.dimension, 1, dtype=dtype, device=device))
        self.register_buffer("output_proj", torch.empty(2, c.dimension, c.codebook_dim, 1, dtype=dtype, device=device))
        self.encoder_transformer = MimiTransformer.from_config(c.transformer, dtype=dtype, device=device,
                                                               kernels=kernels)
        self.decoder_transformer = MimiTransformer.from_config(c.transformer, dtype=dtype, device=device,
                                                               kernels=kernels)
        self._ops = seanet.twin_ops() if kernels == "twin" else seanet.REFERENCE_OPS
        self._encode, self._decode = ((quantizer.encode_twin, quantizer.decode_twin) if kernels == "twin"
                                      else (quantizer.encode, quantizer.decode))
        self._state: CodecState | None = None
        self.init_weights()

    @classmethod
    def from_config(cls, config: CodecConfig, *, dtype: torch.dtype = torch.float32, device=None,
                    kernels: str = "reference") -> MimiCodec:
        return cls(config, dtype=dtype, device=device, kernels=kernels)

    @property
    def dtype(self) -> torch.dtype:
        return self.codebooks.dtype

    @property
    def device(self) -> torch.device:
        return self.codebooks.device

    # ----------------------------------------------------------------------------- weights
    def conv_weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint key -> the buffer (not a copy) of every convolution weight and bias."""
        return {key: getattr(self, conv_buffer_name(key)) for key in self._conv_keys}

    def jax_params(self):
        """The JAX codec's `jax_impl.codec.CodecParams`: zero-copy DLPack views of these buffers."""
        from jax_impl.codec import CodecParams
        from jax_impl.weights import nest_params

        from .dlpack import to_jax

        stacks = [nest_params(tr.config, {name: to_jax(w) for name, w in tr.weights().items()})
                  for tr in (self.encoder_transformer, self.decoder_transformer)]
        return CodecParams({k: to_jax(w) for k, w in self.conv_weights().items()}, to_jax(self.codebooks),
                           to_jax(self.input_proj), to_jax(self.output_proj), *stacks)

    def rope_freqs(self) -> tuple[float, ...]:
        """The transformers' RoPE frequency table (the JAX codec's `rope_freqs`, for the same bits)."""
        return self.encoder_transformer.rope_freqs()

    def _projections(self):
        return tuple(zip(self.input_proj, self.output_proj, strict=True))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random weights: convolutions ~ N(0, 1/fan_in), biases ~ N(0, 0.01^2), entries ~ N(0, 1);
        the transformers' own `init_weights`."""
        for key, w in self.conv_weights().items():
            fan_in = w[0].numel() if key.endswith(".weight") else 1e4
            w.copy_(torch.randn(w.shape, generator=generator, device=w.device) / fan_in ** 0.5)
        for w in (self.input_proj, self.output_proj):
            w.copy_(torch.randn(w.shape, generator=generator, device=w.device) / w.shape[2] ** 0.5)
        self.codebooks.copy_(torch.randn(self.codebooks.shape, generator=generator, device=self.device))
        self.encoder_transformer.init_weights(generator=generator)
        self.decoder_transformer.init_weights(generator=generator)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor | np.ndarray], *,
                     source: str = "state_dict") -> None:
        """Load a moshi `MimiModel.state_dict()` (the released `tokenizer-*.safetensors` names).

        All or nothing: every key, shape and dtype (float32, bfloat16 or float16, widened exactly,
        never narrowed) is checked first, and every problem of the codec and of both transformers
        is listed in one `CheckpointError` headed by `source`; then the codec's tensors are
        converted, and only then is anything written. The checkpoint's `total_codebooks` books must
        all be there; the first `num_codebooks` are kept, as entries (`quantizer.codebook_entries`).
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{source}: expected a mapping key -> tensor, got {type(state_dict).__name__}")
        problems: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...] | None] = {}
        for key, value in state_dict.items():
            shapes[key] = tuple(value.shape) if isinstance(value, (torch.Tensor, np.ndarray)) else None
            if line := source_problem(key, value, self.dtype):
                problems[key] = line
        expected = codec_weight_shapes(self.config)
        transformer = tuple(prefix + "." for prefix in MIMI_PREFIXES)
        own = {k: s for k, s in shapes.items() if not k.startswith(transformer)}
        messages, lines = [], []
        checks = [lambda: check_fit(f"{source} does not fit the codec {self.config.frame_size}-sample frame",
                                    expected, own, [line for k, line in problems.items() if k in own])]
        checks += [lambda p=prefix: check_checkpoint(shapes, self.config.transformer, p, source=source,
                                                     problems=problems) for prefix in MIMI_PREFIXES]
        for check in checks:
            try:
                check()
            except CheckpointError as err:
                messages.append(str(err))
                lines += err.problems
        if messages:
            raise CheckpointError("\n".join(messages), problems=lines)

        def tensor(key):
            return as_tensor(state_dict[key]).to(device=self.device, dtype=self.dtype)

        staged = [(getattr(self, conv_buffer_name(k)), tensor(k)) for k in self._conv_keys]
        books = []
        for group, (prefix, first, count) in enumerate(quantizer_keys(self.config)):
            staged += [(self.input_proj[group], tensor(f"{prefix}.input_proj.weight")),
                       (self.output_proj[group], tensor(f"{prefix}.output_proj.weight"))]
            used = min(count, self.config.num_codebooks - first)
            books += [quantizer.codebook_entries(tensor(f"{prefix}.vq.layers.{i}._codebook.embedding_sum"),
                                                 tensor(f"{prefix}.vq.layers.{i}._codebook.cluster_usage"))
                      for i in range(used)]
        staged.append((self.codebooks, torch.stack(books)))
        for tr, prefix in zip((self.encoder_transformer, self.decoder_transformer), MIMI_PREFIXES, strict=True):
            tr.load_weights({k: v for k, v in state_dict.items() if k.startswith(prefix + ".")}, prefix,
                            source=source)
        for dst, src in staged:
            dst.copy_(src)

    # ----------------------------------------------------------------------------- streaming
    @property
    def state(self) -> CodecState | None:
        """The convolutions' state (None before `streaming_init`); the transformers hold their own."""
        return self._state

    def streaming_init(self, batch_size: int) -> None:
        """A fresh stream of `batch_size` rows: carries zeroed, transformers' rings fresh."""
        batch_size = check_batch_size("MimiCodec.streaming_init", batch_size)
        self._state = CodecState(seanet.conv_carries(self.encoder_plan, batch_size, self.dtype, self.device),
                                 seanet.conv_carries(self.decoder_plan, batch_size, self.dtype, self.device),
                                 torch.ones(batch_size, dtype=torch.bool, device=self.device))
        self.encoder_transformer.streaming_init(batch_size)
        self.decoder_transformer.streaming_init(batch_size)

    def _require_state(self, op: str) -> CodecState:
        if self._state is None:
            raise RuntimeError(f"{op}() called before streaming_init(batch_size)")
        return self._state

    @torch.no_grad()
    def reset_slot(self, b: int) -> None:
        """Row b starts a fresh session: its carries zeroed, its first-frame flag set, the transformers'
        row reset to position 0 with zeroed rings (`MimiTransformer.reset_rows`)."""
        state = self._require_state("reset_slot")
        b = row_index("reset_slot", b, state.batch_size)
        for carry in state.encoder + state.decoder:
            carry[b].zero_()
        state.first[b] = True
        rows = torch.arange(state.batch_size, device=self.device) == b
        self.encoder_transformer.reset_rows(rows)
        self.decoder_transformer.reset_rows(rows)

    def offsets(self) -> dict[str, torch.Tensor]:
        """The transformers' offsets (int64 [B]) by name, as `jax_impl.codec.codec_offsets` names the JAX
        state's: encoder_transformer.offset, decoder_transformer.offset (`downsample_stride` positions a
        frame each, on encode and on decode)."""
        return {"encoder_transformer.offset": self.encoder_transformer.state.offset,
                "decoder_transformer.offset": self.decoder_transformer.state.offset}

    def check_room(self, op: str, moved: str) -> None:
        """OverflowError headed by `op` (`frame.check_offset_room`) if a frame advancing `moved` (an
        `offsets()` name) would take an offset past the JAX steps' index dtype: `reset_slot` the row."""
        offsets = self.offsets()
        advance = dict.fromkeys(offsets, 0) | {moved: self.config.downsample_stride}
        check_offset_room(op, "reset_slot", offsets, advance)

    def check_pcm(self, op: str, pcm) -> None:
        """Refuse, naming `op` and pcm, anything but a tensor [B, 1, frame_size] (B: the stream's) on the
        codec's device of a float dtype that casts to the codec's exactly: TypeError for the type or
        dtype, ValueError for the shape or device (`jax_impl.codec.check_pcm`'s rule)."""
        state = self._require_state(op)
        if not isinstance(pcm, torch.Tensor):
            raise TypeError(f"{op}(pcm): pcm must be a torch.Tensor, got {type(pcm).__name__}")
        if tuple(pcm.shape) != (state.batch_size, 1, self.config.frame_size):
            raise ValueError(f"{op}(pcm): pcm must have shape [B={state.batch_size}, 1, "
                             f"frame_size={self.config.frame_size}] (rank 3), got {list(pcm.shape)}")
        if not pcm.is_floating_point() or not exact_float_cast(dtype_name(pcm), dtype_name(self.dtype)):
            raise TypeError(f"{op}(pcm): pcm has dtype {pcm.dtype}; the codec holds {self.dtype} and "
                            f"takes only a dtype that casts to it exactly")
        if pcm.device != self.device:
            raise ValueError(f"{op}(pcm): pcm is on {pcm.device}; the codec is on {self.device}")

    def check_active(self, op: str, active, state: CodecState) -> torch.Tensor:
        """active itself (a torch.bool [B] on the codec's device; None: every row) after checking it:
        TypeError for the type or dtype, ValueError for the shape or device, naming `op`."""
        if active is None:
            return torch.ones(state.batch_size, dtype=torch.bool, device=self.device)
        if not isinstance(active, torch.Tensor) or active.dtype != torch.bool:
            raise TypeError(f"{op}(active): active must be a torch.bool tensor, got "
                            f"{getattr(active, 'dtype', type(active).__name__)}")
        if tuple(active.shape) != (state.batch_size,) or active.device != self.device:
            raise ValueError(f"{op}(active): active must have shape [{state.batch_size}] on {self.device}, got "
                             f"{list(active.shape)} on {active.device}")
        return active

    @torch.no_grad()
    def encode_frame(self, pcm: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """pcm [B, 1, frame_size] (the codec's dtype, or one that widens to it exactly) -> codes int64
        [B, num_codebooks]; inactive rows get zeros and keep their state."""
        state = self._require_state("encode_frame")
        c = self.config
        self.check_pcm("encode_frame", pcm)
        active = self.check_active("encode_frame", active, state)
        self.check_room("encode_frame", "encoder_transformer.offset")
        weights = self.conv_weights()
        plan, carries = self.encoder_plan, state.encoder
        emb, new = seanet.run_plan(plan[:-1], weights, carries[:-1], pcm.to(self.dtype), active, state.first,
                                   self._ops)
        emb = self.encoder_transformer.step(emb.transpose(1, 2).contiguous(), active).transpose(1, 2)
        down = plan[-1]
        emb, last = seanet.conv_step(down, weights[down.key + ".weight"], None, carries[-1], emb, active, state.first,
                                     self._ops)
        codes = self._encode(emb, self.codebooks, self._projections(), c.semantic_codebooks)[..., 0]
        state.encoder = [*new, last]
        state.first = state.first & ~active
        return torch.where(active[:, None], codes, torch.zeros_like(codes))

    @torch.no_grad()
    def decode_frame(self, codes: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """codes [B, num_codebooks] (int32 or int64, each in 0..codebook_size-1) -> pcm [B, 1, frame_size]
        in the codec's dtype; inactive rows get zeros and keep their state."""
        state = self._require_state("decode_frame")
        c = self.config
        if not isinstance(codes, torch.Tensor) or codes.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"decode_frame(codes): codes must be an int32 or int64 torch.Tensor, got "
                            f"{getattr(codes, 'dtype', type(codes).__name__)}")
        if tuple(codes.shape) != (state.batch_size, c.num_codebooks):
            raise ValueError(f"decode_frame(codes): codes must have shape [B={state.batch_size}, "
                             f"num_codebooks={c.num_codebooks}], got {list(codes.shape)}")
        if codes.device != self.device:
            raise ValueError(f"decode_frame(codes): codes are on {codes.device}; the codec is on {self.device}")
        active = self.check_active("decode_frame", active, state)
        bad = ((codes < 0) | (codes >= c.codebook_size)) & active[:, None]
        if bad.any():
            row, book = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"decode_frame(codes): codes must be in 0..{c.codebook_size - 1} (codebook_size); "
                             f"codes[{row}, {book}] = {int(codes[row, book])}")
        self.check_room("decode_frame", "decoder_transformer.offset")
        weights = self.conv_weights()
        plan, carries = self.decoder_plan, state.decoder
        safe = torch.where(active[:, None], codes.long(), torch.zeros_like(codes, dtype=torch.long))
        emb = self._decode(safe[..., None], self.codebooks, self._projections(), c.semantic_codebooks)
        up = plan[0]
        emb, up_carry = seanet.conv_step(up, weights[up.key + ".weight"], None, carries[0], emb, active, state.first,
                                         self._ops)
        emb = self.decoder_transformer.step(emb.transpose(1, 2).contiguous(), active).transpose(1, 2)
        pcm, rest = seanet.run_plan(plan[1:], weights, carries[1:], emb, active, state.first, self._ops)
        state.decoder = [up_carry, *rest]
        return torch.where(active[:, None, None], pcm, torch.zeros_like(pcm))
