"""The whole speech frame (codec encode -> LM frame -> codec decode): the JAX step and its torch twin
bit for bit on the twin kernels, the torch reference frame against moshi's `MimiModel` + `LMGen`
serving loop, inert and recycled rows, a NaN row kept to itself, bad input refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from jax_impl import speech_frame as sf
from jax_impl.speech_frame_config import SPEECH_PRESETS, SpeechFrameConfig
from tests.moshi_oracle import moshi_mimi
from tests.test_frame import moshi_lm
from torch_bridge.speech_frame import SpeechFrame

TINY = SPEECH_PRESETS["moshi-tiny"]


def random_frame(cfg, kernels="reference", seed=0) -> SpeechFrame:
    frame = SpeechFrame.from_config(cfg, kernels=kernels)
    frame.init_weights(lm_std=0.3, generator=torch.Generator().manual_seed(seed))
    return frame


def pcm_frames(cfg, n: int, batch: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, 1, cfg.frame_size)).astype(np.float32) for _ in range(n)]


def host_state(state) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in sf.speech_state_arrays(state).items()}


def row(name: str, x, b: int):
    return x[:, b] if name.endswith((".k", ".v")) else x[b]


def test_config_refuses_a_codec_that_does_not_fit_the_lm():
    small = SPEECH_PRESETS["moshi-small"]
    with pytest.raises(ValueError, match="codebook_size"):
        SpeechFrameConfig(TINY.codec, small.lm)
    lm = dataclasses.replace(small.lm, n_q=small.lm.n_q + 1, delays=(*small.lm.delays, 0))
    with pytest.raises(ValueError, match="user and model codebooks"):
        SpeechFrameConfig(small.codec, lm)
    assert SPEECH_PRESETS["moshi"].user_path == "user_tokens" and SPEECH_PRESETS["personaplex"].dep_q_exit == 8


@pytest.mark.parametrize("preset", ["moshi-tiny", "personaplex-tiny"])
def test_twin_speech_frame_jax_equals_torch_bit_for_bit(preset):
    """PCM, codes, tokens and every state tensor identical, frame by frame, with an idle row (row 1 at
    frame 1) and a recycled one (row 2 before frame 3); the model's PCM comes out of frames 2 and 3."""
    cfg, B = SPEECH_PRESETS[preset], 3
    frame = random_frame(cfg, "twin")
    codec_freqs, lm_freqs = frame.rope_freqs()
    step = sf.make_speech_frame_step(cfg, kernels="twin", codec_rope_freqs=codec_freqs, lm_rope_freqs=lm_freqs)
    params = frame.jax_params()
    state = sf.init_speech_frame_state(cfg, B)
    frame.streaming_init(B)
    ready = 0
    for t, pcm in enumerate(pcm_frames(cfg, 4, B)):
        if t == 3:
            frame.reset_slot(2)
            state = sf.jit_speech_reset_slot(state, 2)
        active = np.array([True, t != 1, True])
        ours = frame.step(torch.from_numpy(pcm), torch.from_numpy(active))
        theirs, state = step(params, state, pcm, active)
        for name in ours._fields:
            assert np.array_equal(getattr(ours, name).numpy(), np.asarray(getattr(theirs, name))), (name, t)
        for name, value in frame.state_arrays().items():
            assert np.array_equal(value.numpy(), np.asarray(sf.speech_state_arrays(state)[name])), (name, t)
        ready += int(ours.ready.sum())
    assert ready >= 4 and np.abs(np.asarray(theirs.pcm)).max() > 0  # the decoder ran: not a comparison of zeros


