"""The cross-check of the language model's depformer and whole frame: torch and JAX side by side.

    report = crosscheck_lm("frame", steps=40, batch=3)     # a `crosscheck.CrosscheckReport`
    print(report.summary()); report.require(level="close")

Both paths run on the same weight buffers (DLPack views), the same inputs and active masks
(and, for the frame, the same recycle operations); each step every tensor is compared as the
stacks' cross-check compares them. "depformer": one frame's codes and logits from random text
tokens and temporal outputs. "frame": the frame's tokens (undelayed, as sampled), its logits and
transformer output, the token cache, the frame offsets and the temporal stack's rings and offsets.
kernels="twin": both sides on the twin kernels (Triton for torch, Pallas for JAX): every tensor
bit-identical. kernels="reference": the torch reference path against JAX's jax.numpy path: the
floats agree to the matmuls' summation order, the tokens exactly.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import torch

from jax_impl.depformer import make_depformer_step
from jax_impl.frame import init_frame_state, jit_reset_rows, jit_reset_slot, make_frame_step
from jax_impl.frame_config import FRAME_PRESETS

from .crosscheck import CROSSCHECK_KERNELS, DTYPES, default_preset, device_name, resolve_device
from .depformer import Depformer
from .dlpack import to_jax
from .frame import LMFrame, jax_frame_params
from .report import TIE_TOL, ArgmaxRecord, CrosscheckReport, TensorRecord

LM_STACKS = ("depformer", "frame")
# Steps of a run by default: on the CPU the torch twins run under Triton's interpreter (seconds a
# frame of the small preset), so a few: the frame's delays (up to 2 frames) pass.
DEFAULT_STEPS = 40
CPU_TWIN_STEPS = {"depformer": 3, "frame": 8}


def default_steps(stack: str, kernels: str, device: str) -> int:
    """Steps of a run when none are given: `CPU_TWIN_STEPS` for the twin kernels on the CPU, else 40."""
    return CPU_TWIN_STEPS[stack] if kernels == "twin" and device == "cpu" else DEFAULT_STEPS


def crosscheck_lm(stack: str = "frame", *, steps: int | None = None, batch: int = 4, dtype: str = "float32",
                  device: str | None = None, seed: int = 0, recycle: bool = True, threads: int | None = 1,
                  kernels: str = "reference", progress=None) -> CrosscheckReport:
    """Run the torch and JAX `stack` ("depformer" or "frame") side by side for `steps` steps.

    Sizes: PersonaPlex's on a GPU, its small preset on the CPU. steps: None for `default_steps`.
    recycle: the frame's reset_slot / reset_rows at random. threads: torch's CPU threads (None:
    torch's default; restored after). kernels: "twin" or "reference" (module docstring). Bad
    arguments raise ValueError / TypeError naming the argument before any work.
    """
    if stack not in LM_STACKS:
        raise ValueError(f"stack must be one of {list(LM_STACKS)}, got {stack!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if kernels not in CROSSCHECK_KERNELS:
        raise ValueError(f"kernels must be one of {list(CROSSCHECK_KERNELS)}, got {kernels!r}")
    for name, value in (("steps", 1 if steps is None else steps), ("batch", batch), ("seed", seed + 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= {0 if name == 'seed' else 1}, got {value!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    device = resolve_device(device)
    steps = default_steps(stack, kernels, device) if steps is None else steps
    cfg = FRAME_PRESETS[default_preset(device)]
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        frame = LMFrame.from_config(cfg, dtype=DTYPES[dtype], device=device, kernels=kernels)
        frame.init_weights(std=0.1, generator=torch.Generator(device=device).manual_seed(seed))
        run = _run_depformer if stack == "depformer" else _run_frame
        records, argmax, torch_ms, jax_ms, config = run(frame, steps, batch, seed, recycle, progress)
        where = device_name(device)  # with the run's torch threads
    finally:
        torch.set_num_threads(saved)
    return CrosscheckReport(stack=stack, config=config, dtype=dtype, batch=batch, frames=1, steps=steps, device=where,
                            tensors=records, torch_ms=torch_ms, jax_ms=jax_ms, argmax=argmax, kernels=kernels)


def _timed(fn, *args, **kwargs):
    """fn(*args, **kwargs) and its milliseconds, its outputs waited for (torch's CPU ops are synchronous)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - t0)


def _run_depformer(frame: LMFrame, steps, batch, seed, recycle, progress):
    dep: Depformer = frame.depformer
    c = dep.config
    params = jax_frame_params(frame)["depformer"]
    jax_step = make_depformer_step(c, dep.kernels)
    records = {n: TensorRecord(n) for n in ("codes", "logits")}
    argmax = ArgmaxRecord("logits", TIE_TOL[str(dep.dtype).removeprefix("torch.")])
    gen = torch.Generator().manual_seed(seed)
    torch_ms, jax_ms = [], []
    for step in range(steps) if progress is None else progress(range(steps)):
        text = torch.randint(-1, c.text_card + 1, (batch,), generator=gen).to(dep.device)
        out = torch.randn(batch, 1, c.temporal_dim, generator=gen).to(device=dep.device, dtype=dep.dtype)
        (codes, logits), t_ms = _timed(dep, text, out, return_logits=True)
        (jcodes, jlogits), j_ms = _timed(jax_step, params, to_jax(text.int(), copy=None),
                                           to_jax(out, copy=None))
        torch_ms.append(t_ms)
        jax_ms.append(j_ms)
        records["codes"].add(step, codes.cpu(), np.asarray(jcodes))
        records["logits"].add(step, logits.cpu(), np.asarray(jlogits))
        argmax.add(step, logits.cpu(), np.asarray(jlogits))
    config = {**{k: getattr(c, k) for k in c.__dataclass_fields__}, "context": c.dep_q, "ring_convention": "-"}
    return records, argmax, torch_ms, jax_ms, config


def _run_frame(frame: LMFrame, steps, batch, seed, recycle, progress):
    cfg = frame.config
    params = jax_frame_params(frame)
    state = init_frame_state(cfg, batch, params["text_emb"].dtype, device=params["text_emb"].devices().pop())
    jax_step = make_frame_step(cfg, kernels=frame.kernels, rope_freqs=frame.temporal.rope_freqs())
    frame.streaming_init(batch)
    names = ("tokens", "text", "audio", "text_logits", "audio_logits", "temporal_out", "token_cache",
             "frame_offset", "k", "v", "offset", "start_offset")
    records = {n: TensorRecord(n) for n in names}
    argmax = ArgmaxRecord("text_logits", TIE_TOL[str(frame.dtype).removeprefix("torch.")])
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch_ms, jax_ms = [], []
    for step in range(steps) if progress is None else progress(range(steps)):
        if recycle and rng.random() < 0.05:
            b = int(rng.integers(batch))
            frame.reset_slot(b)
            state = jit_reset_slot(state, b)
        elif recycle and rng.random() < 0.03:
            mask = rng.random(batch) < 0.5
            frame.reset_rows(torch.from_numpy(mask).to(frame.device))
            state = jit_reset_rows(state, mask)
        user = torch.randint(-1, cfg.card + 1, (batch, cfg.user_codebooks), generator=gen)
        active = torch.from_numpy(rng.random(batch) < 0.8)
        ours, t_ms = _timed(frame.step, user.to(frame.device), active.to(frame.device))
        (theirs, state), j_ms = _timed(jax_step, params, state, user.int().numpy(), active.numpy())
        torch_ms.append(t_ms)
        jax_ms.append(j_ms)
        ts = frame.temporal.state
        pairs = {**{n: (getattr(ours, n), getattr(theirs, n)) for n in names[:5]},
                 "temporal_out": (ours.transformer_out, theirs.transformer_out),
                 "token_cache": (frame.token_cache, state.token_cache),
                 "frame_offset": (frame.frame_offset, state.frame_offset),
                 **{n: (getattr(ts, n), getattr(state.temporal, n)) for n in ("k", "v", "offset", "start_offset")}}
        for name, (a, b) in pairs.items():
            records[name].add(step, a.detach().cpu(), np.asarray(b))
        argmax.add(step, ours.text_logits.cpu(), np.asarray(theirs.text_logits))
    t = cfg.temporal
    config = {**{k: getattr(t, k) for k in t.__dataclass_fields__}, "n_q": cfg.n_q, "dep_q": cfg.dep_q,
              "delays": list(cfg.delays)}
    return records, argmax, torch_ms, jax_ms, config
