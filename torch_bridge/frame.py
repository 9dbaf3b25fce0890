"""The whole language-model frame, PyTorch: bit-exact with moshi's `LMGen.step` on the CPU (the
reference kernels), or on the Triton twins (`kernels="twin"`): the bits of the JAX frame
`jax_impl.frame.make_frame_step(cfg, kernels="twin")`, whatever the batch.

    frame = LMFrame.from_config(FRAME_PRESETS["moshi"])
    frame.load_weights(lm_model.state_dict())         # or a released file's tensors
    frame.streaming_init(batch_size=4)
    out = frame.step(user_tokens, active)             # FrameOutput: tokens [B, 1 + dep_q], text, audio, logits
    frame.reset_slot(2)                               # recycle row 2 for a new session

What a frame computes, and the token ids: `jax_impl.frame_config`. The frame holds the temporal
stack (`TemporalStreaming`: its K/V rings and offsets), the input tables (`text_emb`, `emb[k]`),
the `Depformer`, and per row the token cache `[B, 1 + n_q, max_delay + 2]` (moshi's `_LMGenState.cache`)
and the frame offset (moshi's `offsets`: frames stepped since the row's session began).

Early exit (`dep_q_exit = N < dep_q`): the depformer runs its first N inner steps only, and the
caller gives the frame's audio tokens of codebooks N..dep_q-1 (`replace_audio [B, dep_q - N]`),
in the model's delayed time, as the depformer would have emitted them (moshi's
`depformer_replace_tokens`, for the tail only): in serving the user-side codebooks the depformer
would predict are overwritten by the user's own audio. They go into the cache and the next
frame's input like generated tokens.

Kernels: "reference" (torch ops: moshi's bits) or "twin": the temporal stack (its text head
included) and the depformer on their Triton twins (`TemporalStreaming(kernels="twin")`,
`Depformer(kernels="twin")`), the embeddings' sum in float32 in a fixed order, rounded once
(`frame_input`); the embedding lookups, the token cache and the sampler are exact on both paths.

Sampling: greedy by default; `temperature` / `top_k` (audio) and `text_temperature` / `text_top_k`
sample with `torch_bridge.sampling` from the rows' `seeds`, at counters derived from each row's
frame offset (`TEXT_COUNTER_BASE`), so a row's draws do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jax_impl.checkpoint import CheckpointError, check_checkpoint
from jax_impl.config import check_batch_size
from jax_impl.depformer_config import DEPFORMER_PREFIXES, load_plan
from jax_impl.frame_config import (
    TEXT_COUNTER_BASE,
    UNGENERATED_TOKEN,
    FrameConfig,
    FrameOutput,
    check_frame_kernels,
    embedding_shapes,
)
from jax_impl.sampling_config import check_sampling
from jax_impl.snapshot import row_index

from .depformer import Depformer, check_ids, int_tensor
from .layers import check_triton_device
from .model import TemporalStreaming
from .sampling import check_randomness, sample
from .weights import ExactLoads, as_tensor, source_problem

EMBEDDING_PREFIXES = ("text_emb.", "emb.")


def scaled_embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """moshi's `ScaledEmbedding`: ids [...] -> [..., dim] in the table's dtype; id -1 gives zeros."""
    y = F.embedding(ids.clamp(min=0), table)
    return torch.where((ids == -1)[..., None], torch.zeros((), dtype=y.dtype), y)


def frame_input(text_emb: torch.Tensor, emb: torch.Tensor, tokens_in: torch.Tensor, kernels: str) -> torch.Tensor:
    """The temporal stack's input [B, 1, dim] in the tables' dtype from tokens_in int [B, 1 + n_q]
    (text first): the audio tables' embeddings emb [n_q, card + 1, dim], then the text table's,
    added left to right (moshi's order). "reference" adds in the tables' dtype (moshi's roundings);
    "twin" adds the float32 upcasts and rounds once (`jax_impl.frame.frame_input`: the same adds in
    the same order). In float32 the two are the same bits."""
    acc = torch.float32 if kernels == "twin" else text_emb.dtype
    x = scaled_embedding(emb[0], tokens_in[:, 1]).to(acc)
    for k in range(1, emb.shape[0]):
        x = x + scaled_embedding(emb[k], tokens_in[:, 1 + k]).to(acc)
    return (x + scaled_embedding(text_emb, tokens_in[:, 0]).to(acc)).to(text_emb.dtype)[:, None]


def check_tokens(name: str, x, shape: tuple[int, ...], high: int, device) -> torch.Tensor:
    """x as int64 after checking it: an integer tensor of `shape` on `device` holding ids in 0..high or -1."""
    return check_ids(name, int_tensor(name, x, shape, device), high)


def check_offset_room(where: str, recycle: str, offsets: Mapping[str, torch.Tensor],
                      advance: Mapping[str, int]) -> None:
    """Refuse (OverflowError headed by `where`, naming the tensor, the row and `recycle`: what puts a
    row's positions back to 0) a step that would advance some row of `offsets` (name -> int64 [B]) by
    advance[name] positions past int32's 2**31 - 1: the JAX frames' offsets are int32 (unless jax's
    x64 mode is on) and refuse that step (`jax_impl.state.OffsetBounds`), so both sides refuse the
    same step where int64 offsets alone would go on. Cost: the offsets' maxima read on the host, once
    a call (a device sync on a GPU, as the steps' token and code checks make)."""
    limit = int(np.iinfo(np.int32).max)
    tops = torch.stack([t.max() for t in offsets.values()]).tolist()
    for (name, t), top in zip(offsets.items(), tops, strict=True):
        if top + advance[name] > limit:
            raise OverflowError(
                f"{where}: {name}[{int(t.argmax())}] is {top}: {advance[name]} more position(s) would pass "
                f"{limit}, the largest int32 offset of the JAX steps; recycle the row first ({recycle}: its "
                f"positions back to 0)")


class LMFrame(ExactLoads, nn.Module):
    """The temporal stack, its input tables, the text head and sampling, and the depformer, as one frame.

    kernels: "reference" or "twin" (module docstring), for the whole frame."""

    def __init__(self, config: FrameConfig, dtype=torch.float32, device=None, kernels: str = "reference"):
        super().__init__()
        if not isinstance(config, FrameConfig):
            raise TypeError(f"config must be a FrameConfig, got {type(config).__name__}")
        self.config, self.kernels = config, check_frame_kernels(config, kernels, "LMFrame(kernels)")
        if kernels == "twin":
            check_triton_device(device, "LMFrame(kernels='twin')")
        self.temporal = TemporalStreaming.from_config(config.temporal, dtype=dtype, device=device, kernels=kernels)
        self.depformer = Depformer.from_config(config.depformer, dtype=dtype, device=device, kernels=kernels)
        for name, shape in embedding_shapes(config).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.register_buffer("delays", torch.tensor(config.delays, device=device), persistent=False)
        self.register_buffer("initial", torch.tensor(config.initial_tokens, device=device), persistent=False)
        self.token_cache: torch.Tensor | None = None   # int64 [B, 1 + n_q, cache_len]
        self.frame_offset: torch.Tensor | None = None  # int64 [B]
        self.init_weights()

    @classmethod
    def from_config(cls, config: FrameConfig, *, dtype=torch.float32, device=None, kernels: str = "reference"):
        return cls(config, dtype=dtype, device=device, kernels=kernels)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_emb.dtype

    @property
    def device(self) -> torch.device:
        return self.text_emb.device

    # ----------------------------------------------------------------------------- weights
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Every matrix and table ~ N(0, std), norm scales at 1."""
        self.temporal.init_weights(std=std, generator=generator)
        self.depformer.init_weights(std=std, generator=generator)
        for name in embedding_shapes(self.config):
            w = getattr(self, name)
            w.copy_(torch.randn(w.shape, generator=generator, device=w.device) * std)

    def embedding_weights(self) -> dict[str, torch.Tensor]:
        """The input tables by name (the tensors themselves): text_emb, emb."""
        return {name: getattr(self, name) for name in embedding_shapes(self.config)}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under the released files' names (contiguous copies)."""
        out = {**self.temporal.export_weights(), **self.depformer.export_weights(),
               "text_emb.weight": self.text_emb.clone()}
        out.update({f"emb.{k}.weight": self.emb[k].clone() for k in range(self.config.n_q)})
        return out

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping, *, source: str = "state_dict") -> None:
        """Load the temporal stack, the input tables and the depformer from one state dict, all or nothing.

        Keys: a released file's or a moshi `LMModel.state_dict()`'s (`transformer.*`, `out_norm.alpha`,
        `text_linear.weight`, `text_emb.weight`, `emb.{k}.weight`, the depformer's); others are ignored.
        Every key, shape and dtype is checked before anything is written: one `CheckpointError` lists
        every problem of the three parts, and the frame is left as it was.
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{source}: expected a mapping key -> tensor, got {type(state_dict).__name__}")
        want = self.embedding_weights()
        tables = {"text_emb.weight": ("text_emb", None)}
        tables.update({f"emb.{k}.weight": ("emb", k) for k in range(self.config.n_q)})
        shapes, value_lines, errors = {}, {}, []
        for key, value in state_dict.items():
            shapes[key] = tuple(value.shape) if isinstance(value, (torch.Tensor, np.ndarray)) else None
            if line := source_problem(key, value, self.dtype):
                value_lines[key] = line
        lines = [f"missing: {key}" for key in tables if key not in shapes]
        for key, shape in shapes.items():
            if key.startswith(EMBEDDING_PREFIXES):
                if key not in tables:
                    lines.append(f"unexpected: {key}")
                    continue
                name, k = tables[key]
                expected = tuple(want[name].shape[1 if k is not None else 0:])
                if shape is not None and shape != expected:
                    lines.append(f"wrong shape: {key}: expected {list(expected)}, got {list(shape)}")
                if key in value_lines:
                    lines.append(value_lines[key])
        problems = list(lines)
        if lines:
            errors.append("\n".join([f"{source} does not fit the frame's input tables:", *("  " + x for x in lines)]))
        checks = (
            lambda: check_checkpoint(shapes, self.config.temporal, source=source, problems=value_lines),
            lambda: load_plan({k: s for k, s in shapes.items() if k.startswith(DEPFORMER_PREFIXES)},
                              self.config.depformer, source=source,
                              problems=[v for k, v in value_lines.items() if k.startswith(DEPFORMER_PREFIXES)]))
        for check in checks:
            try:
                check()
            except CheckpointError as err:
                errors.append(str(err))
                problems += err.problems
        if errors:
            raise CheckpointError("\n".join(errors), problems=problems)
        self.depformer.load_weights(state_dict, source=source)  # its copies' check may still refuse: first
        self.temporal.load_weights(state_dict, source=source)
        for key, (name, k) in tables.items():
            (want[name] if k is None else want[name][k]).copy_(as_tensor(state_dict[key]).to(dtype=self.dtype))

    # ----------------------------------------------------------------------------- streaming
    def streaming_init(self, batch_size: int) -> None:
        """Fresh state for `batch_size` rows (a Python or numpy integer >= 1): rings zeroed, caches 'not
        generated', offsets 0."""
        batch_size = check_batch_size("LMFrame.streaming_init", batch_size)
        self.temporal.streaming_init(batch_size)
        c = self.config
        self.token_cache = torch.full((batch_size, c.num_codebooks, c.cache_len), UNGENERATED_TOKEN,
                                      dtype=torch.long, device=self.device)
        self.frame_offset = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    @property
    def batch_size(self) -> int:
        if self.frame_offset is None:
            raise RuntimeError("the frame is not streaming: call streaming_init(batch_size) first")
        return self.frame_offset.shape[0]

    def offsets(self) -> dict[str, torch.Tensor]:
        """The offsets (int64 [B]) a step advances, by name, as `jax_impl.frame.frame_offsets` names the JAX
        state's: temporal.offset, frame_offset (1 a frame each)."""
        return {"temporal.offset": self.temporal.state.offset, "frame_offset": self.frame_offset}

    def check_row(self, op: str, b) -> int:
        """b as an int, after checking it is a row index of the stream (`snapshot.row_index`)."""
        return row_index(op, b, self.batch_size)

    def _check_mask(self, name: str, mask) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{name} must be a torch.bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != (self.batch_size,) or mask.device != self.device:
            raise ValueError(f"{name} must have shape [{self.batch_size}] on {self.device}, got "
                             f"{list(mask.shape)} on {mask.device}")
        return mask

    def reset_slot(self, b: int) -> None:
        """Row b starts a new session: its ring forgotten (the temporal `reset_slot`: positions keep
        counting), its frame offset back to 0 (initial tokens until the delays pass), its cache cleared."""
        b = self.check_row("reset_slot", b)
        self.temporal.reset_slot(b)
        self.frame_offset[b] = 0
        self.token_cache[b] = UNGENERATED_TOKEN

    def bump_slot_start(self, b: int) -> None:
        """The temporal stack's `bump_slot_start(b)` (after `reset_slot(b)`: the sacrifice tick)."""
        self.temporal.bump_slot_start(self.check_row("bump_slot_start", b))

    def reset_rows(self, mask: torch.Tensor) -> None:
        """Rows where mask [B] is True start a fresh stream, positions from 0 (moshi's
        `LMGen.reset_streaming(mask)`)."""
        mask = self._check_mask("reset_rows(mask)", mask)
        self.temporal.reset_rows(mask)
        self.frame_offset.masked_fill_(mask, 0)
        self.token_cache.masked_fill_(mask[:, None, None], UNGENERATED_TOKEN)

    # ----------------------------------------------------------------------------- one frame
    def check_dep_q_exit(self, dep_q_exit) -> int:
        dep_q = self.config.dep_q
        if dep_q_exit is None:
            return dep_q
        if not isinstance(dep_q_exit, int) or isinstance(dep_q_exit, bool) or not 1 <= dep_q_exit <= dep_q:
            raise ValueError(f"dep_q_exit must be an int in 1..{dep_q} (None: {dep_q}), got {dep_q_exit!r}")
        return dep_q_exit

    def check_sampling_args(self, seeds, temperature, top_k, text_temperature, text_top_k) -> None:
        """Refuse, naming the argument, the sampling arguments `step` would refuse (`check_sampling`;
        integer seeds [B] on the frame's device where a temperature is > 0)."""
        check_sampling(text_temperature, text_top_k, self.config.text_card)
        check_sampling(temperature, top_k, self.config.card)
        check_randomness(seeds, 0, self.batch_size, self.device, bool(temperature or text_temperature))

    @torch.no_grad()
    def step(self, user_tokens: torch.Tensor | None = None, active: torch.Tensor | None = None, *,
             replace_audio: torch.Tensor | None = None, dep_q_exit: int | None = None, seeds=None,
             temperature: float = 0.0, top_k: int = 0, text_temperature: float = 0.0,
             text_top_k: int = 0) -> FrameOutput:
        """One frame for every row (moshi's `LMGen.step`); inactive rows leave every state as it was.

        user_tokens [B, n_q - dep_q] int (0..card or -1): the caller's codebooks dep_q+1..n_q of
        this frame (None when there are none). active bool [B] (default: every row).
        dep_q_exit, replace_audio [B, dep_q - dep_q_exit] int: see the module docstring.
        seeds [B] int: the rows' sampling seeds (needed when a temperature is > 0).
        A frame that would take an offset past the JAX steps' index dtype (`check_offset_room`) raises
        OverflowError, nothing changed: `reset_rows` the row first (`reset_slot` keeps its positions).
        """
        c = self.config
        B = self.batch_size
        user = check_tokens("user_tokens", torch.zeros(B, 0, dtype=torch.long, device=self.device)
                            if user_tokens is None and not c.user_codebooks else user_tokens,
                            (B, c.user_codebooks), c.card, self.device)
        active = torch.ones(B, dtype=torch.bool, device=self.device) if active is None \
            else self._check_mask("step(active)", active)
        n = self.check_dep_q_exit(dep_q_exit)
        if (replace_audio is None) != (n == c.dep_q):
            raise ValueError(f"replace_audio must be given exactly when dep_q_exit < dep_q ({c.dep_q}): "
                             f"dep_q_exit {n}, replace_audio {'None' if replace_audio is None else 'given'}")
        tail = None if replace_audio is None else check_tokens("replace_audio", replace_audio, (B, c.dep_q - n),
                                                                c.card, self.device)
        self.check_sampling_args(seeds, temperature, top_k, text_temperature, text_top_k)
        offsets = self.offsets()
        check_offset_room("step", "reset_rows", offsets, dict.fromkeys(offsets, 1))

        # every argument is checked above, before anything moves; the token cache and frame offsets are
        # copied back at the end, but the temporal stack's ring and offsets move when it steps: an error
        # raised after that (a kernel failing on its device) leaves the stack a frame ahead of the cache:
        # start the rows afresh (`reset_rows`)
        cache, offset, CT = self.token_cache.clone(), self.frame_offset.clone(), c.cache_len
        run = active[:, None, None]
        if c.user_codebooks:  # the caller's codebooks, written delay frames ahead
            pos = ((offset[:, None] + self.delays[c.dep_q + 1:]) % CT)[..., None]
            user_cache = cache[:, c.dep_q + 1:]
            user_cache.scatter_(-1, pos, torch.where(run, user[..., None], user_cache.gather(-1, pos)))
        is_init = (offset[:, None] <= self.delays) | ~active[:, None]
        tokens_in = cache.gather(-1, (offset % CT)[:, None, None].expand(B, c.num_codebooks, 1))[..., 0]
        x = frame_input(self.text_emb, self.emb, torch.where(is_init, self.initial, tokens_in), self.kernels)
        transformer_out, text_logits = self.temporal.step(x, active)
        text_logits = text_logits[:, 0, 0].float()
        text = sample(text_logits, seeds, offset + TEXT_COUNTER_BASE, temperature=text_temperature, top_k=text_top_k)
        codes, audio_logits = self.depformer(text, transformer_out, return_logits=True, temperature=temperature,
                                             top_k=top_k, seeds=seeds, counter=offset, steps=n)
        audio = codes if tail is None else torch.cat([codes, tail], dim=1)

        offset.copy_(torch.where(active, offset + 1, offset))
        pos = (offset % CT)[:, None, None].expand(B, 1 + c.dep_q, 1)
        written = cache[:, :1 + c.dep_q]
        written.scatter_(-1, pos, torch.where(run, torch.cat([text[:, None], audio], 1)[..., None],
                                              written.gather(-1, pos)))
        index = ((offset[:, None] - c.max_delay + self.delays[:1 + c.dep_q]) % CT)[..., None]
        tokens = cache.gather(-1, index)[..., 0]
        not_ready = ((offset <= c.max_delay) | ~active)[:, None]
        self.token_cache.copy_(cache)
        self.frame_offset.copy_(offset)
        ungenerated = torch.full((), UNGENERATED_TOKEN, device=self.device)
        return FrameOutput(tokens=torch.where(not_ready, ungenerated, tokens),
                           text=torch.where(active, text, ungenerated),
                           audio=torch.where(active[:, None], audio, ungenerated),
                           text_logits=text_logits, audio_logits=audio_logits, transformer_out=transformer_out)


def jax_frame_params(frame: LMFrame) -> dict:
    """The JAX frame's parameters (`jax_impl.frame.check_frame_params`) as DLPack views of the torch
    frame's buffers: no copy, so a later `load_weights` is seen by both."""
    from jax_impl.frame import check_frame_params
    from jax_impl.weights import nest_params

    from .dlpack import to_jax

    temporal = nest_params(frame.config.temporal, {k: to_jax(v) for k, v in frame.temporal.weights().items()})
    return check_frame_params(frame.config, {"temporal": temporal,
                                             "depformer": {k: to_jax(v) for k, v in frame.depformer.weights().items()},
                                             **{k: to_jax(v) for k, v in frame.embedding_weights().items()}})
