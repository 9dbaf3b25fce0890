"""`personaplex-jax speak`: a WAV file through the JAX speech frame at 12.5 Hz, the model's reply out.

    result = speak("in.wav", "out.wav")                     # random weights: the reply is noise
    result = speak("in.wav", "out.wav", checkpoint_dir="personaplex-7b-v1/", preset="personaplex")

The input's RIFF chunks are read by `read_wav`: mono 16-bit PCM at the codec's rate (24 kHz in the
real sizes) is expected, anything else (or a malformed file) is refused naming the file and what it
holds (no resampling: nothing this package ships resamples exactly). The step takes PCM in the run's
dtype: in bfloat16 the 16-bit samples are rounded, and the run says how many that changed and by how
much at most (on the host, before streaming; nothing in float32). It is cut in frames of `frame_size`
samples (80 ms), the last one zero-padded (said when it is), and streamed one frame a step through
`jax_impl.speech_frame` (B = 1); the reply has one frame out per frame in, so as many samples as the
padded input, at the same rate, 16-bit (samples outside [-1, 1] clipped, and counted). The reply
starts `max_delay` frames late (the LM's delays: silence before, as moshi's serving loop).

Weights: random by default (the LM's N(0, 0.02), the codec's `init_weights`), and then the reply
is noise from random weights, which the run says. `checkpoint_dir`: the released files, the LM's
`model.safetensors` (Moshi layout) and the Mimi `tokenizer-*.safetensors`, checked against the
preset (`CheckpointError` listing every missing or misshaped tensor).
"""

from __future__ import annotations

import glob
import os
import struct
import time
import wave
from typing import NamedTuple

import numpy as np
import torch

from jax_impl.checkpoint import check_checkpoint, read_safetensors, read_safetensors_shapes
from jax_impl.speech_frame_config import SPEECH_PRESETS

from .crosscheck import default_preset, resolve_device
from .speech_frame import SpeechFrame

LM_FILE = "model.safetensors"
CODEC_GLOB = "tokenizer-*.safetensors"
RANDOM_NOTICE = ("note: random weights (no --checkpoint-dir): the output is noise from random weights, not a "
                 "model's speech")


class SpeakResult(NamedTuple):
    """frames: frames streamed; padded: zero samples added to the last one; rtf: compute time /
    audio time (frame 0, which compiles the step, left out); median_ms, p90_ms: per-frame latency
    (the same frames); compile_s: frame 0's time; clipped: reply samples outside [-1, 1]."""

    frames: int
    padded: int
    rtf: float
    median_ms: float
    p90_ms: float
    compile_s: float
    clipped: int


