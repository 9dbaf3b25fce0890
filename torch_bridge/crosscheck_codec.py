"""The codec's cross-check: the torch `MimiCodec` and the JAX codec steps side by side, frame by frame.

    report = crosscheck_codec(steps=20, batch=3)
    print(report.summary())
    report.require(identical=["codes"], max_rel={"pcm": 2e-6})

Both paths run on the same weight buffers (`MimiCodec.jax_params`: DLPack views), the same PCM
frames, active masks and `reset_slot`s. Each step encodes a frame on both sides ("codes": the
same integers, or not) and decodes torch's codes on both sides ("pcm": its distance), so a code
that differs at a near tie of the encoder does not follow into the decoder's comparison. The
report is the transformer stacks' `CrosscheckReport` (`summary`, `require`, `holds`, `to_json`,
`plot`), headed by the codec's geometry.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import torch

from jax_impl.checkpoint import read_safetensors, read_safetensors_shapes
from jax_impl.codec import init_codec_state, jit_codec_reset_slot, make_codec_step
from jax_impl.codec_config import CODEC_PRESETS, CodecConfig
from jax_impl.parity import as_numpy

from .codec import MimiCodec
from .crosscheck import DTYPES, check_int, device_name, resolve_device
from .report import CrosscheckReport, TensorRecord

CODEC_CROSSCHECK_KERNELS = ("reference", "twin")
RESET_RATE = 0.05  # per step, the chance that one random row starts a fresh session on both sides
ACTIVE_RATE = 0.8  # per step and row, the chance that the row is active


class CodecCrosscheckReport(CrosscheckReport):
    """A `CrosscheckReport` of the codec, headed by the codec's geometry."""

    def header(self) -> str:
        c, t = self.config, self.config["transformer"]
        return (f"cross-check codec: {c['sample_rate']} Hz, {c['frame_size']}-sample frames, {c['n_filters']} "
                f"filters, dimension {c['dimension']}, transformers {t['num_layers']} layers / context "
                f"{t['context']}, {c['num_codebooks']} codebooks of {c['codebook_size']}, {self.dtype}, "
                f"B={self.batch}, kernels {self.kernels}, {self.steps} steps on {self.device}")


def default_codec_config(device: str) -> CodecConfig:
    """The real codec on a GPU; on the CPU `mimi-small` (the real 1,920-sample geometry, narrow)."""
    return CODEC_PRESETS["mimi" if device.startswith("cuda") else "mimi-small"]


def crosscheck_codec(*, steps: int = 20, batch: int = 4, dtype: str = "float32", config: CodecConfig | None = None,
                     checkpoint: str | None = None, device: str | None = None, seed: int = 0, recycle: bool = True,
                     threads: int | None = None, kernels: str = "reference", progress=None) -> CodecCrosscheckReport:
    """Run the torch codec and the JAX codec side by side for `steps` frames; the per-tensor report.

    config: a `CodecConfig` (default: `default_codec_config`). checkpoint: a Mimi safetensors file
    (`tokenizer-*.safetensors`, moshi's `MimiModel.state_dict()` names) for that config; else random
    weights from `seed`. recycle: a random `reset_slot` now and then (`RESET_RATE`). threads: torch's
    CPU threads for the run (None: 1 on the CPU; restored afterwards). kernels: "reference" (the
    torch reference codec, bit-exact with moshi, against the JAX codec: codes equal, PCM close) or
    "twin" (both on the twin kernels, Triton and Pallas: identical codes and PCM).
    progress: a callable wrapping the step range, or None. Every argument is checked before any
    work, ValueError / TypeError naming it.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if kernels not in CODEC_CROSSCHECK_KERNELS:
        raise ValueError(f"kernels must be one of {list(CODEC_CROSSCHECK_KERNELS)} for the codec, got {kernels!r}")
    steps, batch = check_int("steps", steps, 1), check_int("batch", batch, 1)
    seed = check_int("seed", seed, 0)
    threads = check_int("threads", threads, 1, allow_none=True)
    if not isinstance(recycle, bool):
        raise TypeError(f"recycle must be a bool, got {type(recycle).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable wrapping the step range, or None; got {progress!r}")
    if config is not None and not isinstance(config, CodecConfig):
        raise TypeError(f"config must be a CodecConfig, got {type(config).__name__}")
    device = resolve_device(device)
    config = config or default_codec_config(device)
    weights = None
    if checkpoint is not None:  # read (CheckpointError naming the path) before a codec is allocated
        weights = read_safetensors(checkpoint, read_safetensors_shapes(checkpoint), "pt", device="cpu")
    if threads is None and not device.startswith("cuda"):
        threads = 1
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(config, weights, checkpoint, steps=steps, batch=batch, dtype=dtype, device=device, seed=seed,
                    recycle=recycle, kernels=kernels, progress=progress)
    finally:
        torch.set_num_threads(saved_threads)


def _run(config, weights, checkpoint, *, steps, batch, dtype, device, seed, recycle, kernels,
         progress) -> CodecCrosscheckReport:
    codec = MimiCodec.from_config(config, dtype=DTYPES[dtype], device=device, kernels=kernels)
    if weights is not None:
        codec.load_weights(weights, source=checkpoint)
    else:
        codec.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    codec.streaming_init(batch)
    params = codec.jax_params()
    jax_device = params.codebooks.devices().pop()
    state = init_codec_state(config, batch, params.codebooks.dtype, device=jax_device)
    encode, decode = make_codec_step(config, kernels=kernels,
                                     rope_freqs=codec.rope_freqs() if kernels == "twin" else None)

    records = {name: TensorRecord(name) for name in ("codes", "pcm")}
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch_ms, jax_ms = [], []
    for step in range(steps) if progress is None else progress(range(steps)):
        if recycle and rng.random() < RESET_RATE:
            row = int(rng.integers(batch))
            codec.reset_slot(row)
            state = jit_codec_reset_slot(state, row)
        pcm = torch.randn(batch, 1, config.frame_size, generator=gen).to(device=device, dtype=DTYPES[dtype])
        active = torch.from_numpy(rng.random(batch) < ACTIVE_RATE).to(device)
        pcm_j, active_j = (jax.device_put(as_numpy(t.cpu()), jax_device) for t in (pcm, active))  # bf16 kept

        t0 = time.perf_counter()
        codes = codec.encode_frame(pcm, active)
        out = codec.decode_frame(codes, active)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        codes_j, state = encode(params, state, pcm_j, active_j)
        out_j, state = decode(params, state, jax.device_put(codes.cpu().numpy(), jax_device), active_j)
        jax.block_until_ready((codes_j, out_j, state))
        t2 = time.perf_counter()
        torch_ms.append(1e3 * (t1 - t0))
        jax_ms.append(1e3 * (t2 - t1))
        records["codes"].add(step, codes.cpu().numpy(), np.asarray(codes_j))
        records["pcm"].add(step, out.float().cpu().numpy() if dtype == "float32" else out.cpu(), np.asarray(out_j))
    cfg = dataclasses.asdict(config) | {"frame_size": config.frame_size}
    return CodecCrosscheckReport(stack="codec", config=cfg, dtype=dtype, batch=batch, frames=1, steps=steps,
                                 kernels=kernels, device=device_name(device), tensors=records, torch_ms=torch_ms,
                                 jax_ms=jax_ms)


__all__ = ["CODEC_CROSSCHECK_KERNELS", "CodecCrosscheckReport", "crosscheck_codec", "default_codec_config"]
