"""The speech frame's cross-check: the torch `SpeechFrame` and the JAX speech frame step side by side.

    report = crosscheck_speech_frame(steps=20, batch=3, kernels="twin")
    print(report.summary()); report.require(level="identical")

Both paths run on the same weight buffers (`SpeechFrame.jax_params`: DLPack views), the same PCM
frames, active masks and `reset_slot`s. Each step compares the frame's outputs (the model's PCM,
the user's codes, the LM's tokens, the ready flags) and every state tensor: the codec's carries
and first-frame flags, its two transformers' rings and offsets, the LM's ring, offsets, token
cache and frame offsets. kernels="twin": both sides on the twin kernels, every tensor identical.
kernels="reference": the torch reference (moshi's bits) against XLA: the floats differ by the
summation order, and a code that differs at a near tie of the encoder or the LM then changes what
both sides feed on: the report shows from which step.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import torch

from jax_impl import speech_frame as sf
from jax_impl.speech_frame_config import SPEECH_PRESETS, SpeechFrameConfig

from .crosscheck import DTYPES, check_int, default_preset, device_name, resolve_device
from .report import CrosscheckReport, TensorRecord
from .speech_frame import SpeechFrame

SPEECH_CROSSCHECK_KERNELS = ("reference", "twin")
RESET_RATE = 0.05  # per step, the chance that one random row starts a fresh session on both sides
ACTIVE_RATE = 0.8  # per step and row, the chance that the row is active
CPU_TWIN_STEPS = 6  # the Triton twins run interpreted on the CPU: seconds a frame


class SpeechCrosscheckReport(CrosscheckReport):
    """A `CrosscheckReport` of the speech frame, headed by its geometry."""

    def header(self) -> str:
        c = self.config
        return (f"cross-check speech-frame: {c['preset']}: codec {c['frame_size']}-sample frames, "
                f"{c['num_codebooks']} codebooks; LM dim {c['dim']}, {c['num_layers']} layers, context "
                f"{c['context']}, dep_q {c['dep_q']} (user codes via {c['user_path']}); {self.dtype}, B={self.batch}, "
                f"kernels {self.kernels}, {self.steps} steps on {self.device}")


def default_speech_steps(kernels: str, device: str) -> int:
    return CPU_TWIN_STEPS if kernels == "twin" and device == "cpu" else 40


def _compared(out, frame: SpeechFrame | None, state_arrays: dict) -> dict:
    """The compared tensors of one side: outputs, then the state grouped (carries concatenated)."""
    carries = [state_arrays[f"codec.{side}"].reshape(-1) for side in ("encoder", "decoder")]
    cat = (torch.cat if frame is not None else np.concatenate)
    pairs = {"pcm": out.pcm, "user_codes": out.user_codes, "tokens": out.tokens, "ready": out.ready,
             "codec_carries": cat(carries), "codec_first": state_arrays["codec.first"]}
    for short, name in (("enc", "codec.encoder_transformer"), ("dec", "codec.decoder_transformer"),
                        ("lm", "lm.temporal")):
        pairs[f"{short}.k"] = state_arrays[f"{name}.k"]
        pairs[f"{short}.v"] = state_arrays[f"{name}.v"]
        pairs[f"{short}.offsets"] = cat([state_arrays[f"{name}.offset"], state_arrays[f"{name}.start_offset"]])
    pairs["token_cache"] = state_arrays["lm.token_cache"]
    pairs["frame_offset"] = state_arrays["lm.frame_offset"]
    return pairs


def crosscheck_speech_frame(*, steps: int | None = None, batch: int = 4, dtype: str = "float32",
                            preset: str | None = None, device: str | None = None, seed: int = 0,
                            recycle: bool = True, threads: int | None = None, kernels: str = "reference",
                            progress=None) -> SpeechCrosscheckReport:
    """Run the torch and JAX speech frames side by side for `steps` frames; the per-tensor report.

    preset: a `SPEECH_PRESETS` name (default: `crosscheck.default_preset`). steps: None for
    `default_speech_steps`. Random weights from `seed`. recycle: a random `reset_slot` now and then.
    threads: torch's CPU threads (None: 1 on the CPU; restored after). kernels: module docstring.
    Every argument is checked before any work, ValueError / TypeError naming it.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if kernels not in SPEECH_CROSSCHECK_KERNELS:
        raise ValueError(f"kernels must be one of {list(SPEECH_CROSSCHECK_KERNELS)}, got {kernels!r}")
    batch, seed = check_int("batch", batch, 1), check_int("seed", seed, 0)
    threads = check_int("threads", threads, 1, allow_none=True)
    if not isinstance(recycle, bool):
        raise TypeError(f"recycle must be a bool, got {type(recycle).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable wrapping the step range, or None; got {progress!r}")
    device = resolve_device(device)
    preset = preset or default_preset(device)
    if preset not in SPEECH_PRESETS:
        raise ValueError(f"preset must be one of {list(SPEECH_PRESETS)}, got {preset!r}")
    steps = check_int("steps", default_speech_steps(kernels, device) if steps is None else steps, 1)
    if threads is None and not device.startswith("cuda"):
        threads = 1
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(preset, SPEECH_PRESETS[preset], steps=steps, batch=batch, dtype=dtype, device=device, seed=seed,
                    recycle=recycle, kernels=kernels, progress=progress)
    finally:
        torch.set_num_threads(saved)


