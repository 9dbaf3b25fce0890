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
(argmax of text_logits) are compared too: they may differ only at a near tie. The report, its
levels, summary, JSON and plot are `torch_bridge.report`.
"""

from __future__ import annotations

import contextlib
import numbers
import sys
import time

import jax
import numpy as np
import torch

import jax_impl
from jax_impl.config import PRESETS, RING_CONVENTIONS, MimiConfig, StackConfig, with_options
from jax_impl.kernel_choice import TORCH_KERNELS, check_kernels
from jax_impl.parity import as_numpy

from .dlpack import to_jax
from .model import MimiTransformer, TemporalStreaming
from .report import TIE_TOL, ArgmaxRecord, CrosscheckReport, TensorRecord
from .weights import check_safetensors

STACKS = {"temporal": (None, 1), "mimi-encoder": ("encoder_transformer", 2),
          "mimi-decoder": ("decoder_transformer", 2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYER_LOOPS = ("python", "scan")
CROSSCHECK_KERNELS = TORCH_KERNELS  # the same name on both paths (`jax_impl.kernel_choice`)
SMALL_DIM = 256  # stacks up to this width count as small (the presets: 64 and 32)
DEFAULT_STEPS = 300
# The twin kernels on the CPU run torch's side under Triton's interpreter, 0.3-1.8 s a step of a small
# preset on 2 cores: a run of the default length wraps the ring this many times (with recycling), not 300 steps.
CPU_TWIN_WRAPS = 3
PROGRESS_EVERY_S = 5.0  # progress_lines: a line every this many seconds


def default_preset(device: str) -> str:
    """The LM frame's and the speech frame's preset (`FRAME_PRESETS`, `SPEECH_PRESETS`: the same names):
    PersonaPlex's sizes on a GPU; on the CPU its small preset (the real 80 ms frames, narrow)."""
    return "personaplex" if device.startswith("cuda") else "personaplex-small"


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


def default_steps(config: StackConfig, T: int, kernels: str, device: str) -> int:
    """Steps of a run when none are given: DEFAULT_STEPS, or with the twin kernels on the CPU (the
    Triton interpreter) enough to wrap the ring CPU_TWIN_WRAPS times, T frames a step, if fewer
    (temporal-small: 72 steps, its context 24; mimi-small: 15, context 10 at 2 frames a step)."""
    if kernels == "twin" and not device.startswith("cuda"):
        return min(DEFAULT_STEPS, CPU_TWIN_WRAPS * -(-config.capacity // T))
    return DEFAULT_STEPS


def progress_lines(desc: str, every: float = PROGRESS_EVERY_S, stream=None):
    """A `progress` wrapper for a stream that is not a terminal (a log file, a CI job): a plain line
    "{desc}: {done}/{total} steps, {elapsed} s" at the first step and then every `every` seconds,
    where a progress bar would be one ever-growing line. stream: default sys.stderr (read per line)."""
    def progress(steps):
        start = last = time.perf_counter()
        for done, step in enumerate(steps):
            now = time.perf_counter()
            if done == 0 or now - last >= every:
                print(f"{desc}: {done}/{len(steps)} steps, {now - start:.0f} s", file=stream or sys.stderr,
                      flush=True)
                last = now
            yield step

    return progress


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


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit seed


def check_int(name: str, value, minimum: int, allow_none: bool = False, maximum: int | None = None) -> int | None:
    """value as an int >= minimum and <= maximum (None passes where allowed); TypeError / ValueError
    naming `name`."""
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def crosscheck(stack: str = "temporal", *, steps: int | None = None, batch: int = 4, convention: str = "personaplex",
               dtype: str = "float32", frames: int | None = None, config: StackConfig | None = None,
               checkpoint: str | None = None, device: str | None = None, seed: int = 0,
               recycle: bool = True, threads: int | None = None, layer_loop: str = "python",
               kernels: str = "reference", recycle_rate: float = 1.0, progress=None) -> CrosscheckReport:
    """Run both paths side by side for `steps` steps (None: `default_steps`); returns the per-tensor report.

    stack: "temporal", "mimi-encoder" or "mimi-decoder". frames: T per step, 1..capacity
    (default 1 for temporal, 2 for Mimi). config: a `TemporalConfig`/`MimiConfig` (default:
    small presets on CPU, real sizes on GPU). checkpoint: a Moshi safetensors file (the config
    must match it). seed: >= 0, seeds the weights and the schedule. recycle: apply random
    reset_slot / bump_slot_start / reset_rows. threads: torch's CPU threads for the run (None:
    `default_threads`; restored afterwards). layer_loop: the JAX step's ("python" or "scan").
    kernels: both paths' (`jax_impl.kernel_choice`): "reference" (each framework's plain path: the
    torch reference, bit-exact with moshi, against XLA: close, not bit-identical) or "twin" (both
    paths on the twin kernels, Triton and Pallas: bit-identical).
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
    check_kernels("crosscheck(kernels)", kernels, CROSSCHECK_KERNELS)
    steps = None if steps is None else check_int("steps", steps, 1)  # None: default_steps, once config is known
    batch = check_int("batch", batch, 1)
    seed = check_int("seed", seed, 0, maximum=SEED_MAX)
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
    steps = default_steps(config, T, kernels, device) if steps is None else steps
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
                                  rope_freqs=module.rope_freqs(), kernels=kernels)

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
    """Within the block, collect the distinct `TorchStepTables` objects that module's layers receive.

    Wraps the stack's layer function for the duration, so a parity check compares the tables
    the layers actually used, not a recomputed copy.
    """
    seen: list = []
    layer_fn = module._layer_fn

    def recording(carry, layer, tables, active):
        if not any(t is tables for t in seen):
            seen.append(tables)
        return layer_fn(carry, layer, tables, active)

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


__all__ = ["check_int", "crosscheck", "default_config", "default_steps", "default_threads", "device_name",
           "layer_tables", "progress_lines", "resolve_device"]