def test_reference_speech_frame_is_moshis_serving_loop():
    """moshi's `MimiModel` + `LMGen`, run as moshi's serving loop (encode, `LMGen.step`, decode the
    tokens it returns): the same codes, tokens and PCM bits, and the same frames without output."""
    cfg, B = TINY, 2
    mimi = moshi_mimi(cfg.codec)
    frame = SpeechFrame.from_config(cfg)
    frame.codec.load_weights(mimi.state_dict())
    frame.lm.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    lm, model = moshi_lm(cfg.lm, frame.lm)
    gen = lm.LMGen(model, use_sampling=False)
    frame.streaming_init(B)
    decoded = 0
    with torch.no_grad(), mimi.streaming(B), gen.streaming(B):
        for pcm in pcm_frames(cfg, 8, B):
            pcm = torch.from_numpy(pcm)
            out = frame.step(pcm)
            codes = mimi.encode(pcm)
            assert torch.equal(out.user_codes, codes[..., 0])
            tokens = gen.step(codes)
            assert bool(out.ready.any()) == (tokens is not None)
            if tokens is None:
                assert not out.pcm.any()
                continue
            assert torch.equal(out.tokens, tokens[..., 0])
            assert torch.equal(out.pcm, mimi.decode(tokens[:, 1:1 + cfg.num_codebooks]))
            decoded += 1
    assert decoded == 8 - cfg.max_delay


@pytest.fixture(scope="module")
def reference_step():
    """(params, the jitted JAX reference step) of TINY's random frame: one compile for the tests of
    the reference step, which step batches of 3 (the step is a pure function; each test makes its states)."""
    return random_frame(TINY).jax_params(), sf.make_speech_frame_step(TINY)


def test_inert_rows_nan_rows_and_recycling(reference_step):
    """JAX reference step: an inactive row's state does not move; a NaN / Inf row's PCM reaches no
    other row (outputs and states bit-identical to a run without it) and stays in its own row's
    state (until flushed or reset_slot), after which the row is a fresh state's row and steps as the clean run's."""
    cfg, B = TINY, 3
    params, step = reference_step
    clean, poisoned = sf.init_speech_frame_state(cfg, B), sf.init_speech_frame_state(cfg, B)
    fresh = host_state(sf.init_speech_frame_state(cfg, B))
    for t, pcm in enumerate(pcm_frames(cfg, 7, B)):
        if t == 5:
            clean, poisoned = sf.jit_speech_reset_slot(clean, 1), sf.jit_speech_reset_slot(poisoned, 1)
            for name, value in host_state(poisoned).items():
                assert np.array_equal(row(name, value, 1), row(name, fresh[name], 1)), name
        bad = pcm.copy()
        if t in (1, 2):
            bad[1, 0, 7] = np.nan if t == 1 else np.inf
        active = np.array([True, True, t != 3])
        before = host_state(clean)
        a, clean = step(params, clean, pcm, active)
        b, poisoned = step(params, poisoned, bad, active)
        if t == 3:  # row 2 idle: its whole state as it was, its outputs empty
            for name, value in host_state(clean).items():
                assert np.array_equal(row(name, value, 2), row(name, before[name], 2)), name
            assert not np.asarray(a.pcm)[2].any() and (np.asarray(a.tokens)[2] == -2).all()
        rows = [0, 2] if t < 5 else [0, 1, 2]
        for name in a._fields:
            assert np.array_equal(np.asarray(getattr(a, name))[rows], np.asarray(getattr(b, name))[rows]), (name, t)
        clean_rows, poisoned_rows = host_state(clean), host_state(poisoned)
        for name, value in poisoned_rows.items():
            for r in rows:
                assert np.array_equal(row(name, value, r), row(name, clean_rows[name], r)), (name, t)
        carried = [np.isfinite(row(n, v, 1)).all() for n, v in poisoned_rows.items() if n.startswith("codec.encoder")]
        if t in (1, 2, 3):  # the NaN / Inf in its own row's carries and ring (flushed by frame 4 in this size)
            assert not all(carried), t


