"""The depformer, PyTorch reference path: bit-exact with moshi's `LMGen.depformer_step` on the CPU.

    dep = Depformer.from_config(DepformerConfig(), dtype=torch.bfloat16)
    dep.load_weights(state_dict)                      # a released file's tensors or LMModel.state_dict()
    codes = dep(text_token, transformer_out)          # [B] int, [B, 1, temporal_dim] -> [B, dep_q] int64
    codes, logits = dep(text_token, transformer_out, return_logits=True)   # + float32 [B, dep_q, card]

One frame: step 0 embeds the frame's text token (`text_emb`), step k >= 1 the audio token chosen at
step k-1 (`emb[(k-1) % weight_sets]`), each added to `depformer_in[set](transformer_out)`; the
layers attend causally over the frame's inner steps only (a K/V cache of dep_q slots, rebuilt
every frame, no positional embedding); `linears[set]` gives the step's logits. Step k runs weight
set `k % weight_sets`, read in place: a 16-step PersonaPlex depformer stores its 8 sets once.
Greedy by default (moshi's `use_sampling=False`); `temperature > 0` samples with the
explicit-randomness sampler of `torch_bridge.sampling` (the same tokens as `jax_impl.sampling`).
Teacher forcing (`audio_tokens`, `audio_provided`) overrides the next step's input token, as
PersonaPlex's `LMGen.depformer_step` does; the returned codes are the chosen ones.

`kernels="twin"` runs every float operation on the Triton twin kernels (`twin_depformer`): the bits
of `jax_impl.make_depformer_step(cfg, kernels="twin")`, and a row's bits do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from jax_impl.checkpoint import CheckpointError
from jax_impl.depformer_config import (
    DEPFORMER_PREFIXES,
    DepformerConfig,
    buffer_shapes,
    check_steps,
    load_plan,
)
from jax_impl.kernel_choice import check_head_dim
from jax_impl.sampling_config import check_sampling

from .layers import check_triton_device, rms_norm_f32
from .sampling import check_randomness, is_integer_tensor, sample
from .weights import ExactLoads, as_tensor, source_problem

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# "reference": torch ops, bit-exact with moshi; "twin": the Triton twin kernels (`twin_depformer`, imported
# on first use), bit-identical with the JAX depformer's kernels="twin"
KERNELS = ("reference", "twin")


def int_tensor(name: str, x, shape: tuple[int, ...], device) -> torch.Tensor:
    """x after checking that it is an integer torch tensor (bool excluded) of `shape` on `device`."""
    if not is_integer_tensor(x):
        raise TypeError(f"{name} must be an integer torch tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.device != torch.device(device):
        raise ValueError(f"{name} is on {x.device}; the module is on {torch.device(device)}")
    return x


def check_ids(name: str, ids: torch.Tensor, high: int) -> torch.Tensor:
    """The ids as int64, after raising ValueError naming `name` unless every id of the integer tensor is
    in 0..high or -1."""
    signed = ids.dtype.is_signed
    ids = ids.long()  # unsigned: compared by value; uint64 past 2**63 wraps negative, so below 0 is past high
    bad = (ids < (-1 if signed else 0)) | (ids > high)
    if bool(bad.any()):
        got = ids[bad][0].item() % (1 << 64) if not signed else ids[bad][0].item()
        raise ValueError(f"{name} must hold token ids in 0..{high} or -1 (no token), got {got}")
    return ids


class Depformer(ExactLoads, nn.Module):
    """The depformer with stacked weight buffers (`buffer_shapes`): one copy of each weight set."""

    def __init__(self, config: DepformerConfig, dtype=torch.float32, device=None, kernels: str = "reference"):
        super().__init__()
        if not isinstance(config, DepformerConfig):
            raise TypeError(f"config must be a DepformerConfig, got {type(config).__name__}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        check_head_dim(f"{type(self).__name__}(kernels)", config, kernels)
        self.config, self.kernels = config, kernels
        self._check_device(device)
        for name, shape in buffer_shapes(config).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.init_weights()

    @classmethod
    def from_config(cls, config: DepformerConfig, *, dtype=torch.float32, device=None,
                    kernels: str = "reference") -> Depformer:
        return cls(config, dtype=dtype, device=device, kernels=kernels)

    @property
    def dtype(self) -> torch.dtype:
        return self.in_proj.dtype

    @property
    def device(self) -> torch.device:
        return self.in_proj.device

    def _check_device(self, device) -> None:
        """kernels="twin": the Triton twins step this module, so `device` must be one Triton runs on
        (the CPU only with TRITON_INTERPRET=1: `layers.check_triton_device`)."""
        if self.kernels == "twin":
            check_triton_device(device, f"{type(self).__name__}(kernels='twin')")

    def _apply(self, fn, recurse=True):
        """`nn.Module`'s conversion hook (`.to()`, `.cpu()`, ...): the target device checked first."""
        self._check_device(fn(torch.empty(0, dtype=self.dtype, device=self.device)).device)
        return super()._apply(fn, recurse)

    def weights(self) -> dict[str, torch.Tensor]:
        """The weight buffers by name (the tensors themselves)."""
        return {name: getattr(self, name) for name in buffer_shapes(self.config)}

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Matrices and tables ~ N(0, std); norm scales at 1."""
        for name, w in self.weights().items():
            if name.endswith("alpha"):
                w.fill_(1.0)
            else:
                w.copy_(torch.randn(w.shape, generator=generator, device=w.device) * std)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping, *, source: str = "state_dict") -> None:
        """Copy a checkpoint's depformer tensors into the buffers (in place), all or nothing.

        Keys: the released files' names or a moshi `LMModel.state_dict()`'s (`load_plan`); keys
        outside the depformer's prefixes are ignored. Values: torch tensors or numpy arrays,
        float32/bfloat16/float16, widened exactly to the depformer's dtype, never narrowed. Sets
        past `weight_sets` (a loader's copies) must equal the set they map to, and are not stored.
        Every problem is listed in one `CheckpointError` headed by `source`; nothing is written then.
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{source}: expected a mapping key -> tensor, got {type(state_dict).__name__}")
        sources, problems = {}, []
        for key, value in state_dict.items():
            if isinstance(key, str) and key.startswith(DEPFORMER_PREFIXES):
                line = source_problem(key, value, self.dtype)
                sources[key] = None if line else as_tensor(value)
                problems += [line] if line else []
        shapes = {k: None if v is None else tuple(v.shape) for k, v in sources.items()}
        fills = load_plan(shapes, self.config, source=source, problems=problems)
        staged: dict[tuple, torch.Tensor] = {}
        for f in fills:  # the stored slots first: the copies are compared with them
            if f.stored:
                staged[(f.buffer, f.index)] = self._slice(f, sources[f.key])
        lines = [f"not a copy: {f.key}: rows {f.row0}..{f.row0 + f.rows - 1} differ from the weight set it repeats "
                 f"({f.buffer}{list(f.index)}); a file of more distinct sets needs a larger weight_sets"
                 for f in fills if not f.stored and not torch.equal(self._slice(f, sources[f.key]),
                                                                    staged[(f.buffer, f.index)])]
        if lines:
            raise CheckpointError("\n".join([f"{source}:", *("  " + line for line in lines)]))
        for (buffer, index), src in staged.items():  # checked: the only step that writes
            getattr(self, buffer)[index].copy_(src)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The weights under the released files' names (`weight_sets` sets, contiguous copies)."""
        c = self.config
        out = {"depformer_text_emb.weight": self.text_emb.clone()}
        for i in range(c.num_layers):
            base = f"depformer.layers.{i}."
            out[base + "self_attn.in_proj_weight"] = self.in_proj[i].reshape(-1, c.dim).clone()
            out[base + "self_attn.out_proj.weight"] = self.out_proj[i].reshape(-1, c.dim).clone()
            out[base + "norm1.alpha"] = self.norm1_alpha[i].reshape(1, 1, c.dim).clone()
            out[base + "norm2.alpha"] = self.norm2_alpha[i].reshape(1, 1, c.dim).clone()
            for k in range(c.weight_sets):
                out[base + f"gating.{k}.linear_in.weight"] = self.linear_in[i, k].clone()
                out[base + f"gating.{k}.linear_out.weight"] = self.linear_out[i, k].clone()
        for k in range(c.weight_sets):
            out[f"depformer_in.{k}.weight"] = self.depformer_in[k].clone()
            out[f"linears.{k}.weight"] = self.linears[k].clone()
        for j in range(c.emb_tables):
            out[f"depformer_emb.{j}.weight"] = self.emb[j].clone()
        return out

    def _slice(self, fill, tensor: torch.Tensor) -> torch.Tensor:
        dst = getattr(self, fill.buffer)[fill.index]
        rows = tensor.reshape(-1, tensor.shape[-1])[fill.row0:fill.row0 + fill.rows]
        return rows.to(device=self.device, dtype=self.dtype).reshape(dst.shape)

    # ----------------------------------------------------------------------------- one frame
    def _check_inputs(self, text_token, transformer_out, audio_tokens, audio_provided):
        c = self.config
        if not isinstance(transformer_out, torch.Tensor):
            raise TypeError(f"transformer_out must be a torch tensor, got {type(transformer_out).__name__}")
        if transformer_out.dim() != 3 or transformer_out.shape[1:] != (1, c.temporal_dim) or not len(transformer_out):
            raise ValueError(f"transformer_out must have shape [B >= 1, 1, {c.temporal_dim}], got "
                             f"{list(transformer_out.shape)}")
        if transformer_out.dtype != self.dtype or transformer_out.device != self.device:
            raise ValueError(f"transformer_out must be {self.dtype} on {self.device} (the depformer's), got "
                             f"{transformer_out.dtype} on {transformer_out.device}")
        B = transformer_out.shape[0]
        check_ids("text_token", int_tensor("text_token", text_token, (B,), self.device), c.text_card)
        if (audio_tokens is None) != (audio_provided is None):
            raise ValueError("audio_tokens and audio_provided go together: pass both or neither")
        if audio_tokens is not None:
            int_tensor("audio_tokens", audio_tokens, (B, c.dep_q), self.device)
            if not isinstance(audio_provided, torch.Tensor) or audio_provided.dtype != torch.bool:
                raise TypeError(f"audio_provided must be a torch.bool tensor, got "
                                f"{getattr(audio_provided, 'dtype', type(audio_provided).__name__)}")
            if tuple(audio_provided.shape) != (B, c.dep_q) or audio_provided.device != self.device:
                raise ValueError(f"audio_provided must have shape [{B}, {c.dep_q}] on {self.device}, got "
                                 f"{list(audio_provided.shape)} on {audio_provided.device}")
            check_ids("audio_tokens (where provided)", audio_tokens[audio_provided], c.card)

    @staticmethod
    def _embed(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """moshi's `ScaledEmbedding`: ids [B, 1] -> [B, 1, dim]; id -1 gives the zero vector."""
        y = F.embedding(ids.clamp(min=0), table)
        return torch.where((ids == -1)[..., None], torch.zeros((), dtype=y.dtype), y)

    def _layer(self, x, layer: int, s: int, step: int, cache_k, cache_v, mask):
        """One layer at one inner step (moshi's `StreamingTransformerLayer` op for op). x [B, 1, dim]."""
        c = self.config
        B = x.shape[0]
        h = rms_norm_f32(x, self.norm1_alpha[layer], c.norm_eps)
        q, k, v = F.linear(h, self.in_proj[layer, s]).view(B, 1, 3, c.num_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        cache_k[:, :, step] = k[:, :, 0]
        cache_v[:, :, step] = v[:, :, 0]
        att = F.scaled_dot_product_attention(q, cache_k, cache_v, mask)  # [B, H, 1, D]
        x = x + F.linear(att.transpose(1, 2).reshape(B, 1, c.dim), self.out_proj[layer, s])
        h = rms_norm_f32(x, self.norm2_alpha[layer], c.norm_eps)
        gate = F.linear(h, self.linear_in[layer, s]).view(B, 1, 2, -1)
        return x + F.linear(F.silu(gate[..., 0, :]) * gate[..., 1, :], self.linear_out[layer, s])

    @torch.no_grad()
    def forward(self, text_token: torch.Tensor, transformer_out: torch.Tensor, audio_tokens: torch.Tensor | None = None,
                audio_provided: torch.Tensor | None = None, return_logits: bool = False, *,
                temperature: float = 0.0, top_k: int = 0, seeds: torch.Tensor | None = None, counter=0,
                steps: int | None = None):
        """One frame's audio tokens.

        text_token [B] int: the frame's text token (0..text_card, or -1: no token).
        transformer_out [B, 1, temporal_dim]: the temporal stack's output (the depformer's dtype).
        audio_tokens [B, dep_q] int, audio_provided [B, dep_q] bool: where provided, audio_tokens[:, k]
        (0..card or -1) is step k+1's input instead of the chosen token.
        temperature, top_k, seeds [B] int, counter (int or [B] int): sampling (`torch_bridge.sampling`;
        step k draws at counter * dep_q + k); temperature 0 (the default): greedy.
        steps: run the first `steps` inner steps only (1..dep_q; None: all): codes [B, steps].
        Returns codes [B, dep_q] int64, and with return_logits the float32 logits [B, dep_q, card].
        """
        self._check_inputs(text_token, transformer_out, audio_tokens, audio_provided)
        c = self.config
        B = transformer_out.shape[0]
        check_sampling(temperature, top_k, c.card)
        check_steps(steps, self.config.dep_q)
        seeds, counter = check_randomness(seeds, counter, B, self.device, bool(temperature))
        shape = (c.num_layers, B, c.num_heads, c.dep_q, c.head_dim)
        cache_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cache_v = torch.zeros_like(cache_k)
        slots = torch.arange(c.dep_q, device=self.device)
        prev = text_token.long()
        codes, logits_all = [], []
        if self.kernels == "twin":
            from . import twin_depformer

            weights = self.weights()
            tables = twin_depformer.frame_tables(c, weights, B, self.device)
        for step, s in enumerate(c.step_sets[:steps]):
            table = self.text_emb if step == 0 else self.emb[c.step_tables[step - 1]]
            token_emb = self._embed(table, prev[:, None])
            if self.kernels == "twin":
                x = twin_depformer.step_input(self.depformer_in, s, transformer_out[:, 0].contiguous(), token_emb[:, 0])
                for layer in range(c.num_layers):
                    x = twin_depformer.layer(c, weights, tables, x, layer, s, step, cache_k, cache_v)
                logits = twin_depformer.head(self.linears, s, x).float()  # [B, card]
            else:
                x = F.linear(transformer_out, self.depformer_in[s]) + token_emb
                mask = (slots <= step).expand(B, 1, 1, c.dep_q)
                for layer in range(c.num_layers):
                    x = self._layer(x, layer, s, step, cache_k[layer], cache_v[layer], mask)
                logits = F.linear(x, self.linears[s])[:, 0].float()  # [B, card]
            token = sample(logits, seeds, counter * c.dep_q + step, temperature=temperature, top_k=top_k)
            codes.append(token)
            logits_all.append(logits)
            prev = token if audio_tokens is None else torch.where(audio_provided[:, step], audio_tokens[:, step].long(),
                                                                  token)
        codes = torch.stack(codes, dim=1)
        return (codes, torch.stack(logits_all, dim=1)) if return_logits else codes
