"""The cross-check's report: each tensor's agreement over a run, the greedy tokens', the verdict.

`torch_bridge.crosscheck.crosscheck` fills a `CrosscheckReport` (a `TensorRecord` per compared
tensor, an `ArgmaxRecord` for the temporal stack's greedy tokens); the report says whether the run
holds a level (`holds`, `require`, `failures`), prints its `summary`, writes its JSON and its plot.
It compares host arrays (numpy, or anything `jax_impl.parity.as_numpy` takes): no torch, no jax.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import asdict, dataclass, field

import numpy as np

from jax_impl.parity import as_numpy, ulp_distance

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
        if a.dtype == b.dtype and np.array_equal(*(v.view(f"u{v.itemsize}") if v.dtype.kind == "f" else v
                                                   for v in (a, b))):
            ulp = diff = None  # the same bits: no distance to compute (a real-size ring is gigabytes)
        elif a.dtype.kind in "biu":  # integer / bool tables: exact values (int64 vs int32 is fine)
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64))
            ulp = diff
        else:
            ulp = ulp_distance(a, b)
            with np.errstate(invalid="ignore"):  # inf - inf: NaN, which only finite elements' distance skips
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        worst = int(ulp.max()) if ulp is not None and ulp.size else 0
        rel = 0.0
        if worst:
            # a NaN or inf on one side only (or an inf of the other sign) is a disagreement no
            # distance measures: rel inf; both NaN agree in value (not in bits). Scales over finite values.
            finite = np.isfinite(a) & np.isfinite(b)  # every element of an integer tensor
            odd = ~finite & ~((a == b) | (np.isnan(a) & np.isnan(b)))
            a64 = np.abs(np.where(finite, a, 0).astype(np.float64))
            scale = float(a64.max()) if a64.size else 0.0
            dmax = float(np.where(finite, diff, 0).max()) if diff.size else 0.0
            rel = math.inf if odd.any() else dmax / (scale or 1.0)
            self.max_abs = max(self.max_abs, math.inf if odd.any() else dmax)
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
        finite = np.abs(a[np.isfinite(a)])  # the scale of the finite logits: an inf one makes no tie
        tie = top2[..., 1] - top2[..., 0] < self.tie_tol * float(finite.max() if finite.size else 0.0)
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
                  f"{'max ULP':>21}  first diff"),
                 "-" * 102]
        for r in self.tensors.values():
            where = "-" if r.first_diff is None else f"step {r.first_diff[0]} at {list(r.first_diff[1])}"
            lines.append(f"{r.name:<14}{'yes' if r.identical else 'NO':<15}"
                         f"{f'{r.identical_steps}/{r.steps}':>12}{r.max_abs:>11.3g}{r.max_rel:>10.2g}{r.max_ulp:>21}  {where}")
        lines.append("")
        if self.argmax is not None:
            a = self.argmax
            lines.append(f"greedy tokens (argmax {a.name}): {a.agree}/{a.steps * a.tokens_per_step} equal, "
                         f"{a.near_ties} near ties (top-2 gap < {a.tie_tol:.3g} of scale), "
                         f"{a.unexplained} differ without one")
        warm = "step 0's compile left out" if len(self.jax_ms) > WARMUP_STEPS else "one step: with its compile"
        lines += [(f"ms/step (median, {warm}): torch {self.torch_ms_per_step:.3f}, "
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
        """The report as strict JSON: a distance that is not finite (a NaN or inf on one side) is
        written as the string "inf" / "nan", which every JSON reader takes."""
        def strict(v):
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, dict):
                return {k: strict(x) for k, x in v.items()}
            return [strict(x) for x in v] if isinstance(v, (list, tuple)) else v

        with open(path, "w") as f:
            json.dump(strict(self.to_json()), f, indent=1, allow_nan=False)

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
        rels = [v for r in floats for v in r.per_step_rel if math.isfinite(v)]  # an infinite step: off the top
        top = max([REL_FLOOR * 10, *rels, *self.close_bounds().values()])
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


__all__ = ["ArgmaxRecord", "CrosscheckReport", "TensorRecord"]
