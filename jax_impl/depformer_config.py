"""Framework-neutral configuration and checkpoint layout of the depformer.

The depformer is the small transformer that, given the temporal stack's output for a frame,
emits the frame's `dep_q` audio codebook tokens one inner step after another (moshi's
`LMModel.depformer`, driven by `LMGen.depformer_step`). Imported by both `torch_bridge` and
`jax_impl`; it imports neither torch nor jax.

- `DepformerConfig`: the sizes (PersonaPlex by default; Moshi is `dep_q=8`).
- `buffer_shapes(cfg)`: the stacked weight buffers both sides hold (one copy of each weight set).
- `load_plan(shapes, cfg)`: which buffer slice each checkpoint tensor fills, and which tensors
  are copies of a stored set (checked equal by the loader, never stored twice); one
  `CheckpointError` listing every missing, unexpected or mis-shaped key.

Weight sets: each inner step k runs its own attention projections, gating, `depformer_in` and
output head (moshi `weights_per_step`, `multi_linear`). A file ships `weight_sets` of them;
step k reads set `k % weight_sets` (PersonaPlex runs 16 steps on an 8-set file, whose loader
copies sets 0-7 into 8-15). The audio embedding that feeds step k (k >= 1) is table
`(k - 1) % weight_sets`: the loader's copy of tables 0-6 into 8-14. Table 7, which feeds step 8,
has no source in a file of 7 tables (Moshi's layout for 8 steps): PersonaPlex's loader leaves it
as constructed (uninitialised); here such a file is refused for 16 steps, naming the table,
and a file that ships it (PersonaPlex's) is used as is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .checkpoint import check_fit
from .config import check_positive_ints, positive_float32

# The key prefixes of the depformer's tensors in a Moshi/PersonaPlex LM checkpoint; other keys
# (the temporal stack, its embeddings and heads) are not the depformer's and are ignored.
DEPFORMER_PREFIXES = ("depformer.", "depformer_in.", "depformer_emb.", "depformer_text_emb.", "linears.")


@dataclass(frozen=True)
class DepformerConfig:
    """The depformer's sizes. Defaults: PersonaPlex (16 inner steps on 8 weight sets).

    dim, num_layers, num_heads, hidden: the transformer (RMSNorm in float32 with `norm_eps`,
    no positional embedding, SiLU gating `linear_in [2*hidden, dim]`, `linear_out [dim, hidden]`).
    dep_q: inner steps a frame (audio codebooks emitted). weight_sets: distinct per-step weight
    sets (step k reads set k % weight_sets). card: audio codebook size (the embedding tables
    hold card + 1 rows: the initial token is `card`). text_card: text vocabulary (its table
    holds text_card + 1 rows). temporal_dim: the temporal stack's width (`depformer_in`'s input).
    """

    dim: int = 1024
    num_layers: int = 6
    num_heads: int = 16
    hidden: int = 2816
    dep_q: int = 16
    weight_sets: int = 8
    card: int = 2048
    text_card: int = 32000
    temporal_dim: int = 4096
    norm_eps: float = 1e-8

    def __post_init__(self):
        check_positive_ints(self, ("dim", "num_layers", "num_heads", "hidden", "dep_q", "weight_sets", "card",
                                   "text_card", "temporal_dim"))
        if self.dim % self.num_heads:
            raise ValueError(f"DepformerConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.weight_sets > self.dep_q:
            raise ValueError(f"DepformerConfig.weight_sets ({self.weight_sets}) must be at most dep_q ({self.dep_q}): "
                             f"a set no step reads")
        if not positive_float32(self.norm_eps):
            raise ValueError(f"DepformerConfig.norm_eps must be a float > 0 that float32 holds (the norms compute "
                             f"in float32), got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def step_sets(self) -> tuple[int, ...]:
        """The weight set of each inner step: step k -> k % weight_sets."""
        return tuple(k % self.weight_sets for k in range(self.dep_q))

    @property
    def emb_tables(self) -> int:
        """Audio embedding tables stored: one for each of steps 1..dep_q-1, up to weight_sets."""
        return min(self.dep_q - 1, self.weight_sets)

    @property
    def step_tables(self) -> tuple[int, ...]:
        """The audio embedding table feeding each inner step 1..dep_q-1 (entry k-1: step k)."""
        return tuple((k - 1) % self.weight_sets for k in range(1, self.dep_q))


def check_steps(steps, dep_q: int) -> None:
    """Raise ValueError naming `steps` unless it is None (every inner step) or an int in 1..dep_q (not a
    bool): a frame's first `steps` inner steps, the depformer's `steps` argument on both sides."""
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= dep_q):
        raise ValueError(f"steps must be an int in 1..{dep_q} or None, got {steps!r}")


DEPFORMER_PRESETS: dict[str, DepformerConfig] = {
    "personaplex": DepformerConfig(),
    "moshi": DepformerConfig(dep_q=8),
    "personaplex-small": DepformerConfig(dim=64, num_layers=2, num_heads=4, hidden=176, card=40, text_card=50,
                                         temporal_dim=48),
    "moshi-small": DepformerConfig(dim=64, num_layers=2, num_heads=4, hidden=176, dep_q=8, card=40, text_card=50,
                                   temporal_dim=48),
}


def buffer_shapes(cfg: DepformerConfig) -> dict[str, tuple[int, ...]]:
    """The depformer's weight buffers (the same names and shapes on both sides)."""
    L, W, d, h = cfg.num_layers, cfg.weight_sets, cfg.dim, cfg.hidden
    return {
        "in_proj": (L, W, 3 * d, d),        # rows split as (q, k, v) x (head, head_dim)
        "out_proj": (L, W, d, d),
        "linear_in": (L, W, 2 * h, d),      # (gate, up) halves
        "linear_out": (L, W, d, h),
        "norm1_alpha": (L, d),
        "norm2_alpha": (L, d),
        "depformer_in": (W, d, cfg.temporal_dim),
        "emb": (cfg.emb_tables, cfg.card + 1, d),
        "text_emb": (cfg.text_card + 1, d),
        "linears": (W, cfg.card, d),
    }


