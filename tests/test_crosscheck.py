"""The cross-check tool (`torch_bridge.crosscheck`) and its command line."""

import json

import pytest

from torch_bridge.cli import main
from torch_bridge.crosscheck import crosscheck

INTEGER_TABLES = ("write_index", "positions", "mask", "offset", "start_offset")


@pytest.mark.parametrize("stack,dtype,convention", [("temporal", "float32", "personaplex"),
                                                     ("mimi-decoder", "bfloat16", "moshi")])
def test_report_integer_state_exact_and_float_distance_small(stack, dtype, convention):
    report = crosscheck(stack, steps=120, batch=3, dtype=dtype, convention=convention, seed=1)
    report.require(identical=INTEGER_TABLES, max_rel={"out": 1e-5} if dtype == "float32" else {"out": 0.05})
    with pytest.raises(AssertionError, match="out is not bit-identical"):
        report.require(identical=["out"])
    # float tensors: the report measures the distance; it must be small and located when non-zero
    bound = 2e-6 if dtype == "float32" else 0.05
    for name in ("out", "k", "v"):
        record = report.tensors[name]
        assert record.steps == 120 and record.max_abs <= bound, (name, record.max_abs)
        assert (record.first_diff is None) == record.identical
    assert report.tensors["cos"].max_ulp <= 1 and report.tensors["sin"].max_ulp <= 1
    text = report.summary()
    assert "positions     yes" in text and "ms/step (median)" in text


def test_report_detects_a_difference(monkeypatch):
    """An input scaled on the JAX side only must show up as a located difference."""
    import torch_bridge.crosscheck as cc

    original = cc.to_jax

    def scale_inputs(t, **kw):  # the per-step input x [B=2, T=2, dim=32] is the only 3-d tensor
        a = original(t, **kw)
        return a * 1.5 if a.ndim == 3 else a

    monkeypatch.setattr(cc, "to_jax", scale_inputs)
    bad = crosscheck("mimi-encoder", steps=5, batch=2, seed=2)
    assert not bad.identical("out") and bad.tensors["out"].max_abs > 1e-3
    assert bad.tensors["out"].first_diff[0] == 0


def test_cli_crosscheck_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["crosscheck", "--stack", "mimi-encoder", "--steps", "30", "--batch", "2", "-q",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text and "positions" in text
    report = json.loads(out_json.read_text())
    assert report["steps"] == 30 and report["tensors"]["positions"]["identical"] is True
    assert out_png.stat().st_size > 10_000


@pytest.mark.parametrize("argv,message", [
    (["crosscheck", "--checkpoint", "/no/such/file.safetensors"], "no such file"),
    (["crosscheck", "--plot", "out.pdf"], "expected a .png"),
])
def test_cli_bad_arguments_one_line_error(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("personaplex-jax: error:") and message in err and "\n" not in err


def test_cli_bad_checkpoint(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    assert main(["crosscheck", "--checkpoint", str(bad)]) == 1
    assert "not a readable safetensors file" in capsys.readouterr().err
    from jax_impl.config import PRESETS
    from torch_bridge import MimiTransformer

    small = tmp_path / "small.safetensors"
    MimiTransformer.from_config(PRESETS["mimi-small"]).save_safetensors(small, "encoder_transformer")
    assert main(["crosscheck", "--stack", "mimi-encoder", "--checkpoint", str(small)]) == 1  # full size
    err = capsys.readouterr().err.strip()
    assert "60 missing, 20 wrong shape" in err and "\n" not in err
    assert main(["crosscheck", "--stack", "mimi-encoder", "--size", "small", "--steps", "5", "-q",
                 "--checkpoint", str(small)]) == 0


def test_cli_usage_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--steps", "0"])
    assert e.value.code == 2