def test_bad_input_is_refused_and_changes_nothing(reference_step):
    cfg, B = TINY, 3
    frame = random_frame(cfg)
    params, step = reference_step
    state = sf.init_speech_frame_state(cfg, B)
    pcm = pcm_frames(cfg, 1, B)[0]
    _, state = step(params, state, pcm)
    before = host_state(state)
    frame.streaming_init(B)
    for bad, match, error in ((pcm[:, :, :-1], "shape", ValueError), (pcm[:, 0], "rank 3", ValueError),
                              (pcm.astype(np.float64), "dtype float64", TypeError),
                              (pcm.astype(np.int16), "dtype int16", TypeError), ([[0.0]], "array", TypeError)):
        with pytest.raises(error, match=f"pcm.*{match}|{match}.*pcm"):
            step(params, state, bad)
        with pytest.raises(error, match=r"step\(pcm\): pcm"):  # the same type on the torch side
            frame.step(torch.as_tensor(np.asarray(bad)) if not isinstance(bad, list) else bad)
    # a row mask's dtype is a TypeError, its shape a ValueError, on both sides
    for bad, error in ((np.ones(B, np.int64), TypeError), (np.ones(B + 1, bool), ValueError)):
        with pytest.raises(error, match=r"step\(active\): active must"):
            step(params, state, pcm, bad)
        with pytest.raises(error, match=r"step\(active\): active must"):
            frame.step(torch.as_tensor(pcm), torch.as_tensor(bad))
    with pytest.raises(TypeError, match="pcm must be a JAX or numpy array"):
        step(params, state, torch.as_tensor(pcm))
    # sampling arguments the LM frame refuses are refused before the encoder's state moves
    for kwargs in ({"temperature": float("nan")}, {"temperature": 0.5},
                   {"text_temperature": 0.5, "seeds": torch.ones(B, dtype=torch.long, device="meta")}):
        with pytest.raises(ValueError, match="temperature|seeds"):
            frame.step(torch.as_tensor(pcm), **kwargs)
    with pytest.raises(IndexError, match="reset_slot"):
        sf.speech_reset_slot(state, -1)
    with pytest.raises(IndexError):
        sf.jit_speech_reset_slot(state, B)
    for name, value in host_state(state).items():
        assert np.array_equal(value, before[name]), name
    assert not frame.lm.frame_offset.any() and not frame.codec.state.first.logical_not().any()
    step(params, state, pcm)
    for call in (lambda: step(params, state, pcm), lambda: sf.jit_speech_reset_slot(state, 0)):
        with pytest.raises(ValueError, match="donated to an earlier call"):
            call()


def replaced(tree, path: list[str], value):
    """tree (nested NamedTuples) with the leaf at `path` (field names) replaced by value."""
    head, *rest = path
    return tree._replace(**{head: replaced(getattr(tree, head), rest, value) if rest else value})


def test_a_frame_past_the_offsets_dtype_is_refused_on_both_sides(reference_step):
    """Each offset a frame advances (the codec's transformers downsample_stride positions, the LM's 1),
    one frame below the index dtype's largest offset, steps; one more and the frame raises OverflowError
    naming it, its row and the recycling op, before anything runs: every state array bit-equal, nothing
    donated; the torch frame the same (its int64 offsets alone would go on)."""
    import jax

    from jax_impl.state import index_max

    cfg, B, top = TINY, 3, index_max()
    params, step = reference_step
    frame = random_frame(cfg)
    pcm = pcm_frames(cfg, 1, B)[0]
    T = cfg.codec.downsample_stride
    for name, moved in (("codec.encoder_transformer.offset", T), ("codec.decoder_transformer.offset", T),
                        ("lm.temporal.offset", 1), ("lm.frame_offset", 1)):
        for start in (top - moved, top - moved + 1):
            state = sf.init_speech_frame_state(cfg, B)
            values = np.array([0, start, 0], sf.speech_state_arrays(state)[name].dtype)
            state = replaced(state, name.split("."), jax.device_put(values, state.lm.frame_offset.sharding))
            frame.streaming_init(B)
            frame.state_arrays()[name].copy_(torch.from_numpy(values))
            if start + moved <= top:
                _, state = step(params, state, pcm)
                frame.step(torch.as_tensor(pcm))
                reached = start if "decoder" in name else top  # the decoder waits for the LM's delays
                assert host_state(state)[name][1] == int(frame.state_arrays()[name][1]) == reached, name
                continue
            before, before_torch = host_state(state), {k: v.clone() for k, v in frame.state_arrays().items()}
            message = rf"{name}\[1\] is {start}: {moved} more .* would pass {top}"
            with pytest.raises(OverflowError, match=rf"step\(state\): {message}.*jit_speech_reset_slot"):
                step(params, state, pcm)
            with pytest.raises(OverflowError, match=rf"step: {message}.*reset_slot"):
                frame.step(torch.as_tensor(pcm))
            assert not any(a.is_deleted() for a in jax.tree.leaves(state)), name
            assert all(np.array_equal(v, before[k]) for k, v in host_state(state).items()), name
            assert all(torch.equal(v, before_torch[k]) for k, v in frame.state_arrays().items()), name


