"""The cross-check: the torch path and the JAX path side by side on one schedule.

    report = crosscheck("temporal", steps=200, batch=4)
    print(report.summary())           # one row per tensor (bit-identical?, max abs / rel / ULP), a verdict
    report.require(identical=["positions", "mask"], max_rel={"out": 1e-5})  # for pytest
    assert report.holds("close")      # what `personaplex-jax crosscheck --require close` checks

Both paths run on the same weight buffers (the JAX parameters are DLPack views of the torch
stack's buffers), the same inputs, active masks and recycle operations. Each step, every
tensor (outputs, logits, ring contents, RoPE tables, write indexes, positions, mask, offsets)
is compared on its raw bits: identical or not, max abs, max relative (normwise) and max ULP
difference, and the first place they differ. For the temporal stack the greedy tokens
(argmax of text_logits) are compared too: they may differ only at a near tie.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import statistics
import textwrap
import time
from dataclasses import asdict, dataclass, field

import jax
import numpy as np
import torch

import jax_impl
from jax_impl.config import PRESETS, RING_CONVENTIONS, MimiConfig, StackConfig, with_options
from jax_impl.parity import as_numpy, ulp_distance

from .dlpack import to_jax
from .stacks import MimiTransformer, TemporalStreaming, check_safetensors

STACKS = {"temporal": (None, 1), "mimi-encoder": ("encoder_transformer", 2),
          "mimi-decoder": ("decoder_transformer", 2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYER_LOOPS = ("python", "scan")
CROSSCHECK_KERNELS = ("reference", "twin")
REQUIRE_LEVELS = ("identical", "close")
# `require close`: integer tensors identical, float tensors within this normwise relative error
# (max |torch - jax| / max |torch| at every step) for their dtype. Measured on the presets:
# float32 ~2e-7 .. 7e-7 (XLA and oneDNN sum the matmuls in other orders), bfloat16 ~7e-3 (one
# rounding flip of a bf16 intermediate propagates); the bounds leave a margin above both.
CLOSE_MAX_REL = {"float32": 1e-5, "bfloat16": 5e-2}
# A greedy token may differ only at a near tie: torch's top-2 gap below this fraction of the
# logits' scale. float32: far above its ~5e-7 error; bfloat16 logits are quantized to 2^-8
# relative, so exact ties happen.
TIE_TOL = {"float32": 1e-4, "bfloat16": 2**-6}
WARMUP_STEPS = 1  # step 0 includes the JAX compile (~1.4 s on the CPU): left out of ms/step
REL_FLOOR = 1e-10  # the plot draws a relative error of 0 (bit-identical step) here, on its log axis
SMALL_DIM = 256  # stacks up to this width count as small (the presets: 64 and 32)


@dataclass
class TensorRecord:
    """Agreement of one tensor over the run (ULPs blow up near zero: read them with max rel)."""

    name: str
    dtype: str = ""  # the torch side's ("float32", "bfloat16", "int64", "bool")
    steps: int = 0
    identical_steps: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0  # max |torch - jax| / max |torch|, per step (normwise)
    max_ulp: int = 0
    first_diff: tuple | None = None  # (step, index) of the first differing element
    per_step_ulp: list[int] = field(default_factory=list)
    per_step_rel: list[float] = field(default_factory=list)  # 0.0 where the step is bit-identical

    @property
    def identical(self) -> bool:
        return self.steps > 0 and self.identical_steps == self.steps

    @property
    def integer(self) -> bool:
        """Integer / bool tensors (indexes, offsets, masks) must be exact; floats may be close."""
        return self.dtype.startswith(("int", "uint", "bool"))

    def add(self, step: int, torch_value, jax_value) -> None:
        a, b = as_numpy(torch_value), as_numpy(jax_value)
        if a.shape != b.shape:
            raise AssertionError(f"{self.name}: shapes differ, torch {a.shape} vs jax {b.shape}")
        self.dtype = self.dtype or str(a.dtype)
        if a.dtype.kind in "biu":  # integer / bool tables: exact values (int64 vs int32 is fine)
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64))
            ulp = diff
        else:
            ulp = ulp_distance(a, b)
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        worst = int(ulp.max()) if ulp.size else 0
        rel = 0.0
        if worst:
            scale = float(np.max(np.abs(a.astype(np.float64)))) or 1.0
            rel = float(np.nanmax(diff)) / scale
            self.max_abs = max(self.max_abs, float(np.nanmax(diff)))
            self.max_rel = max(self.max_rel, rel)
            self.max_ulp = max(self.max_ulp, worst)
            if self.first_diff is None:
                self.first_diff = (step, tuple(int(i) for i in np.argwhere(ulp > 0)[0]))
        self.steps += 1
        self.identical_steps += worst == 0
        self.per_step_ulp.append(worst)
        self.per_step_rel.append(rel)


@dataclass
class ArgmaxRecord:
    """Greedy tokens (argmax over the last axis of `name`) of both paths, per step.

    Where torch's top-2 gap is below `tie_tol` of the logits' scale (a near tie) either token
    is within rounding, so a difference there is counted, not failed; `unexplained` counts the
    differences elsewhere, which mean the logits really disagree.
    """

    name: str
    tie_tol: float
    steps: int = 0
    tokens_per_step: int = 0
    per_step_agree: list[int] = field(default_factory=list)  # tokens equal at each step
    near_ties: int = 0  # tokens (equal or not) at a near tie, over the run
    unexplained: int = 0  # tokens that differ without a near tie
    first_unexplained: tuple | None = None  # (step, index)

    @property
    def agree(self) -> int:
        return sum(self.per_step_agree)

    def add(self, step: int, torch_logits, jax_logits) -> None:
        a = as_numpy(torch_logits).astype(np.float32)
        b = as_numpy(jax_logits).astype(np.float32)
        top2 = np.partition(a, -2, axis=-1)[..., -2:]
        tie = top2[..., 1] - top2[..., 0] < self.tie_tol * float(np.abs(a).max())
        differ = a.argmax(-1) != b.argmax(-1)
        bad = differ & ~tie
        self.steps += 1
        self.tokens_per_step = differ.size
        self.per_step_agree.append(int(differ.size - differ.sum()))
        self.near_ties += int(tie.sum())
        self.unexplained += int(bad.sum())
        if bad.any() and self.first_unexplained is None:
            self.first_unexplained = (step, tuple(int(i) for i in np.argwhere(bad)[0]))

    def failure(self) -> str | None:
        if not self.unexplained:
            return None
        return (f"greedy tokens (argmax {self.name}) differ without a near tie at {self.unexplained} "
                f"places (first: step {self.first_unexplained[0]} at {list(self.first_unexplained[1])})")


@dataclass
class CrosscheckReport:
    stack: str
    config: dict
    dtype: str
    batch: int
    frames: int
    steps: int
    device: str
    tensors: dict[str, TensorRecord]
    torch_ms: list[float]
    jax_ms: list[float]
    argmax: ArgmaxRecord | None = None  # temporal stack only
    kernels: str = "reference"           # "reference" or "twin" (see crosscheck)

    def identical(self, name: str) -> bool:
        return self.tensors[name].identical

    def require(self, identical=(), max_rel: dict[str, float] | None = None, *, greedy: bool = False,
                level: str | None = None) -> None:
        """For pytest: raise AssertionError (with the summary table) unless every tensor named in
        `identical` is bit-identical at every step, each `max_rel[name]` bound holds, (greedy)
        the greedy tokens differ only at near ties, and (level) `holds(level)`."""
        if isinstance(identical, str):
            raise TypeError(f"require(identical=...): a sequence of tensor names, got the str {identical!r}")
        unknown = [n for n in [*identical, *(max_rel or {})] if n not in self.tensors]
        if unknown:
            raise ValueError(f"require: no tensor {unknown} in this report; it has {list(self.tensors)}")
        if greedy and self.argmax is None:
            raise ValueError(f"require(greedy=True): a {self.stack} report has no text_logits")
        failures = [f"{n} is not bit-identical" for n in identical if not self.identical(n)]
        failures += [f"{n}: max rel {self.tensors[n].max_rel:.3g} > {bound:.3g}"
                     for n, bound in (max_rel or {}).items() if self.tensors[n].max_rel > bound]
        if greedy and self.argmax.failure():
            failures.append(self.argmax.failure())
        if level is not None:
            failures += self.failures(level)
        if failures:
            raise AssertionError("; ".join(failures) + "\n" + self.summary())

    def failures(self, level: str) -> list[str]:
        """What keeps `level` from holding (empty when it holds).

        "identical": every tensor bit-identical at every step. "close": integer tensors
        identical at every step, each float tensor within `CLOSE_MAX_REL[its dtype]`, and the
        greedy tokens equal except at near ties.
        """
        if level not in REQUIRE_LEVELS:
            raise ValueError(f"level must be one of {REQUIRE_LEVELS}, got {level!r}")
        out = []
        for r in self.tensors.values():
            if r.identical:
                continue
            if level == "identical" or r.integer:
                out.append(f"{r.name} differs at {r.steps - r.identical_steps}/{r.steps} steps "
                           f"(first: step {r.first_diff[0]})")
            elif r.max_rel > CLOSE_MAX_REL.get(r.dtype, 0.0):
                out.append(f"{r.name}: max rel {r.max_rel:.2g} > {CLOSE_MAX_REL.get(r.dtype, 0.0):g} ({r.dtype})")
        if self.argmax is not None and self.argmax.failure():
            out.append(self.argmax.failure())
        return out

    def holds(self, level: str) -> bool:
        return not self.failures(level)

    def close_bounds(self) -> dict[str, float]:
        """The `close` bound of each float dtype in the report."""
        return {r.dtype: CLOSE_MAX_REL.get(r.dtype, 0.0) for r in self.tensors.values() if not r.integer}

    def verdict(self) -> str:
        """One line: what held over the whole run."""
        if self.holds("identical"):
            return "verdict: every tensor bit-identical at every step"
        if not self.holds("close"):
            return "verdict: NOT close: " + "; ".join(self.failures("close"))
        worst: dict[str, TensorRecord] = {}  # per float dtype, the tensor furthest from torch
        for r in self.tensors.values():
            if not r.integer and r.max_rel >= getattr(worst.get(r.dtype), "max_rel", 0.0):
                worst[r.dtype] = r
        floats = ", ".join(f"{r.max_rel:.2g} ({d}, worst {r.name}; bound {CLOSE_MAX_REL.get(d, 0.0):g})"
                           for d, r in sorted(worst.items()))
        line = f"verdict: close: integer state identical at every step; floats within max rel {floats}"
        if self.argmax is not None:
            a = self.argmax
            line += ("; greedy tokens all equal" if a.agree == a.steps * a.tokens_per_step else
                     f"; greedy tokens equal but {a.steps * a.tokens_per_step - a.agree} at near ties")
        return line

    @property
    def torch_ms_per_step(self) -> float:
        return statistics.median(self.torch_ms[WARMUP_STEPS:] or self.torch_ms)

    @property
    def jax_ms_per_step(self) -> float:
        return statistics.median(self.jax_ms[WARMUP_STEPS:] or self.jax_ms)

    def header(self) -> str:
        """The summary's first line: what ran."""
        c = self.config
        return (f"cross-check {self.stack}: dim {c['dim']}, {c['num_layers']} layers, context {c['context']}, "
                f"convention {c['ring_convention']}, {self.dtype}, B={self.batch}, T={self.frames}, "
                f"kernels {self.kernels}, {self.steps} steps on {self.device}")

    def summary(self) -> str:
        lines = [self.header(),
                 "",
                 (f"{'tensor':<14}{'bit-identical':<15}{'steps equal':>12}{'max abs':>11}{'max rel':>10}"
                  f"{'max ULP':>9}  first diff"),
                 "-" * 90]
        for r in self.tensors.values():
            where = "-" if r.first_diff is None else f"step {r.first_diff[0]} at {list(r.first_diff[1])}"
            lines.append(f"{r.name:<14}{'yes' if r.identical else 'NO':<15}"
                         f"{f'{r.identical_steps}/{r.steps}':>12}{r.max_abs:>11.3g}{r.max_rel:>10.2g}{r.max_ulp:>9}  {where}")
        lines.append("")
        if self.argmax is not None:
            a = self.argmax
            lines.append(f"greedy tokens (argmax {a.name}): {a.agree}/{a.steps * a.tokens_per_step} equal, "
                         f"{a.near_ties} near ties (top-2 gap < {a.tie_tol:.3g} of scale), "
                         f"{a.unexplained} differ without one")
        lines += [(f"ms/step (median, step 0's compile left out): torch {self.torch_ms_per_step:.3f}, "
                   f"jax {self.jax_ms_per_step:.3f}"), self.verdict()]
        return "\n".join(lines)

    def to_json(self) -> dict:
        out = asdict(self)
        out["tensors"] = {k: {**asdict(r), "identical": r.identical} for k, r in self.tensors.items()}
        out["torch_ms_per_step"], out["jax_ms_per_step"] = self.torch_ms_per_step, self.jax_ms_per_step
        out["verdict"] = self.verdict()
        out["holds"] = {level: self.holds(level) for level in REQUIRE_LEVELS}
        out["close_bounds"] = self.close_bounds()
        return out

    def write_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def plot(self, path) -> None:
        """Three panels over the steps: per-step relative error of the float tensors (log scale,
        bit-identical steps at REL_FLOOR), a pass/fail strip of the integer tensors (and the
        greedy tokens), and ms/step without the warm-up step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.transforms import blended_transform_factory

        floats = [r for r in self.tensors.values() if not r.integer]
        ints = [r for r in self.tensors.values() if r.integer]
        fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8), sharex=True, layout="constrained",
                                            gridspec_kw={"height_ratios": [3, 1.4, 1.6]})
        steps = np.arange(self.steps)
        for r in floats:
            ax1.plot(steps, np.maximum(np.asarray(r.per_step_rel), REL_FLOOR), lw=0.9,
                     label=f"{r.name} ({r.dtype})")
        ax1.set_yscale("log")
        top = max([REL_FLOOR * 10, *(r.max_rel for r in floats), *self.close_bounds().values()])
        ax1.set_ylim(REL_FLOOR / 4, top * 4)
        left = blended_transform_factory(ax1.transAxes, ax1.transData)
        ax1.axhline(REL_FLOOR, color="0.5", ls=":", lw=1)
        ax1.text(0.005, REL_FLOOR / 1.2, f"0 (bit-identical step), drawn at {REL_FLOOR:g}", transform=left,
                 fontsize=8, color="0.35", va="top")
        for dtype, bound in self.close_bounds().items():
            ax1.axhline(bound, color="0.3", ls="--", lw=0.8)
            ax1.text(0.005, bound * 1.3, f"'close' bound, {dtype}: {bound:g}", transform=left, fontsize=8,
                     color="0.25", va="bottom")
        ax1.set_ylabel("max|torch-jax| / max|torch|\n(per step)")
        ax1.set_title(f"torch vs JAX: {self.stack}, {self.dtype}, B={self.batch}, T={self.frames}, "
                      f"{self.steps} steps on {self.device}\n" + textwrap.fill(self.verdict(), 150), fontsize=9)
        ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
                   title="float tensors", title_fontsize=8)

        rows = [np.where(np.asarray(r.per_step_ulp) == 0, 2, 0) for r in ints]
        names = [r.name for r in ints]
        if self.argmax is not None:  # 2: every token equal, 1: differences at near ties only, 0: not
            a = self.argmax
            agree = np.asarray(a.per_step_agree)
            rows.append(np.where(agree == a.tokens_per_step, 2, 1))
            names.append(f"argmax {a.name}")
            if a.first_unexplained is not None:
                rows[-1][a.first_unexplained[0]] = 0
        ax2.imshow(np.stack(rows), aspect="auto", interpolation="nearest", vmin=0, vmax=2,
                   cmap=ListedColormap(["#d62728", "#ff9f1c", "#2ca02c"]),
                   extent=(-0.5, self.steps - 0.5, len(rows) - 0.5, -0.5))
        ax2.set_yticks(range(len(rows)), names, fontsize=8)
        ax2.set_yticks(np.arange(len(rows) - 1) + 0.5, minor=True)
        ax2.grid(which="minor", axis="y", color="white", lw=1.5)
        ax2.tick_params(which="minor", left=False)
        ax2.set_ylabel("exact?")
        ax2.set_title("integer tensors per step: green equal, red differ (argmax: orange = only near ties "
                      "differ)", fontsize=8, loc="left")

        ax3.plot(steps[WARMUP_STEPS:], self.torch_ms[WARMUP_STEPS:], lw=0.9, label="torch")
        ax3.plot(steps[WARMUP_STEPS:], self.jax_ms[WARMUP_STEPS:], lw=0.9, label="jax (jit)")
        ax3.set_ylim(bottom=0)
        ax3.set_ylabel("ms/step\n(step 0, the compile,\nleft out)")
        ax3.set_xlabel("step")
        ax3.set_xlim(-0.5, self.steps - 0.5)
        ax3.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def default_config(stack: str, device: str) -> StackConfig:
    """Small presets on the CPU, the real sizes on a GPU."""
    kind = "temporal" if stack == "temporal" else "mimi"
    return PRESETS[kind if device.startswith("cuda") else f"{kind}-small"]


def default_threads(config: StackConfig, device: str) -> int | None:
    """torch's CPU threads unless told: 1 for a small stack on the CPU, else None (torch's default).

    A small step is far below a millisecond of work: torch's thread hand-offs, fighting XLA's
    pool and any other job for the cores, cost more than they save (on 2 busy cores the main
    job once printed 156 ms/step for torch against ~1 single-threaded).
    """
    return 1 if not device.startswith("cuda") and config.dim <= SMALL_DIM else None


def resolve_device(device, name: str = "device") -> str:
    """The torch device string to run on ("cpu", "cuda", "cuda:N"); None picks cuda if available.

    Raises ValueError naming `name` (the argument or flag) when this machine cannot run it,
    before anything is allocated (torch would fail later with an AssertionError).
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str | torch.device):
        raise TypeError(f"{name} must be a str such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    if dev.type == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"{name} {str(device)!r}: this torch build sees no CUDA GPU "
                         f"(torch.cuda.is_available() is False); use cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name} {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s)")
    if jax.default_backend() != "gpu":
        raise ValueError(f"{name} {str(device)!r}: JAX sees no GPU (backend {jax.default_backend()!r}); "
                         f"both paths run on the same device")
    return str(dev)