def _run(preset: str, cfg: SpeechFrameConfig, *, steps, batch, dtype, device, seed, recycle, kernels,
         progress) -> SpeechCrosscheckReport:
    frame = SpeechFrame.from_config(cfg, dtype=DTYPES[dtype], device=device, kernels=kernels)
    frame.init_weights(lm_std=0.1, generator=torch.Generator(device=device).manual_seed(seed))
    frame.streaming_init(batch)
    params = frame.jax_params()
    jax_device = params.codec.codebooks.devices().pop()
    state = sf.init_speech_frame_state(cfg, batch, params.codec.codebooks.dtype, device=jax_device)
    codec_freqs, lm_freqs = frame.rope_freqs()
    step = sf.make_speech_frame_step(cfg, kernels=kernels, codec_rope_freqs=codec_freqs, lm_rope_freqs=lm_freqs)
    records: dict[str, TensorRecord] = {}
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch_ms, jax_ms = [], []
    for t in range(steps) if progress is None else progress(range(steps)):
        if recycle and rng.random() < RESET_RATE:
            b = int(rng.integers(batch))
            frame.reset_slot(b)
            state = sf.jit_speech_reset_slot(state, b)
        pcm = torch.randn(batch, 1, cfg.frame_size, generator=gen).to(DTYPES[dtype])
        active = rng.random(batch) < ACTIVE_RATE
        t0 = time.perf_counter()
        ours = frame.step(pcm.to(device), torch.from_numpy(active).to(device))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        theirs, state = step(params, state, jax.device_put(pcm.float().numpy(), jax_device).astype(
            params.codec.codebooks.dtype), active)
        jax.block_until_ready((theirs, state))
        t2 = time.perf_counter()
        torch_ms.append(1e3 * (t1 - t0))
        jax_ms.append(1e3 * (t2 - t1))
        a = _compared(ours, frame, frame.state_arrays())
        b = _compared(theirs, None, {k: np.asarray(v) for k, v in sf.speech_state_arrays(state).items()})
        for name, value in a.items():
            records.setdefault(name, TensorRecord(name)).add(t, value.detach().cpu(), np.asarray(b[name]))
    t = cfg.lm.temporal
    config = {"preset": preset, "frame_size": cfg.frame_size, "num_codebooks": cfg.num_codebooks,
              "dep_q": cfg.lm.dep_q, "user_path": cfg.user_path, **dataclasses.asdict(t)}
    return SpeechCrosscheckReport(stack="speech-frame", config=config, dtype=dtype, batch=batch, frames=1, steps=steps,
                                  kernels=kernels, device=device_name(device), tensors=records, torch_ms=torch_ms,
                                  jax_ms=jax_ms)


__all__ = ["SPEECH_CROSSCHECK_KERNELS", "SpeechCrosscheckReport", "crosscheck_speech_frame"]
