"""The Moshi checkpoint layout of the two stacks and its IO, framework-neutral.

Imported by both `torch_bridge` and `jax_impl`; it imports neither torch nor jax.

- `weight_specs(config)`: the stacked weight buffers and their Moshi checkpoint keys (and the
  other names moshi's own modules give them: `in_projs.0.weight`, ...).
- `check_checkpoint(shapes, config, prefix)`: one `CheckpointError` listing every missing,
  unexpected, duplicated or mis-shaped key; `check_fit` is the one checker behind it and behind
  the JAX parameter checks; `weight_dtype_problem` the one dtype rule of every loader.
- `infer_config(shapes, kind, prefix)`: the sizes a checkpoint's shapes determine.
- `read_safetensors_shapes` / `read_safetensors`: a file's header / tensors, errors naming the path.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jax_impl.config import PRESETS, StackConfig, TemporalConfig, describe

MIMI_PREFIXES = ("encoder_transformer", "decoder_transformer")


@dataclass(frozen=True)
class WeightSpec:
    """One stacked weight buffer.

    name:      buffer name on both sides (`in_proj`, `norm1_alpha`, ...).
    key:       checkpoint key below the stack prefix; `{i}` is the layer index.
    shape:     shape of one layer's slice (or of the whole tensor when not per layer).
    ckpt_shape: the shape the checkpoint stores for one layer (alphas are `[1, 1, dim]`).
    per_layer: True when the buffer is stacked `[num_layers, *shape]`.
    aliases:   other names of `key` that moshi loads too: the released files say
               `self_attn.in_proj_weight`, a `state_dict()` of moshi's own modules (0.2.13)
               `self_attn.in_projs.0.weight` (its `StreamingMultiheadAttention._load_hook` maps
               one to the other). `key` is the name we write.
    """

    name: str
    key: str
    shape: tuple[int, ...]
    ckpt_shape: tuple[int, ...]
    per_layer: bool = True
    aliases: tuple[str, ...] = ()

    def stacked_shape(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers, *self.shape) if self.per_layer else self.shape

    def names(self, base: str, layer: int | None) -> tuple[str, ...]:
        """Every accepted checkpoint key of this weight (of one layer), `key` first."""
        return tuple(base + k.format(i=layer) for k in (self.key, *self.aliases))


def weight_specs(config: StackConfig) -> list[WeightSpec]:
    """The weight buffers of a stack, in a fixed order, with their Moshi checkpoint keys."""
    d = config.dim
    layer = "transformer.layers.{i}."
    specs = [
        WeightSpec("in_proj", layer + "self_attn.in_proj_weight", (3 * d, d), (3 * d, d),
                   aliases=(layer + "self_attn.in_projs.0.weight", layer + "self_attn.in_proj.weight")),
        WeightSpec("out_proj", layer + "self_attn.out_proj.weight", (d, d), (d, d),
                   aliases=(layer + "self_attn.out_projs.0.weight",)),
    ]
    if isinstance(config, TemporalConfig):
        h = config.hidden
        specs += [
            WeightSpec("linear_in", layer + "gating.linear_in.weight", (2 * h, d), (2 * h, d)),
            WeightSpec("linear_out", layer + "gating.linear_out.weight", (d, h), (d, h)),
            WeightSpec("norm1_alpha", layer + "norm1.alpha", (d,), (1, 1, d)),
            WeightSpec("norm2_alpha", layer + "norm2.alpha", (d,), (1, 1, d)),
            WeightSpec("out_norm_alpha", "out_norm.alpha", (d,), (1, 1, d), per_layer=False),
            WeightSpec("text_linear", "text_linear.weight", (config.text_card, d),
                       (config.text_card, d), per_layer=False),
        ]
    else:
        f = config.ffn
        specs += [
            WeightSpec("linear1", layer + "linear1.weight", (f, d), (f, d)),
            WeightSpec("linear2", layer + "linear2.weight", (d, f), (d, f)),
            WeightSpec("norm1_weight", layer + "norm1.weight", (d,), (d,)),
            WeightSpec("norm1_bias", layer + "norm1.bias", (d,), (d,)),
            WeightSpec("norm2_weight", layer + "norm2.weight", (d,), (d,)),
            WeightSpec("norm2_bias", layer + "norm2.bias", (d,), (d,)),
            WeightSpec("scale1", layer + "layer_scale_1.scale", (d,), (d,)),
            WeightSpec("scale2", layer + "layer_scale_2.scale", (d,), (d,)),
        ]
    return specs


def checkpoint_prefix(config: StackConfig, prefix: str | None) -> str:
    """The key prefix of a stack in a checkpoint: '' for temporal, 'encoder_transformer.' ..."""
    if isinstance(config, TemporalConfig):
        if prefix:
            raise ValueError(f"prefix: the temporal stack takes no prefix, got {prefix!r}")
        return ""
    if prefix not in MIMI_PREFIXES:
        raise ValueError(f"prefix must be one of {MIMI_PREFIXES} for a Mimi stack, got {prefix!r}")
    return prefix + "."


def checkpoint_keys(config: StackConfig, prefix: str | None = None) -> dict[str, tuple[WeightSpec, int | None]]:
    """Every checkpoint key of a stack -> (its spec, its layer index or None)."""
    base = checkpoint_prefix(config, prefix)
    keys: dict[str, tuple[WeightSpec, int | None]] = {}
    for spec in weight_specs(config):
        if spec.per_layer:
            for i in range(config.num_layers):
                keys[base + spec.key.format(i=i)] = (spec, i)
        else:
            keys[base + spec.key] = (spec, None)
    return keys


class CheckpointError(ValueError):
    """Weights do not fit a stack or cannot be read. The one error of every loader and weight
    check on both sides: the message names the source (a file's path, an argument) and gives
    every problem at once, one a line, each line `<kind>: <key>[: details]` (many missing, unexpected
    or wrong-shape keys: one line a kind, count and first keys: `check_fit`). `problems`: every
    problem line (a tuple; empty for an error that is one problem, its message)."""

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = tuple(problems)


PROBLEM_LINES = 8  # a CheckpointError lists this many problems in full, more one line a kind
# Two or more weights of the wrong shape: most likely a file of another config than the stack's.
OTHER_CONFIG = ("the shapes are another config's: jax_impl.checkpoint.infer_config(shapes, kind) reads "
                "dim, num_layers, hidden / ffn and text_card from the file (`crosscheck --checkpoint FILE` "
                "does), num_heads comes from --num-heads or the config (the shapes do not show it)")


def summarize_problems(lines: Sequence[str]) -> list[str]:
    """One line a kind of problem (the text before a line's first ': '): the count and the first two."""
    kinds: dict[str, list[str]] = {}
    for line in lines:
        kind, _, rest = line.partition(": ")
        kinds.setdefault(kind, []).append(rest)
    return [f"{kind}: {len(items)} ({'; '.join(items[:2])}{'; ...' if len(items) > 2 else ''})"
            for kind, items in kinds.items()]


def check_fit(what: str, expected: Mapping[str, Sequence[int]], have: Mapping[str, Sequence[int] | None],
              problems: Sequence[str] = ()) -> None:
    """Raise one `CheckpointError` giving every way `have` does not fit `expected`; else return.

    what: the head of the message, naming the source and the target.
    expected, have: name -> shape. A shape of None in `have` is not compared (the caller has
    a line for it in `problems`). problems: more lines (`wrong dtype: key: ...`), listed after
    the missing, unexpected and wrong-shape ones. Past PROBLEM_LINES of those three kinds (a file of
    another config: ~200 for the 7B stack) they are summarized a kind a line; every line is kept in
    the error's `problems`. Two or more wrong shapes add the way to read the file's own config.
    """
    fit = [f"missing: {k}" for k in expected if k not in have]
    fit += [f"unexpected: {k}" for k in have if k not in expected]
    wrong = [f"wrong shape: {k}: expected {list(expected[k])}, got {list(have[k])}"
             for k in expected if have.get(k) is not None and tuple(have[k]) != tuple(expected[k])]
    fit += wrong
    lines = [*fit, *problems]
    if not lines:
        return
    head = f"{what}:"
    if len(fit) > PROBLEM_LINES:
        head = f"{what}: {len(lines)} problems (every one in this error's .problems):"
        fit = summarize_problems(fit)
    shown = [*fit, *problems, *([OTHER_CONFIG] if len(wrong) >= 2 else [])]
    raise CheckpointError("\n".join([head, *("  " + line for line in shown)]), problems=lines)


# The dtypes a loader takes, on both sides. float64 is refused (the stacks compute in f32 at
# most, and JAX without x64 would narrow it silently); integer and bool tensors are not weights.
LOADABLE_DTYPES = ("float32", "bfloat16", "float16")
# Loading may widen, exactly; it never narrows.
WIDENINGS = frozenset({("bfloat16", "float32"), ("float16", "float32")})


def weight_dtype_problem(key: str, have: str, want: str | None) -> str | None:
    """The dtype rule of every loader: the problem line for `key`, or None when it loads.

    have: the source's dtype name ("float32", "bfloat16", "float64", "int32", ...).
    want: the target's dtype name, or None to keep the source's dtype.
    """
    if have not in LOADABLE_DTYPES:
        return (f"wrong dtype: {key}: {have}; a weight must be one of {', '.join(LOADABLE_DTYPES)} "
                f"(convert it yourself, knowing what that loses)")
    if want is not None and have != want and (have, want) not in WIDENINGS:
        return f"wrong dtype: {key}: {have}; the target holds {want} and casting {have} to it would narrow it"
    return None


def check_checkpoint(shapes: Mapping[str, Sequence[int] | None], config: StackConfig,
                     prefix: str | None = None, *, source: str = "checkpoint",
                     problems: Mapping[str, str] | None = None) -> dict[str, tuple[WeightSpec, int | None]]:
    """Check a checkpoint's keys and shapes against a stack; returns file key -> (spec, layer).

    shapes: checkpoint key -> tensor shape (None: not compared, see `problems`). Each weight may
    go by any of its names (`WeightSpec.names`); the returned keys are the ones the file uses.
    Keys outside the stack's prefix are ignored for a Mimi stack (a full Mimi checkpoint holds
    both transformers and the convolutions); for the temporal stack, keys under
    `transformer.`, `out_norm.` and `text_linear.` count. problems: per-key problem lines of the
    caller (dtype, device, ...), reported for this stack's keys only.
    Raises one `CheckpointError` listing every missing, unexpected, duplicated or mis-shaped key.
    """
    base = checkpoint_prefix(config, prefix)
    canonical: dict[str, str] = {}  # every accepted name -> the key we write
    expected = checkpoint_keys(config, prefix)
    for key, (spec, layer) in expected.items():
        canonical.update(dict.fromkeys(spec.names(base, layer), key))
    in_file: dict[str, str] = {}  # the key we write -> the name the file uses
    lines = []
    for key in shapes:
        if key in canonical:
            if canonical[key] in in_file:
                lines.append(f"duplicate: {key}: the same weight as {in_file[canonical[key]]}")
            else:
                in_file[canonical[key]] = key
    found = {in_file.get(k, k): v for k, v in expected.items()}
    own = ("transformer.", "out_norm.", "text_linear.") if not base else (base,)
    have = {k: s for k, s in shapes.items() if k.startswith(own) and (k in found or k not in canonical)}
    lines += [line for k, line in (problems or {}).items() if k in found]
    check_fit(f"{source} does not fit {describe(config)} with prefix {base or '(none)'!r}",
              {k: spec.ckpt_shape for k, (spec, _) in found.items()}, have, lines)
    return found


STACK_KINDS = ("temporal", "mimi")


def infer_config(shapes: Mapping[str, Sequence[int]], kind: str, prefix: str | None = None,
                 *, source: str = "checkpoint") -> dict[str, int]:
    """The sizes a checkpoint's shapes determine: {dim, num_layers, hidden, text_card} for
    "temporal", {dim, num_layers, ffn} for "mimi" (prefix: `encoder_transformer` / `decoder_transformer`).

    Read from layer 0 (`in_proj [3*dim, dim]`, `gating.linear_out [dim, hidden]`, `text_linear
    [text_card, dim]`, `linear1 [ffn, dim]`); num_layers is the highest layer index + 1. The
    other fields leave no trace in the shapes: num_heads only splits in_proj's rows, and
    context, max_period, norm_eps and ring_convention are run-time settings. Only what the sizes
    are read from is checked here; `check_checkpoint` with the config built from them checks
    every key. Raises `CheckpointError` naming the keys it needed and could not read.
    """
    if kind not in STACK_KINDS:
        raise ValueError(f"kind must be one of {STACK_KINDS}, got {kind!r}")
    config = PRESETS[kind]  # for the key names only: they do not depend on the sizes
    base = checkpoint_prefix(config, prefix)
    specs = {s.name: s for s in weight_specs(config)}
    where = f"{source} (prefix {base or '(none)'!r})"
    layer_key = re.compile(re.escape(base) + r"transformer\.layers\.(\d+)\.")
    layers = {int(m.group(1)) for k in shapes if (m := layer_key.match(k))}
    if not layers:
        raise CheckpointError(f"{where}: holds no {kind} stack: no key starts with {base}transformer.layers.")
    # size -> (the weight it is read from, the axis of its checkpoint shape)
    probes = {"dim": ("in_proj", 1), **({"hidden": ("linear_out", 1), "text_card": ("text_linear", 0)}
                                        if kind == "temporal" else {"ffn": ("linear1", 0)})}
    sizes, lines = {"dim": 0, "num_layers": max(layers) + 1}, []
    if len(layers) != max(layers) + 1:  # a stray key would make a stack of its index
        first = next(i for i in range(len(layers) + 1) if i not in layers)
        lines.append(f"missing: layer {first} ({max(layers) + 1 - len(layers)} of the {max(layers) + 1} layers that "
                     f"{base}transformer.layers.{max(layers)}. implies are absent)")
    for field, (name, axis) in probes.items():
        spec = specs[name]
        names = spec.names(base, 0 if spec.per_layer else None)
        key = next((k for k in names if k in shapes), None)
        shape = None if key is None else shapes[key]
        if key is None:
            lines.append(f"missing: {names[0]} (it gives {field})")
        elif (not isinstance(shape, (tuple, list)) or len(shape) != len(spec.ckpt_shape)
              or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape)):
            lines.append(f"wrong shape: {key}: expected {len(spec.ckpt_shape)} positive int dimensions, got {shape!r}")
        else:
            sizes[field] = shape[axis]
    if lines:
        head = f"{where}: cannot infer the {kind} sizes:"
        raise CheckpointError("\n".join([head, *("  " + m for m in lines)]))
    return sizes


def unique_keys(where: str, error: type[Exception] = ValueError):
    """A `json.load` object_pairs_hook that refuses (`error`, naming `where`) a key an object names
    twice, where JSON would keep the last."""

    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise error(f"{where} names {key!r} twice")
            seen.add(key)
        return dict(pairs)

    return hook


def safetensors_header(path: str | os.PathLike) -> dict:
    """A safetensors file's header (key -> {"dtype", "shape", "data_offsets"}, and "__metadata__"),
    read and checked before safetensors opens the file.

    Raises `CheckpointError` naming the path for a directory, a file shorter than its header, and a
    header that is not JSON or names a key twice (JSON keeps the last entry: the tensor would be read
    with another entry's dtype); a missing file raises FileNotFoundError.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a safetensors file")
    with open(path, "rb") as f:
        size, head = os.fstat(f.fileno()).st_size, f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or n > size - 8:
            raise CheckpointError(f"{path} is not a readable safetensors file: {size} bytes, "
                                  f"{'no header' if n is None else f'a header of {n} bytes'}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys(f"{path}: its header", CheckpointError))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a readable safetensors file: its header is not a JSON object")
    return header


def read_safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """A safetensors file's key -> shape, from its header (no tensor is read).

    Raises `CheckpointError` naming the path for a file that is not safetensors (corrupt,
    truncated, empty, a directory, a key named twice); a missing file raises FileNotFoundError.
    """
    from safetensors import SafetensorError, safe_open

    safetensors_header(path)
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            keys = f.keys()  # a safe_open handle: not iterable
            return {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{os.fspath(path)} is not a readable safetensors file: {err}") from None


# the safetensors dtypes numpy holds (bfloat16 through ml_dtypes); float8 / float4 tensors it cannot read
NUMPY_SAFETENSORS_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16",
                                      "F32", "F64"})


def read_safetensors(path: str | os.PathLike, keys, framework: str, **open_kwargs) -> dict:
    """The tensors `keys` of a safetensors file, as `framework` ("numpy", "pt") arrays.

    Raises `CheckpointError` naming the path and the key of a tensor that cannot be read (`safetensors_header`'s
    checks first; for numpy, a dtype it cannot hold).
    """
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    header = safetensors_header(path)
    keys = list(keys)
    if framework == "numpy":
        for key in keys:
            dtype = header.get(key, {}).get("dtype") if isinstance(header.get(key), dict) else None
            if dtype is not None and dtype not in NUMPY_SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path}: tensor {key!r} cannot be read: its dtype {dtype} is not one numpy "
                                      f"holds ({', '.join(sorted(NUMPY_SAFETENSORS_DTYPES))})")
    out, key = {}, None
    try:
        with safe_open(path, framework=framework, **open_kwargs) as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    except (SafetensorError, OSError, TypeError, ValueError) as err:  # TypeError: a dtype numpy does not know
        where = "the file" if key is None else f"tensor {key!r}"
        raise CheckpointError(f"{path}: {where} cannot be read: {err}") from None
    return out


def write_safetensors(path: str | os.PathLike, arrays: Mapping, framework: str, metadata: Mapping[str, str] | None = None,
                      what: str = "safetensors file") -> None:
    """Write `arrays` (numpy arrays for framework "numpy", CPU torch tensors for "pt") as a safetensors
    file, `metadata` in its header; ValueError naming the path (and `what` it is) where it cannot be
    written: a missing directory, a directory at the path, ..."""
    from safetensors import SafetensorError

    if framework == "pt":
        from safetensors.torch import save_file
    else:
        from safetensors.numpy import save_file
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write the {what} {target}: the directory {folder} does not exist")
    if os.path.isdir(target):
        raise ValueError(f"cannot write the {what} {target}: it is a directory")
    try:
        save_file(dict(arrays), target, metadata=None if metadata is None else dict(metadata))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"cannot write the {what} {target}: {err}") from None