def check_int(name: str, value, minimum: int, allow_none: bool = False) -> int | None:
    """value as an int >= minimum (None passes where allowed); TypeError / ValueError naming `name`."""
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {value}")
    return int(value)


def crosscheck(stack: str = "temporal", *, steps: int = 200, batch: int = 4, convention: str = "personaplex",
               dtype: str = "float32", frames: int | None = None, config: StackConfig | None = None,
               checkpoint: str | None = None, device: str | None = None, seed: int = 0,
               recycle: bool = True, threads: int | None = None, layer_loop: str = "python",
               kernels: str = "reference", recycle_rate: float = 1.0, progress=None) -> CrosscheckReport:
    """Run both paths side by side for `steps` steps; returns the per-tensor report.

    stack: "temporal", "mimi-encoder" or "mimi-decoder". frames: T per step, 1..capacity
    (default 1 for temporal, 2 for Mimi). config: a `TemporalConfig`/`MimiConfig` (default:
    small presets on CPU, real sizes on GPU). checkpoint: a Moshi safetensors file (the config
    must match it). seed: >= 0, seeds the weights and the schedule. recycle: apply random
    reset_slot / bump_slot_start / reset_rows. threads: torch's CPU threads for the run (None:
    `default_threads`; restored afterwards). layer_loop: the JAX step's ("python" or "scan").
    kernels: "reference" (the torch reference path against the JAX step's default kernels: close,
    not bit-identical) or "twin" (both paths on the twin kernels, Triton and Pallas: bit-identical).
    recycle_rate: scales the recycle ops' probabilities (at most 12: each op stays below 1).
    progress: a callable wrapping the step range (e.g. tqdm), or None.

    Every argument is checked before any work; bad values raise ValueError (TypeError for a
    wrong type) naming the argument.
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {list(STACKS)}, got {stack!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if convention not in RING_CONVENTIONS:
        raise ValueError(f"convention must be one of {list(RING_CONVENTIONS)}, got {convention!r}")
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {list(LAYER_LOOPS)}, got {layer_loop!r}")
    if kernels not in CROSSCHECK_KERNELS:
        raise ValueError(f"kernels must be one of {list(CROSSCHECK_KERNELS)}, got {kernels!r}")
    steps, batch = check_int("steps", steps, 1), check_int("batch", batch, 1)
    seed = check_int("seed", seed, 0)
    threads = check_int("threads", threads, 1, allow_none=True)
    frames = check_int("frames", frames, 1, allow_none=True)
    if isinstance(recycle_rate, bool) or not isinstance(recycle_rate, (int, float)) or not 0 < recycle_rate <= 12:
        raise ValueError(f"recycle_rate must be a number in (0, 12], got {recycle_rate!r}")
    if not isinstance(recycle, bool):
        raise TypeError(f"recycle must be a bool, got {type(recycle).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable wrapping the step range, or None; got {progress!r}")
    if config is not None and not isinstance(config, StackConfig):
        raise TypeError(f"config must be a TemporalConfig or MimiConfig, got {type(config).__name__}")
    device = resolve_device(device)
    prefix, default_frames = STACKS[stack]
    config = with_options(config or default_config(stack, device), ring_convention=convention)
    if (stack == "temporal") == isinstance(config, MimiConfig):
        raise ValueError(f"config {type(config).__name__} does not fit stack {stack!r}")
    T = default_frames if frames is None else frames
    if T > config.capacity:
        raise ValueError(f"frames must be at most the ring's capacity ({config.capacity}), got {T}")
    if checkpoint is not None:
        check_safetensors(checkpoint, config, prefix)  # before allocating a model of that size
    threads = default_threads(config, device) if threads is None else threads
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(stack, config, prefix, steps=steps, batch=batch, T=T, dtype=dtype, checkpoint=checkpoint,
                    device=device, seed=seed, recycle=recycle, layer_loop=layer_loop, kernels=kernels,
                    recycle_rate=recycle_rate, progress=progress)
    finally:
        torch.set_num_threads(saved_threads)


def _run(stack, config, prefix, *, steps, batch, T, dtype, checkpoint, device, seed, recycle, layer_loop,
         kernels, recycle_rate, progress) -> CrosscheckReport:
    cls = TemporalStreaming if stack == "temporal" else MimiTransformer
    module = cls.from_config(config, dtype=DTYPES[dtype], device=device, kernels=kernels)
    if checkpoint is not None:
        module.load_safetensors(checkpoint, prefix)
    else:
        module.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    module.streaming_init(batch)

    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    in_proj = params["params"]["layers"]["in_proj"]
    state = jax_impl.init_state(config, batch, in_proj.dtype, device=in_proj.devices().pop())
    jax_step = jax_impl.make_step(config, layer_loop=layer_loop, capture=("intermediates",),
                                  rope_freqs=module.rope_freqs(), kernels="twin" if kernels == "twin" else "auto")

    tables = ("cos", "sin", "write_index", "positions", "mask", "end_offset")
    names = ["out"] + (["text_logits"] if stack == "temporal" else []) + [
        "k", "v", *tables, "offset", "start_offset"]
    records = {n: TensorRecord(n) for n in names}
    argmax = ArgmaxRecord("text_logits", TIE_TOL[dtype]) if stack == "temporal" else None
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch_ms, jax_ms = [], []
    step_range = range(steps) if progress is None else progress(range(steps))
    for step in step_range:
        if recycle:
            state = _random_recycle(rng, module, state, batch, recycle_rate)
        x = torch.randn(batch, T, config.dim, generator=gen).to(device=device, dtype=DTYPES[dtype])
        active = torch.from_numpy(rng.random(batch) < 0.8).to(device)

        t0 = time.perf_counter()
        with layer_tables(module) as torch_tables:
            torch_out = module.step(x, active)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        jax_out, state, captured = jax_step(params, state, to_jax(x, copy=None), to_jax(active, copy=None))
        jax.block_until_ready((jax_out, state))
        t2 = time.perf_counter()
        torch_ms.append(1e3 * (t1 - t0))
        jax_ms.append(1e3 * (t2 - t1))

        torch_outs = torch_out if isinstance(torch_out, tuple) else (torch_out,)
        jax_outs = jax_out if isinstance(jax_out, tuple) else (jax_out,)
        pairs = dict(zip(names, [*zip(torch_outs, jax_outs)]))
        ts, (tt,) = module.state, torch_tables  # one table set, used by every layer
        (jt,) = captured["intermediates"]["tables"]
        pairs.update(k=(ts.k, state.k), v=(ts.v, state.v), offset=(ts.offset, state.offset),
                     start_offset=(ts.start_offset, state.start_offset))
        for name in tables:
            pairs[name] = (getattr(tt, name), getattr(jt, name))
        host = {name: (_host(a), np.asarray(b)) for name, (a, b) in pairs.items()}
        for name, (a, b) in host.items():
            records[name].add(step, a, b)
        if argmax is not None:
            argmax.add(step, *host["text_logits"])
    cfg = {k: getattr(config, k) for k in config.__dataclass_fields__}
    return CrosscheckReport(stack=stack, config=cfg, dtype=dtype, batch=batch, frames=T, steps=steps,
                            kernels=kernels, device=device_name(device), tensors=records, torch_ms=torch_ms, jax_ms=jax_ms,
                            argmax=argmax)


@contextlib.contextmanager
def layer_tables(module):
    """Within the block, collect the distinct `StepTables` objects that module's layers receive.

    Wraps the stack's layer function for the duration, so a parity check compares the tables
    the layers actually used, not a recomputed copy.
    """
    seen: list = []
    layer_fn = module._layer_fn

    def recording(x, w, num_heads, eps, ring_k, ring_v, tables, active):
        if not any(t is tables for t in seen):
            seen.append(tables)
        return layer_fn(x, w, num_heads, eps, ring_k, ring_v, tables, active)

    module._layer_fn = recording
    try:
        yield seen
    finally:
        module._layer_fn = layer_fn


def _random_recycle(rng, module, state, batch, rate: float = 1.0):
    """Apply one random recycle op (or none) to both paths; returns the new JAX state.

    rate scales the ops' probabilities (1: 3% reset_slot, half of them the sacrifice tick, 3%
    bump_slot_start, 2% reset_rows per step); short runs raise it to meet every op.
    """
    u, b = rng.random() / rate, int(rng.integers(batch))
    if u < 0.03:  # half of them the sacrifice tick: reset_slot, then bump_slot_start hides the next write
        module.reset_slot(b)
        state = jax_impl.jit_reset_slot(state, np.int32(b))
        if u < 0.015:
            module.bump_slot_start(b)
            state = jax_impl.jit_bump_slot_start(state, np.int32(b))
        return state
    if u < 0.06 and int(module.state.start_offset[b]) < int(module.state.offset[b]):
        module.bump_slot_start(b)
        return jax_impl.jit_bump_slot_start(state, np.int32(b))
    if u < 0.08:
        mask = rng.random(batch) < 0.5
        module.reset_rows(torch.from_numpy(mask).to(module.device))
        return jax_impl.jit_reset_rows(state, mask)
    return state


def _host(t: torch.Tensor) -> np.ndarray:
    return as_numpy(t.detach().cpu())


def device_name(device: str) -> str:
    """The report's device line: the GPU's name, or the CPU with torch's thread count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    n = torch.get_num_threads()
    return f"CPU ({jax.devices()[0].platform}, {n} torch thread{'s' if n != 1 else ''})"


__all__ = ["ArgmaxRecord", "CrosscheckReport", "TensorRecord", "check_int", "crosscheck", "default_config",
           "default_threads", "device_name", "layer_tables", "resolve_device"]
