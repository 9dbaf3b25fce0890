"""The one `kernels` vocabulary of every entry point: torch stacks, JAX steps, drop-ins, cross-check.

    name          torch stacks           JAX steps (make_step, Streamer, drop-ins, sharding)
    "reference"   torch ops, bit-exact   jax.numpy through XLA (RoPE products rounded as torch's)
                  with moshi
    "twin"        the Triton twins       the Pallas twins: the same bits as torch's "twin"
    "pallas"      -                      the Pallas RoPE and ring-attention kernels in the reference layer
    "auto"        -                      "pallas" on a GPU where those kernels apply, else "reference"

A name means the same everywhere; an entry point refuses a name it does not run, listing the
ones it does, and a config whose head dims the kernels it names do not take (`check_head_dim`: "twin"
and "pallas" need powers of two), both where it is made. Framework-neutral (standard library only).
"""

from __future__ import annotations

KERNELS = {
    "reference": "each framework's plain path: torch ops (bit-exact with moshi) / jax.numpy through XLA",
    "twin": "every float operation in a twin kernel (Triton for torch, Pallas for JAX): the same bits on both",
    "pallas": "JAX only: the Pallas RoPE and ring-attention kernels inside the reference layer",
    "auto": "JAX only: 'pallas' on a GPU where those kernels apply, else 'reference'",
}
TORCH_KERNELS = ("reference", "twin")
JAX_KERNELS = ("auto", "reference", "pallas", "twin")
# What a JAX stack module runs (`model.stack_module`): a name itself, "auto" resolved first by the step
# that knows the batch and T it applies to (`ops.pick_kernels`).
STACK_KERNELS = ("reference", "pallas", "twin")


def check_kernels(where: str, kernels, accepted: tuple[str, ...]) -> str:
    """`kernels` itself if it is one of `accepted`; else ValueError naming `where` and the accepted values."""
    if not isinstance(kernels, str) or kernels not in accepted:
        raise ValueError(f"{where}: kernels must be one of {list(accepted)}, got {kernels!r}")
    return kernels


# The kernels that take only a power-of-two head dim, and what in them does.
POW2_HEAD_DIM = {
    "twin": "the twin attention and RoPE",
    "pallas": "the Pallas ring attention",
}
# The attention stacks inside a composite config, by field: a speech frame's codec and LM frame, a
# codec's transformer, an LM frame's temporal stack and depformer.
_PARTS = ("codec", "transformer", "lm", "temporal", "depformer")
_STACK_NAMES = {"TemporalConfig": "temporal", "MimiConfig": "Mimi transformer", "DepformerConfig": "depformer"}


def attention_stacks(config) -> list[tuple[str, object]]:
    """(name, config) of every attention stack of `config`: a stack's config (`TemporalConfig`,
    `MimiConfig`, `DepformerConfig`: named by its kind) or one made of them (`CodecConfig`,
    `FrameConfig`, `SpeechFrameConfig`: named by their field path, "codec.transformer", "lm.temporal")."""
    if hasattr(config, "head_dim"):
        return [(_STACK_NAMES.get(type(config).__name__, type(config).__name__), config)]
    found = []
    for part in _PARTS:
        sub = getattr(config, part, None)
        if sub is None:
            continue
        for name, stack in attention_stacks(sub):
            found.append((part if hasattr(sub, "head_dim") else f"{part}.{name}", stack))
    return found


def check_head_dim(where: str, config, kernels) -> None:
    """Refuse (ValueError naming `where`, the stack and its head dim) a config whose attention stacks
    `kernels` would run on a kernel that takes only a power-of-two head dim (`POW2_HEAD_DIM`: "twin", and
    "pallas" where it is asked for by name; "auto" falls back to "reference" there). Called where a stack,
    step or frame is made, before any state or compile, rather than failing at the first step inside
    the kernel. config: a stack's config or one made of them (`attention_stacks`)."""
    why = POW2_HEAD_DIM.get(kernels) if isinstance(kernels, str) else None
    if why is None:
        return
    for name, stack in attention_stacks(config):
        d = stack.head_dim
        if d & (d - 1):
            raise ValueError(f"{where}: kernels={kernels!r} needs power-of-two head dims ({why}); the {name} "
                             f"stack's is {d} (head_dim = dim {stack.dim} // num_heads {stack.num_heads})")
