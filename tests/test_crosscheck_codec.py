"""The codec's cross-check (`torch_bridge.crosscheck_codec`) and `crosscheck --stack codec`."""

import json

import jax.numpy as jnp
import pytest

import jax_impl as jx
import torch_bridge.crosscheck_codec as ccc
from jax_impl.codec import make_codec_step
from torch_bridge.cli import main
from torch_bridge.crosscheck_codec import crosscheck_codec

TINY = jx.CODEC_PRESETS["mimi-tiny"]


def test_codes_identical_and_pcm_close_with_recycling(monkeypatch):
    monkeypatch.setattr(ccc, "RESET_RATE", 0.5)  # a few reset_slots in a short run
    report = crosscheck_codec(steps=8, batch=3, config=TINY, seed=3)
    report.require(identical=["codes"], max_rel={"pcm": 2e-6}, level="close")
    pcm = report.tensors["pcm"]
    assert report.tensors["codes"].steps == pcm.steps == 8 and pcm.dtype == "float32"
    assert 0 < pcm.max_rel <= 2e-6 and not report.holds("identical")  # reference kernels: close, not equal
    text = report.summary()
    assert text.startswith("cross-check codec: 400 Hz, 32-sample frames, 4 filters, dimension 16")
    assert "kernels reference" in text and "codes         yes" in text


def test_twin_kernels_identical():
    """kernels="twin" reaches both codecs: every tensor bit-identical over 2 frames (the state carried
    from one to the next). One row: the twin codec's rows and recycling, tests/test_codec_twin.py."""
    from tests.test_codec_twin import CFG

    report = crosscheck_codec(steps=2, batch=1, config=CFG, kernels="twin", recycle=False)
    report.require(level="identical")
    assert "kernels twin" in report.summary() and report.verdict() == "verdict: every tensor bit-identical at every step"


def test_a_differing_code_is_reported(monkeypatch):
    encode, decode = make_codec_step(TINY)

    def off_by_one(params, state, pcm, active=None):
        codes, state = encode(params, state, pcm, active)
        return jnp.where(jnp.arange(codes.shape[0])[:, None] == 1, (codes + 1) % TINY.codebook_size, codes), state

    monkeypatch.setattr(ccc, "make_codec_step", lambda cfg, **_: (off_by_one, decode))
    report = crosscheck_codec(steps=3, batch=3, config=TINY, recycle=False)
    codes = report.tensors["codes"]
    assert not codes.identical and codes.first_diff[1][0] == 1 and not report.holds("close")
    assert report.verdict().startswith("verdict: NOT close: codes differs at")


def test_cli_stack_codec(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    assert main(["crosscheck", "--stack", "codec", "--steps", "3", "--batch", "3", "-q", "--require", "close",
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "cross-check codec: 24000 Hz, 1920-sample frames" in text and "kernels reference" in text
    report = json.loads(out_json.read_text())
    assert report["stack"] == "codec" and report["steps"] == 3 and report["holds"]["close"] is True
    assert report["tensors"]["codes"]["identical"] is True and set(report["tensors"]) == {"codes", "pcm"}
    assert main(["crosscheck", "--stack", "codec", "--steps", "2", "--batch", "3", "-q",
                 "--require", "identical"]) == 3


@pytest.mark.parametrize("argv,message", [
    (["--convention", "moshi"], "--convention: does not apply to --stack codec"),
    (["--frames", "2"], "--frames: does not apply"),
    (["--num-heads", "4"], "--num-heads: does not apply"),
    (["--config", "c.json"], "--config: does not apply"),
])
def test_cli_stack_codec_bad_arguments(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(ccc, "_run", _must_not_run)
    assert main(["crosscheck", "--stack", "codec", "-q", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("personaplex-jax: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("kwargs,error,message", [
    ({"steps": 0}, ValueError, "steps must be positive"),
    ({"batch": 2.0}, TypeError, "batch must be an int"),
    ({"dtype": "float16"}, ValueError, "dtype must be one of"),
    ({"config": jx.PRESETS["mimi-small"]}, TypeError, "config must be a CodecConfig"),
    ({"recycle": 1}, TypeError, "recycle must be a bool"),
    ({"kernels": "pallas"}, ValueError, "kernels must be one of"),
])
def test_arguments_checked_up_front(kwargs, error, message, monkeypatch):
    monkeypatch.setattr(ccc, "_run", _must_not_run)
    with pytest.raises(error, match=message):
        crosscheck_codec(**kwargs)


def _must_not_run(*args, **kwargs):
    raise AssertionError("the run started although an argument is bad")
