"""The cross-check: the torch path and the JAX path side by side on one schedule.

    report = crosscheck("temporal", steps=200, batch=4)
    report.print_summary()            # one row per tensor: bit-identical or not, max abs, max ULP
    assert report.identical("positions")

Both paths run on the same weight buffers (the JAX parameters are DLPack views of the torch
stack's buffers), the same inputs, active masks and recycle operations. Each step, every
tensor (outputs, logits, ring contents, RoPE tables, write indexes, positions, mask, offsets)
is compared on its raw bits: identical or not, max abs and max ULP difference, and the first
place they differ.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import jax
import numpy as np
import torch

import jax_impl
from jax_impl.config import PRESETS, MimiConfig, StackConfig, with_options
from jax_impl.parity import as_numpy, ulp_distance

from .dlpack import to_jax
from .stacks import MimiTransformer, TemporalStreaming, check_safetensors

STACKS = {"temporal": (None, 1), "mimi-encoder": ("encoder_transformer", 2),
          "mimi-decoder": ("decoder_transformer", 2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TensorRecord:
    """Agreement of one tensor over the run (ULPs blow up near zero: read them with max rel)."""

    name: str
    steps: int = 0
    identical_steps: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0  # max |torch - jax| / max |torch|, per step (normwise)
    max_ulp: int = 0
    first_diff: tuple | None = None  # (step, index) of the first differing element
    per_step_ulp: list[int] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.steps > 0 and self.identical_steps == self.steps

    def add(self, step: int, torch_value, jax_value) -> None:
        a, b = as_numpy(torch_value), as_numpy(jax_value)
        if a.shape != b.shape:
            raise AssertionError(f"{self.name}: shapes differ, torch {a.shape} vs jax {b.shape}")
        if a.dtype.kind in "biu":  # integer / bool tables: exact values (int64 vs int32 is fine)
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64))
            ulp = diff
        else:
            ulp = ulp_distance(a, b)
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        worst = int(ulp.max()) if ulp.size else 0
        self.steps += 1
        self.identical_steps += worst == 0
        self.per_step_ulp.append(worst)
        if worst:
            self.max_abs = max(self.max_abs, float(np.nanmax(diff)))
            scale = float(np.max(np.abs(a.astype(np.float64)))) or 1.0
            self.max_rel = max(self.max_rel, float(np.nanmax(diff)) / scale)
            self.max_ulp = max(self.max_ulp, worst)
            if self.first_diff is None:
                self.first_diff = (step, tuple(int(i) for i in np.argwhere(ulp > 0)[0]))


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

    def identical(self, name: str) -> bool:
        return self.tensors[name].identical

    def require(self, identical=(), max_rel: dict[str, float] | None = None) -> None:
        """For pytest: raise AssertionError (with the summary table) unless every tensor named in
        `identical` is bit-identical at every step and each `max_rel[name]` bound holds."""
        failures = [f"{n} is not bit-identical" for n in identical if not self.identical(n)]
        failures += [f"{n}: max rel {self.tensors[n].max_rel:.3g} > {bound:.3g}"
                     for n, bound in (max_rel or {}).items() if self.tensors[n].max_rel > bound]
        if failures:
            raise AssertionError("; ".join(failures) + "\n" + self.summary())

    @property
    def torch_ms_per_step(self) -> float:
        return statistics.median(self.torch_ms)

    @property
    def jax_ms_per_step(self) -> float:
        return statistics.median(self.jax_ms)

    def summary(self) -> str:
        c = self.config
        lines = [(f"cross-check {self.stack}: dim {c['dim']}, {c['num_layers']} layers, context {c['context']}, "
                  f"convention {c['ring_convention']}, {self.dtype}, B={self.batch}, T={self.frames}, "
                  f"{self.steps} steps on {self.device}"),
                 "",
                 (f"{'tensor':<14}{'bit-identical':<15}{'steps equal':>12}{'max abs':>11}{'max rel':>10}"
                  f"{'max ULP':>9}  first diff"),
                 "-" * 90]
        for r in self.tensors.values():
            where = "-" if r.first_diff is None else f"step {r.first_diff[0]} at {list(r.first_diff[1])}"
            lines.append(f"{r.name:<14}{'yes' if r.identical else 'NO':<15}"
                         f"{f'{r.identical_steps}/{r.steps}':>12}{r.max_abs:>11.3g}{r.max_rel:>10.2g}{r.max_ulp:>9}  {where}")
        lines += ["", f"ms/step (median): torch {self.torch_ms_per_step:.3f}, jax {self.jax_ms_per_step:.3f}"]
        return "\n".join(lines)

    def to_json(self) -> dict:
        out = asdict(self)
        out["tensors"] = {k: {**asdict(r), "identical": r.identical} for k, r in self.tensors.items()}
        out["torch_ms_per_step"], out["jax_ms_per_step"] = self.torch_ms_per_step, self.jax_ms_per_step
        return out

    def write_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def plot(self, path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
        for r in self.tensors.values():
            ax1.plot([u + 1 for u in r.per_step_ulp], label=r.name, lw=1)
        ax1.set_yscale("log")
        ax1.set_ylabel("max ULP difference + 1")
        ax1.set_title(f"torch vs JAX, {self.stack}, {self.dtype}, B={self.batch}")
        ax1.legend(fontsize=7, ncol=4)
        ax2.plot(self.torch_ms, label="torch", lw=1)
        ax2.plot(self.jax_ms, label="jax (jit)", lw=1)
        ax2.set_ylabel("ms/step")
        ax2.set_xlabel("step")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def default_config(stack: str, device: str) -> StackConfig:
    """Small presets on the CPU, the real sizes on a GPU."""
    kind = "temporal" if stack == "temporal" else "mimi"
    return PRESETS[kind if device.startswith("cuda") else f"{kind}-small"]


def crosscheck(stack: str = "temporal", *, steps: int = 200, batch: int = 4, convention: str = "personaplex",
               dtype: str = "float32", frames: int | None = None, config: StackConfig | None = None,
               checkpoint: str | None = None, device: str | None = None, seed: int = 0,
               recycle: bool = True, progress=None) -> CrosscheckReport:
    """Run both paths side by side for `steps` steps; returns the per-tensor report.

    stack: "temporal", "mimi-encoder" or "mimi-decoder". frames: T per step (default 1 for
    temporal, 2 for Mimi). config: a `TemporalConfig`/`MimiConfig` (default: small presets on
    CPU, real sizes on GPU). checkpoint: a Moshi safetensors file (the config must match it).
    recycle: apply random reset_slot / bump_slot_start / reset_rows. progress: a callable
    wrapping the step range (e.g. tqdm), or None.
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {list(STACKS)}, got {stack!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    for name, value in (("steps", steps), ("batch", batch)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prefix, default_frames = STACKS[stack]
    T = frames or default_frames
    config = with_options(config or default_config(stack, device), ring_convention=convention)
    if (stack == "temporal") == isinstance(config, MimiConfig):
        raise ValueError(f"config {type(config).__name__} does not fit stack {stack!r}")
    cls = TemporalStreaming if stack == "temporal" else MimiTransformer
    if checkpoint is not None:
        check_safetensors(checkpoint, config, prefix)  # before allocating a model of that size
    module = cls.from_config(config, dtype=DTYPES[dtype], device=device)
    if checkpoint is not None:
        module.load_safetensors(checkpoint, prefix)
    else:
        module.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    module.streaming_init(batch)

    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    state = jax.device_put(jax_impl.init_state(config, batch, params["params"]["layers"]["in_proj"].dtype),
                           params["params"]["layers"]["in_proj"].devices().pop())
    jax_step = jax_impl.make_step(config, layer_loop="python", capture=("intermediates",),
                                  rope_freqs=module.rope_freqs())

    names = ["out"] + (["text_logits"] if stack == "temporal" else []) + [
        "k", "v", "cos", "sin", "write_index", "positions", "mask", "offset", "start_offset"]
    records = {n: TensorRecord(n) for n in names}
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch_ms, jax_ms = [], []
    step_range = range(steps) if progress is None else progress(range(steps))
    for step in step_range:
        if recycle:
            state = _random_recycle(rng, module, state, batch)
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
        for name in ("cos", "sin", "write_index", "positions", "mask"):
            pairs[name] = (getattr(tt, name), getattr(jt, name))
        for name, (a, b) in pairs.items():
            records[name].add(step, _host(a), np.asarray(b))
    cfg = {k: getattr(config, k) for k in config.__dataclass_fields__}
    return CrosscheckReport(stack=stack, config=cfg, dtype=dtype, batch=batch, frames=T, steps=steps,
                            device=_device_name(device), tensors=records, torch_ms=torch_ms, jax_ms=jax_ms)


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


def _random_recycle(rng, module, state, batch):
    """Apply one random recycle op (or none) to both paths; returns the new JAX state."""
    u, b = rng.random(), int(rng.integers(batch))
    if u < 0.03:
        module.reset_slot(b)
        return jax_impl.jit_reset_slot(state, np.int32(b))
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


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({jax.devices()[0].platform}, {torch.get_num_threads()} torch threads)"


__all__ = ["CrosscheckReport", "TensorRecord", "crosscheck", "default_config", "layer_tables"]