def write_test_wav(path, samples: int, rate: int = 24000, channels: int = 1) -> None:
    import wave

    x = (0.3 * np.sin(np.arange(samples * channels) * 2 * np.pi * 220 / rate) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(x.tobytes())


def test_speak_cli_writes_the_reply(tmp_path, capsys, monkeypatch):
    """`speak` on the CPU: the reply has the padded input's length and rate, the random-weights notice,
    the real-time factor and latencies are printed; a WAV of another rate, a missing checkpoint file,
    are refused naming what they found."""
    import wave

    from torch_bridge.cli import main
    from torch_bridge.speak import RANDOM_NOTICE, write_wav

    src, out = tmp_path / "in.wav", tmp_path / "out.wav"
    fs = SPEECH_PRESETS["personaplex-small"].frame_size
    write_test_wav(src, 4 * fs + 100)
    assert main(["speak", "--input", str(src), "--output", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert RANDOM_NOTICE in printed and "zero-padded by 1820 samples" in printed
    assert "real-time factor" in printed and "median" in printed and "p90" in printed
    with wave.open(str(out)) as f:
        assert (f.getnframes(), f.getframerate(), f.getnchannels(), f.getsampwidth()) == (5 * fs, 24000, 1, 2)
        assert np.frombuffer(f.readframes(5 * fs), "<i2")[3 * fs:].any()  # the reply after the delays
    write_test_wav(src, fs, rate=16000)
    assert main(["speak", "--input", str(src), "--output", str(out), "-q"]) == 1
    assert "expected mono 16-bit PCM at 24000 Hz, found 1 channel(s), 16-bit, 16000 Hz" in capsys.readouterr().err
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["speak", "--input", str(src), "--output", str(out), "--checkpoint-dir", str(tmp_path)]) == 1
    assert "missing tokenizer-*.safetensors" in capsys.readouterr().err
    write_test_wav(src, fs)
    src.write_bytes(src.read_bytes()[:-3])  # a cut file: its header counts more samples than it holds
    assert main(["speak", "--input", str(src), "--output", str(out), "-q"]) == 1
    assert f"--input {src}: truncated: its header says {fs} samples" in capsys.readouterr().err
    src.write_bytes(b"")
    assert main(["speak", "--input", str(src), "--output", str(out), "-q"]) == 1
    assert f"--input {src}: not a PCM WAV file (it ends inside its header)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"2 samples of the reply are not finite \(NaN or inf; the first at sample 1\)"):
        write_wav(str(out), np.array([0.5, np.nan, np.inf], np.float32), 24000)
    with pytest.raises(SystemExit):
        main(["speak", "--input", str(src), "--output", str(out), "--seed", str(2**64)])
    assert "argument --seed: expected a 64-bit non-negative" in capsys.readouterr().err
    # another preset's files: refused from their headers, before a model of the preset's size is made
    from safetensors.torch import save_file

    from torch_bridge.frame import LMFrame

    small = LMFrame.from_config(SPEECH_PRESETS["personaplex-small"].lm)
    save_file({k: v.contiguous() for k, v in small.export_weights().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer-x.safetensors").write_bytes(b"")
    write_test_wav(src, fs)
    made = []
    monkeypatch.setattr(SpeechFrame, "from_config", lambda *a, **k: made.append(a) or pytest.fail("a model was made"))
    assert main(["speak", "--input", str(src), "--output", str(out), "--preset", "personaplex",
                 "--checkpoint-dir", str(tmp_path), "-q"]) == 1
    assert f"{tmp_path / 'model.safetensors'}" in capsys.readouterr().err and not made


def riff_wav(*chunks: tuple[bytes, bytes, int | None]) -> bytes:
    """A WAV file by hand: mono 16-bit PCM at 24 kHz, then `chunks` (id, bytes, declared size or None for
    their length), each odd-sized one followed by the pad byte RIFF requires and its size does not count."""
    import struct

    fmt = (b"fmt ", struct.pack("<HHIIHH", 1, 1, 24000, 48000, 2, 16), None)
    body = b"".join(name + struct.pack("<I", len(data) if size is None else size) + data + b"\0" * (len(data) % 2)
                    for name, data, size in (fmt, *chunks))
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body


def test_read_wav_skips_pad_bytes_and_refuses_half_a_sample(tmp_path, capsys):
    """RIFF pads an odd-sized chunk with a byte its size does not count: an odd LIST chunk before the
    data and an odd chunk after it are skipped, their pad bytes too, the samples read exactly. A data
    chunk of 5 bytes is 2.5 samples: refused naming the file and the size (it once lost its last byte
    silently), through the command line in one line, no reply written."""
    from torch_bridge.cli import main
    from torch_bridge.speak import read_wav

    src, out = tmp_path / "in.wav", tmp_path / "out.wav"
    samples = np.array([1, -2, 32767, -32768], "<i2")
    src.write_bytes(riff_wav((b"LIST", b"INFOx", None), (b"data", samples.tobytes(), None), (b"junk", b"abc", None)))
    assert np.array_equal(read_wav(str(src), 24000), samples / np.float32(32768))
    src.write_bytes(riff_wav((b"data", samples.tobytes() + b"\x07", None)))
    with pytest.raises(ValueError, match=f"--input {src}: malformed: its data chunk declares 9 bytes, not a whole "
                                         "number of 2-byte samples"):
        read_wav(str(src), 24000)
    src.write_bytes(riff_wav((b"data", b"\x07", None)))  # less than one sample
    assert main(["speak", "--input", str(src), "--output", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"personaplex-jax: error: --input {src}: malformed: its data chunk declares 1 bytes")
    assert err.count("\n") == 1 and not out.exists()


def test_read_wav_refuses_chunks_past_the_end_second_data_chunks_and_disagreeing_fmt(tmp_path, capsys):
    """Refused naming the file and what is wrong, through the command line in one line (a chunk past the
    file's end was once a bare RuntimeError's traceback), no reply written: a LIST chunk declaring more
    than the file holds; an odd LIST chunk without its pad byte (the data chunk after it read a byte off);
    a data chunk of 9 bytes cut to 8 (half a sample, once read as 4 samples); a second data chunk (once
    dropped); a fmt chunk whose block size or byte rate is not mono 16-bit PCM's at its rate (once
    ignored); bytes after the last chunk too few for a chunk. Kept readable: a RIFF size of 0xFFFFFFFF
    (a streaming writer's), an 18-byte fmt chunk, bytes after the RIFF chunk's declared end."""
    import struct

    from torch_bridge.cli import main
    from torch_bridge.speak import read_wav

    src, out = tmp_path / "in.wav", tmp_path / "out.wav"
    samples = np.array([1, -2, 32767, -32768], "<i2")
    s = samples.tobytes()
    no_pad = riff_wav((b"LIST", b"INFOx", None), (b"data", s, None))
    no_pad = no_pad.replace(b"INFOx\0", b"INFOx")  # the RIFF size, one byte more than the file: read to its end
    fmt = struct.pack("<IIH", 24000, 48000, 2)  # rate, byte rate, block size
    refused = {
        riff_wav((b"LIST", b"INFO", 100)): "malformed: its 'LIST' chunk at byte 36 declares 100 bytes, 4 follow it "
                                           "in the file",
        no_pad: "malformed: its 'ata\\x08' chunk at byte 50 declares 16777216 bytes, 7 follow it in the file (the "
                "'LIST' chunk before it has an odd size: without the pad byte RIFF requires",
        riff_wav((b"data", s, 9)): "malformed: its data chunk declares 9 bytes, not a whole number of 2-byte samples",
        riff_wav((b"data", s, None), (b"data", s, None)): "malformed: a second data chunk at byte 52",
        riff_wav((b"data", s, None)).replace(fmt, struct.pack("<IIH", 24000, 96000, 4)):
            "malformed: its fmt chunk declares 4-byte blocks at 96000 bytes a second, not mono 16-bit PCM's at "
            "24000 Hz (2-byte blocks at 48000 bytes a second)",
        riff_wav((b"data", s, None)).replace(fmt, struct.pack("<IIH", 24000, 24000, 2)):
            "malformed: its fmt chunk declares 2-byte blocks at 24000 bytes a second",
        riff_wav((b"data", s, 6)): "malformed: 2 bytes after its last chunk, too few for a chunk's 8-byte header",
    }
    for wav, message in refused.items():
        src.write_bytes(wav)
        with pytest.raises(ValueError) as err:
            read_wav(str(src), 24000)
        assert str(err.value).startswith(f"--input {src}: {message}"), str(err.value)
    src.write_bytes(riff_wav((b"LIST", b"INFO", 100)))
    assert main(["speak", "--input", str(src), "--output", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"personaplex-jax: error: --input {src}: malformed: its 'LIST' chunk")
    assert err.count("\n") == 1 and not out.exists()

    streamed = bytearray(riff_wav((b"data", s, None)))
    streamed[4:8] = struct.pack("<I", 0xFFFFFFFF)
    long_fmt = bytearray(riff_wav((b"data", s, None)).replace(b"fmt " + struct.pack("<I", 16), b"fmt " + struct.pack(
        "<I", 18)).replace(b"\x10\x00data", b"\x10\x00\x00\x00data"))  # cbSize 0 after the bits per sample
    long_fmt[4:8] = struct.pack("<I", len(long_fmt) - 8)
    for wav in (bytes(streamed), bytes(long_fmt), riff_wav((b"data", s, None)) + b"\x01\x02\x03"):
        src.write_bytes(wav)
        assert np.array_equal(read_wav(str(src), 24000), samples / np.float32(32768))


def test_speak_says_how_bfloat16_rounds_the_input(tmp_path):
    """The step takes PCM in the run's dtype: a bfloat16 run rounds the 16-bit input and says, once, how
    many samples that changed and by how much at most (counted here by torch's rounding); a float32 run
    changes nothing and says nothing of it."""
    import wave

    from torch_bridge.speak import speak

    cfg = SPEECH_PRESETS["personaplex-tiny"]
    x = np.random.default_rng(0).integers(-32768, 32768, 2 * cfg.frame_size + 5).astype("<i2")
    x[:7] = [0, 1, -255, 256, 32767, -32768, 12345]  # bfloat16 holds 0 to 256 and -1.0; 32767 becomes 1.0
    src, out = tmp_path / "in.wav", tmp_path / "out.wav"
    with wave.open(str(src), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(cfg.codec.sample_rate)
        f.writeframes(x.tobytes())
    exact = torch.from_numpy(x.astype(np.float32) / 32768)
    change = (exact.to(torch.bfloat16).float() - exact).abs()
    changed, steps = int(change.count_nonzero()), round(float(change.max()) * 32768)
    assert 0 < changed < x.size
    said = (f"input rounded to bfloat16 (the step's PCM dtype): {changed} of {x.size} samples changed, by at most "
            f"{float(change.max()):.3g} ({steps} 16-bit steps)")
    for dtype, expected in (("bfloat16", [said]), ("float32", [])):
        lines = []
        speak(str(src), str(out), preset="personaplex-tiny", dtype=dtype, device="cpu", say=lines.append)
        assert [line for line in lines if "rounded" in line] == expected, lines


def test_speak_cli_counts_every_problem_of_a_grouped_checkpoint_error(tmp_path, capsys):
    """The one-line form of a loader's multi-line error counts its problems: a temporal checkpoint of 12
    problems, summarized a kind a line with advice after them, says 10 missing and 2 wrong shape; a
    codec file refused by three checks (its convolutions and two transformers, a head each) says 3
    missing and 3 wrong shape and names the three parts (the heads and summaries were once counted as
    problems of kinds of their own)."""
    from safetensors.torch import save_file

    from torch_bridge.cli import main
    from torch_bridge.frame import LMFrame

    cfg = SPEECH_PRESETS["personaplex-small"]
    src, out, lm, codec = (tmp_path / n for n in ("in.wav", "out.wav", "model.safetensors", "tokenizer-x.safetensors"))
    write_test_wav(src, cfg.frame_size)
    good = {k: v.contiguous() for k, v in LMFrame.from_config(cfg.lm).export_weights().items()}
    temporal = sorted(k for k in good if k.startswith("transformer."))
    bad = {k: v for k, v in good.items() if k not in temporal[:10]}
    bad.update({k: torch.zeros(3, 3) for k in temporal[10:12]})
    save_file(bad, str(lm))
    save_file({k: v.contiguous() for k, v in moshi_mimi(cfg.codec).state_dict().items()}, str(codec))
    argv = ["speak", "--input", str(src), "--output", str(out), "--checkpoint-dir", str(tmp_path), "-q"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{lm} does not fit TemporalConfig" in err
    assert ": 12 problems (every one in this error's .problems): 10 missing, 2 wrong shape (first: missing: " in err

    save_file(good, str(lm))
    weights = {k: v.contiguous() for k, v in moshi_mimi(cfg.codec).state_dict().items()}
    for part in ("decoder.model.0.conv.conv", "encoder_transformer.transformer.layers.0.linear1",
                 "decoder_transformer.transformer.layers.1.linear2"):
        del weights[f"{part}.bias" if part.startswith("decoder.") else f"{part}.weight"]
    for key in ("encoder.model.0.conv.conv.weight", "encoder_transformer.transformer.layers.0.linear2.weight",
                "decoder_transformer.transformer.layers.0.linear1.weight"):
        weights[key] = torch.zeros(3, 3)
    save_file(weights, str(codec))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count(f"{codec} does not fit") == 3
    assert err.endswith("prefix 'decoder_transformer.': 3 missing, 3 wrong shape "
                        "(first: missing: decoder.model.0.conv.conv.bias)\n")
    assert not out.exists()


def test_crosscheck_speech_frame_cli(capsys):
    from torch_bridge.cli import main

    assert main(["crosscheck", "--stack", "speech-frame", "--steps", "4", "--batch", "2", "--require", "close",
                 "-q"]) == 0
    printed = capsys.readouterr().out
    assert "cross-check speech-frame: personaplex-small" in printed and "tokens        yes" in printed
    assert main(["crosscheck", "--stack", "speech-frame", "--convention", "moshi"]) == 1
    assert "--convention: not taken by --stack speech-frame" in capsys.readouterr().err


# ------------------------------------------------------------------------------ construction-time refusals
def test_twin_speech_frames_refuse_a_codec_head_dim_not_a_power_of_two_when_made():
    """SpeechFrame and make_speech_frame_step refuse kernels="twin" on a codec transformer of head dim 12
    up front, naming the stack by its path and its head dim; the reference kernels take it."""
    from jax_impl.codec_config import with_codec_options

    codec = with_codec_options(TINY.codec, dimension=24, transformer=dataclasses.replace(TINY.codec.transformer,
                                                                                         dim=24))
    cfg = SpeechFrameConfig(codec, TINY.lm)
    for where, make in (("SpeechFrame", lambda k: SpeechFrame.from_config(cfg, kernels=k)),
                        ("make_speech_frame_step", lambda k: sf.make_speech_frame_step(cfg, kernels=k))):
        with pytest.raises(ValueError, match=rf"^{where}\(kernels\): kernels='twin' needs power-of-two head dims "
                                             rf"\(.*\); the codec\.transformer stack's is 12 \(head_dim = dim 24 // "
                                             rf"num_heads 2\)"):
            make("twin")
        make("reference")