@dataclass(frozen=True)
class Fill:
    """One checkpoint tensor's part: rows [row0, row0 + rows) of `key`, reshaped to the
    buffer's slice `buffer[index]`. `stored`: False for a copy of a stored set (the loader
    checks it equals `buffer[index]` and stores nothing)."""

    key: str
    row0: int
    rows: int
    buffer: str
    index: tuple[int, ...]
    stored: bool


_PER_SET = (  # (regex over a key, buffer, layer-indexed) of the tensors that exist once per set
    (re.compile(r"depformer\.layers\.(\d+)\.self_attn\.in_projs\.(\d+)\.weight"), "in_proj", True),
    (re.compile(r"depformer\.layers\.(\d+)\.self_attn\.out_projs\.(\d+)\.weight"), "out_proj", True),
    (re.compile(r"depformer\.layers\.(\d+)\.gating\.(\d+)\.linear_in\.weight"), "linear_in", True),
    (re.compile(r"depformer\.layers\.(\d+)\.gating\.(\d+)\.linear_out\.weight"), "linear_out", True),
    (re.compile(r"depformer_in\.(\d+)\.weight"), "depformer_in", False),
    (re.compile(r"linears\.(\d+)\.weight"), "linears", False),
)
_FUSED = (  # the released files' one tensor for every set of a layer: [n * rows, dim]
    (re.compile(r"depformer\.layers\.(\d+)\.self_attn\.in_proj_weight"), "in_proj"),
    (re.compile(r"depformer\.layers\.(\d+)\.self_attn\.out_proj\.weight"), "out_proj"),
)
_NORM = re.compile(r"depformer\.layers\.(\d+)\.norm([12])\.alpha")
_EMB = re.compile(r"depformer_emb\.(\d+)\.weight")