def read_wav(path: str, rate: int) -> np.ndarray:
    """The samples of a mono 16-bit PCM WAV at `rate` Hz as float32 [n] in [-1, 1); ValueError naming
    the file and what it holds otherwise. The RIFF chunks are walked here rather than by the standard
    library's `wave`, which stops at the first data chunk (a second one's samples would go unread) and
    raises a bare RuntimeError on a chunk past the file's end. A chunk is a 4-byte id, a little-endian
    uint32 size and that many bytes, an odd size followed by a pad byte the size does not count (one
    missing shifts every chunk after it, which then reads as garbage: a chunk past the end, or no data
    chunk; the last chunk's may be missing, nothing follows it). The walk ends at the RIFF chunk's
    declared end, or the file's where that is sooner (a streaming writer's 0xFFFFFFFF).
    Refused rather than read in part: a chunk past that end (the data chunk's: "truncated"), a second
    fmt or data chunk, a data chunk before the fmt chunk, a fmt chunk whose block size or byte rate
    disagrees with its channels, sample width and rate, a data chunk whose size is not a whole number
    of samples. Other chunks (LIST, junk, ...) are skipped."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 12:
        raise ValueError(f"--input {path}: not a PCM WAV file (it ends inside its header)")
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise ValueError(f"--input {path}: not a PCM WAV file (it starts {raw[:4]!r}...{raw[8:12]!r}, not "
                         f"b'RIFF'...b'WAVE')")
    end = min(8 + struct.unpack_from("<I", raw, 4)[0], len(raw))
    where = "file" if end == len(raw) else f"RIFF chunk (its size says {end - 8} bytes)"
    found = {}  # b"fmt " and b"data": (where its bytes start, its declared size)
    at, odd = 12, ""  # odd: the chunk before, where its size is odd (then its pad byte may be missing)
    while at < end:
        if end - at < 8:
            if b"data" not in found:
                raise ValueError(f"--input {path}: not a PCM WAV file (it ends inside its header)")
            raise ValueError(f"--input {path}: malformed: {end - at} bytes after its last chunk, too few for a "
                             f"chunk's 8-byte header")
        name, size = raw[at:at + 4], struct.unpack_from("<I", raw, at + 4)[0]
        if name in found:
            raise ValueError(f"--input {path}: malformed: a second {name.decode().strip()} chunk at byte {at} (a "
                             f"WAV file holds one)")
        if name == b"data" and b"fmt " not in found:
            raise ValueError(f"--input {path}: not a PCM WAV file (data chunk before fmt chunk)")
        if name in (b"fmt ", b"data"):
            found[name] = at + 8, size
        if at + 8 + size > end:
            if name == b"data":
                break  # truncated: said below, after what its fmt chunk holds
            raise ValueError(f"--input {path}: malformed: its {name.decode('latin-1')!r} chunk at byte {at} "
                             f"declares {size} bytes, {end - at - 8} follow it in the {where}" + (
                                 f" (the {odd} chunk before it has an odd size: without the pad byte RIFF "
                                 f"requires after it, every chunk after it is read a byte off)" if odd else ""))
        odd = repr(name.decode("latin-1")) if size % 2 else ""
        at += 8 + size + size % 2
    missing = [name.decode().strip() for name in (b"fmt ", b"data") if name not in found]
    if missing:
        raise ValueError(f"--input {path}: not a PCM WAV file (no {' and no '.join(missing)} chunk)")
    fmt_at, fmt_size = found[b"fmt "]
    if fmt_size < 16:
        raise ValueError(f"--input {path}: not a PCM WAV file (its fmt chunk holds {fmt_size} bytes, PCM's 16)")
    tag, channels, hz, byte_rate, block_align, bits = struct.unpack_from("<HHIIHH", raw, fmt_at)
    if tag != 1:  # 0xFFFE: WAVE_FORMAT_EXTENSIBLE, its sample format in a sub-header
        raise ValueError(f"--input {path}: not a PCM WAV file (format tag {tag}, PCM's is 1" + (
            "; a WAVE_FORMAT_EXTENSIBLE header: write it as plain PCM first, e.g. sox in.wav -e signed -b 16 out.wav"
            if tag == 0xFFFE else "") + ")")
    width = (bits + 7) // 8
    if (channels, width, hz) != (1, 2, rate):
        raise ValueError(f"--input {path}: expected mono 16-bit PCM at {rate} Hz, found {channels} channel(s), "
                         f"{8 * width}-bit, {hz} Hz (convert it first, e.g. sox in.wav -r {rate} -c 1 -b 16 "
                         f"out.wav)")
    if (block_align, byte_rate) != (2, 2 * rate):
        raise ValueError(f"--input {path}: malformed: its fmt chunk declares {block_align}-byte blocks at "
                         f"{byte_rate} bytes a second, not mono 16-bit PCM's at {rate} Hz (2-byte blocks at "
                         f"{2 * rate} bytes a second)")
    data_at, size = found[b"data"]
    if size % 2:
        raise ValueError(f"--input {path}: malformed: its data chunk declares {size} bytes, not a whole "
                         f"number of 2-byte samples (a RIFF pad byte after an odd-sized chunk is not counted in "
                         f"its size)")
    if not size:
        raise ValueError(f"--input {path}: no samples")
    if data_at + size > end:
        raise ValueError(f"--input {path}: truncated: its header says {size // 2} samples, it holds "
                         f"{end - data_at} bytes of them")
    return np.frombuffer(raw, "<i2", size // 2, data_at).astype(np.float32) / 32768.0


def write_wav(path: str, samples: np.ndarray, rate: int) -> int:
    """samples (float, [-1, 1]) as a mono 16-bit PCM WAV; returns how many were clipped to [-1, 1].
    Samples that are not finite have no 16-bit value: ValueError naming the file, nothing written."""
    bad = np.flatnonzero(~np.isfinite(samples))
    if bad.size:
        raise ValueError(f"--output {path}: {bad.size} samples of the reply are not finite (NaN or inf; the first "
                         f"at sample {bad[0]}): the model's output holds no sound there; nothing written")
    clipped = int(np.count_nonzero(np.abs(samples) > 1))
    ints = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(ints.tobytes())
    return clipped


def checkpoint_files(directory: str) -> tuple[str, str]:
    """(the LM file, the Mimi file) of a released checkpoint directory; ValueError naming what is missing."""
    if not os.path.isdir(directory):
        raise ValueError(f"--checkpoint-dir: no such directory: {directory}")
    lm = os.path.join(directory, LM_FILE)
    codec = sorted(glob.glob(os.path.join(directory, CODEC_GLOB)))
    missing = ([LM_FILE] if not os.path.isfile(lm) else []) + ([CODEC_GLOB] if not codec else [])
    if missing:
        raise ValueError(f"--checkpoint-dir {directory}: missing {' and '.join(missing)} (the LM's Moshi-layout "
                         f"weights and the Mimi codec's)")
    if len(codec) > 1:
        raise ValueError(f"--checkpoint-dir {directory}: several {CODEC_GLOB} files: {codec}; keep one")
    return lm, codec[0]


def speak(input_path: str, output_path: str, *, preset: str | None = None, checkpoint_dir: str | None = None,
          kernels: str = "reference", dtype: str | None = None, device: str | None = None, seed: int = 0,
          progress=None, say=print) -> SpeakResult:
    """Stream `input_path` through the JAX speech frame and write the reply to `output_path` (module
    docstring). preset: a `SPEECH_PRESETS` name (default: `crosscheck.default_preset`); kernels: "reference" or
    "twin"; dtype: "float32" or "bfloat16" (default: bfloat16 on a GPU, float32 on the CPU); device:
    torch's, where the weights live (JAX reads them in place); progress: wraps the frame range;
    say: prints the run's lines."""
    import jax

    from jax_impl import speech_frame as sf

    from .crosscheck import SEED_MAX, check_int

    seed = check_int("seed", seed, 0, maximum=SEED_MAX)
    device = resolve_device(device, "--device")
    preset = preset or default_preset(device)
    if preset not in SPEECH_PRESETS:
        raise ValueError(f"--preset must be one of {list(SPEECH_PRESETS)}, got {preset!r}")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    cfg = SPEECH_PRESETS[preset]
    files = checkpoint_files(checkpoint_dir) if checkpoint_dir else None
    if files:  # the temporal stack's shapes, from the header, before a model of the preset's size is made
        check_checkpoint(read_safetensors_shapes(files[0]), cfg.lm.temporal, source=files[0])
    samples = read_wav(input_path, cfg.codec.sample_rate)
    fs = cfg.frame_size
    frames = -(-samples.size // fs)
    padded = frames * fs - samples.size

    # the torch frame holds the weights (JAX reads them in place) and the RoPE tables; the JAX step
    # runs the frame on `kernels`
    frame = SpeechFrame.from_config(cfg, dtype=getattr(torch, dtype), device=device)
    if files:
        lm_file, codec_file = files
        frame.load_weights(read_safetensors(lm_file, read_safetensors_shapes(lm_file), "pt", device=device),
                           read_safetensors(codec_file, read_safetensors_shapes(codec_file), "pt", device=device),
                           lm_source=lm_file, codec_source=codec_file)
        say(f"weights: {lm_file}, {codec_file}")
    else:
        frame.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
        say(RANDOM_NOTICE)
    params = frame.jax_params()
    where = params.codec.codebooks.devices().pop()
    state = sf.init_speech_frame_state(cfg, 1, params.codec.codebooks.dtype, device=where)
    codec_freqs, lm_freqs = frame.rope_freqs()
    step = sf.make_speech_frame_step(cfg, kernels=kernels, codec_rope_freqs=codec_freqs, lm_rope_freqs=lm_freqs)
    say(f"{preset} ({dtype}, kernels {kernels}) on {where}: {input_path}, {samples.size} samples = {frames} frames "
        f"of {fs}" + (f" (the last zero-padded by {padded} samples)" if padded else ""))
    # the step takes PCM in the state's dtype: in bfloat16 the 16-bit samples are rounded, which is said
    change = np.abs(samples.astype(params.codec.codebooks.dtype).astype(np.float32) - samples)
    if change.any():
        say(f"input rounded to {dtype} (the step's PCM dtype): {np.count_nonzero(change)} of {samples.size} "
            f"samples changed, by at most {change.max():.3g} ({change.max() * 32768:.0f} 16-bit steps)")

    source = np.pad(samples, (0, padded)).reshape(frames, 1, 1, fs)
    reply = np.empty((frames, fs), np.float32)
    seconds = []
    for i in range(frames) if progress is None else progress(range(frames)):
        t0 = time.perf_counter()
        pcm = jax.device_put(source[i], where).astype(params.codec.codebooks.dtype)
        out, state = step(params, state, pcm)
        reply[i] = np.asarray(out.pcm[0, 0], np.float32)  # the host has the frame: its latency ends here
        seconds.append(time.perf_counter() - t0)
    clipped = write_wav(output_path, reply.reshape(-1), cfg.codec.sample_rate)
    timed = np.asarray(seconds[1:] or seconds) * 1e3
    rtf = float(timed.sum() / (len(timed) * 1e3 * fs / cfg.codec.sample_rate))
    result = SpeakResult(frames, padded, rtf, float(np.median(timed)), float(np.percentile(timed, 90)), seconds[0],
                         clipped)
    silent = min(cfg.max_delay, frames)
    say(f"reply: {output_path}, {frames * fs} samples at {cfg.codec.sample_rate} Hz (silent for the first "
        f"{silent} frame{'s' if silent != 1 else ''}: the LM's delays)"
        + (f"; {clipped} samples clipped to [-1, 1]" if clipped else ""))
    compile_note = (f"frame 0, {result.compile_s:.1f} s with the compile, left out" if frames > 1 else
                    "one frame: its time includes the compile")
    say(f"real-time factor {rtf:.3f} (compute / audio time); per-frame latency median {result.median_ms:.2f} ms, "
        f"p90 {result.p90_ms:.2f} ms ({compile_note})")
    return result


__all__ = ["RANDOM_NOTICE", "SpeakResult", "checkpoint_files", "read_wav", "speak", "write_wav"]