def load_plan(shapes: Mapping[str, Sequence[int] | None], cfg: DepformerConfig, *, source: str = "state_dict",
              problems: Sequence[str] = ()) -> list[Fill]:
    """Where each depformer tensor of a checkpoint goes; raises one `CheckpointError` otherwise.

    shapes: key -> shape for every tensor of the checkpoint (keys outside `DEPFORMER_PREFIXES`
    are ignored; None: not a tensor, reported by the caller in `problems`). Accepted names: the
    released files' (`self_attn.in_proj_weight [n*3*dim, dim]`, `self_attn.out_proj.weight
    [n*dim, dim]`, n >= weight_sets) and a moshi `LMModel.state_dict()`'s (`in_projs.{k}.weight`,
    `out_projs.{k}.weight`). Sets k >= weight_sets and tables j >= emb_tables may be present
    (a loader that stored copies): each must be a copy of set k % weight_sets (table
    j % weight_sets), which the caller checks (`Fill.stored` False).
    """
    bufs = buffer_shapes(cfg)
    L, W = cfg.num_layers, cfg.weight_sets
    fills: list[Fill] = []
    lines = list(problems)
    have: dict[str, str] = {}   # the slots filled: "buffer[index]" -> the key

    def add(key, row0, rows, buffer, index, what):
        slot = f"{buffer}{list(index)}"
        stored = not index or index[-1] < bufs[buffer][len(index) - 1]
        # a set/table past the stored ones is a copy of the one it maps to
        copy_of = index if stored else (*index[:-1], index[-1] % W)
        if stored and slot in have:
            lines.append(f"duplicate: {key}: {what}, already given by {have[slot]}")
            return
        if stored:
            have[slot] = key
        fills.append(Fill(key, row0, rows, buffer, copy_of, stored))

    for key, shape in shapes.items():
        if not key.startswith(DEPFORMER_PREFIXES):
            continue
        shape = None if shape is None else tuple(int(s) for s in shape)
        matched = False
        for pattern, buffer, layered in _PER_SET:
            if m := pattern.fullmatch(key):
                matched = True
                nums = [int(g) for g in m.groups()]
                want = bufs[buffer][2:] if layered else bufs[buffer][1:]
                if (layered and nums[0] >= L) or nums[-1] >= cfg.dep_q:
                    lines.append(f"unexpected: {key}: past {L} layers / {cfg.dep_q} steps")
                elif shape is not None and shape != want:
                    lines.append(f"wrong shape: {key}: expected {list(want)}, got {list(shape)}")
                elif shape is not None:
                    add(key, 0, want[0], buffer, tuple(nums), f"set {nums[-1]}")
        for pattern, buffer in _FUSED:
            if m := pattern.fullmatch(key):
                matched = True
                layer = int(m.group(1))
                rows, d = bufs[buffer][2], cfg.dim
                if layer >= L:
                    lines.append(f"unexpected: {key}: past {L} layers")
                elif shape is not None and (len(shape) != 2 or shape[1] != d or shape[0] % rows
                                            or not W <= shape[0] // rows <= cfg.dep_q):
                    lines.append(f"wrong shape: {key}: expected [n*{rows}, {d}] with {W} <= n <= {cfg.dep_q} "
                                 f"weight sets, got {list(shape)}")
                elif shape is not None:
                    for k in range(shape[0] // rows):
                        add(key, k * rows, rows, buffer, (layer, k), f"set {k}")
        if m := _NORM.fullmatch(key):
            matched = True
            layer, which = int(m.group(1)), m.group(2)
            if layer >= L:
                lines.append(f"unexpected: {key}: past {L} layers")
            elif shape is not None and shape != (1, 1, cfg.dim):
                lines.append(f"wrong shape: {key}: expected [1, 1, {cfg.dim}], got {list(shape)}")
            elif shape is not None:
                add(key, 0, 1, f"norm{which}_alpha", (layer,), "the norm")
        if m := _EMB.fullmatch(key):
            matched = True
            j = int(m.group(1))
            want = bufs["emb"][1:]
            if j >= cfg.dep_q - 1:
                lines.append(f"unexpected: {key}: {cfg.dep_q} steps read {cfg.dep_q - 1} audio tables")
            elif shape is not None and shape != want:
                lines.append(f"wrong shape: {key}: expected {list(want)}, got {list(shape)}")
            elif shape is not None:
                add(key, 0, want[0], "emb", (j,), f"table {j}")
        if key == "depformer_text_emb.weight":
            matched = True
            want = bufs["text_emb"]
            if shape is not None and shape != want:
                lines.append(f"wrong shape: {key}: expected {list(want)}, got {list(shape)}")
            elif shape is not None:
                add(key, 0, want[0], "text_emb", (), "the text table")
        if not matched:
            lines.append(f"unexpected: {key}")

    for buffer, full in bufs.items():  # every stored slot must be filled once
        lead = {"in_proj": 2, "out_proj": 2, "linear_in": 2, "linear_out": 2, "norm1_alpha": 1, "norm2_alpha": 1,
                "depformer_in": 1, "emb": 1, "linears": 1, "text_emb": 0}[buffer]
        for index in _indices(full[:lead]):
            slot = f"{buffer}{list(index)}"
            if slot not in have:
                lines.append(f"missing: {_key_name(buffer, index, cfg)}")
    check_fit(f"{source} does not fit {describe(cfg)}", {}, {}, lines)
    return fills


def _indices(dims: Sequence[int]):
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _indices(dims[1:]):
            yield (i, *rest)


def _key_name(buffer: str, index: tuple[int, ...], cfg: DepformerConfig) -> str:
    """The released file's name of a buffer slot, for a message (with what it is)."""
    names = {
        "in_proj": "depformer.layers.{0}.self_attn.in_proj_weight (weight set {1})",
        "out_proj": "depformer.layers.{0}.self_attn.out_proj.weight (weight set {1})",
        "linear_in": "depformer.layers.{0}.gating.{1}.linear_in.weight",
        "linear_out": "depformer.layers.{0}.gating.{1}.linear_out.weight",
        "norm1_alpha": "depformer.layers.{0}.norm1.alpha",
        "norm2_alpha": "depformer.layers.{0}.norm2.alpha",
        "depformer_in": "depformer_in.{0}.weight",
        "linears": "linears.{0}.weight",
        "emb": "depformer_emb.{0}.weight (the audio table feeding inner step {1})",
        "text_emb": "depformer_text_emb.weight",
    }
    extra = (index[0] + 1,) if buffer == "emb" else ()
    return names[buffer].format(*index, *extra)


def describe(cfg: DepformerConfig) -> str:
    return (f"DepformerConfig(dim={cfg.dim}, num_layers={cfg.num_layers}, dep_q={cfg.dep_q}, "
            f"weight_sets={cfg.weight_sets})")
