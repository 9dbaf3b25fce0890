"""The cross-check tool (`torch_bridge.crosscheck`) and its command line."""

import json
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

import torch_bridge.crosscheck as cc
import torch_bridge.report as rp
from jax_impl.checkpoint import CheckpointError
from jax_impl.config import PRESETS
from torch_bridge.cli import main
from torch_bridge.crosscheck import crosscheck
from torch_bridge.report import CrosscheckReport, TensorRecord

INTEGER_TABLES = ("write_index", "positions", "mask", "end_offset", "offset", "start_offset")


@pytest.mark.parametrize("stack,dtype,convention", [("temporal", "float32", "personaplex"),
                                                     ("mimi-decoder", "bfloat16", "moshi")])
def test_report_integer_state_exact_and_float_distance_small(stack, dtype, convention):
    report = crosscheck(stack, steps=60, batch=3, dtype=dtype, convention=convention, seed=1)
    report.require(identical=INTEGER_TABLES, max_rel={"out": 1e-5} if dtype == "float32" else {"out": 0.05})
    with pytest.raises(AssertionError, match="out is not bit-identical"):
        report.require(identical=["out"])
    # float tensors: the report measures the distance; it must be small and located when non-zero
    bound = 2e-6 if dtype == "float32" else 0.05
    for name in ("out", "k", "v"):
        record = report.tensors[name]
        assert record.steps == 60 and record.max_abs <= bound, (name, record.max_abs)
        assert (record.first_diff is None) == record.identical
        # per step: 0 exactly where the step is bit-identical, and the run's max is the max of the steps
        rel, ulp = np.asarray(record.per_step_rel), np.asarray(record.per_step_ulp)
        assert len(rel) == 60 and ((rel == 0) == (ulp == 0)).all() and rel.max() == record.max_rel
    assert report.tensors["cos"].max_ulp <= 1 and report.tensors["sin"].max_ulp <= 1
    assert report.holds("close") and not report.holds("identical")
    text = report.summary()
    assert "positions     yes" in text and "ms/step (median, step 0's compile left out)" in text
    verdict = text.splitlines()[-1]
    assert verdict == report.verdict() and verdict.startswith("verdict: close: integer state identical")
    worst = max((r for r in report.tensors.values() if r.dtype == "float32"), key=lambda r: r.max_rel)
    assert f"{worst.max_rel:.2g} (float32, worst {worst.name}; bound 1e-05)" in verdict
    if stack == "temporal":  # greedy tokens: B * T = 3 per step, equal but at near ties
        a = report.argmax
        assert a.steps == 60 and a.tokens_per_step == 3 and a.unexplained == 0
        assert a.agree >= 180 - a.near_ties and "greedy tokens (argmax text_logits)" in text
        report.require(greedy=True)
    else:
        assert report.argmax is None and "greedy" not in text


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
    assert not bad.holds("close") and bad.verdict().startswith("verdict: NOT close: out: max rel")
    assert bad.tensors["out"].per_step_rel[0] > 0.1


def test_cli_crosscheck_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["crosscheck", "--stack", "mimi-encoder", "--steps", "30", "--batch", "2", "-q", "--kernels",
               "reference", "--json", str(out_json), "--plot", str(out_png), "--require", "close"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text and "positions" in text and "\nverdict: close: " in text
    report = json.loads(out_json.read_text())
    assert report["steps"] == 30 and report["tensors"]["positions"]["identical"] is True
    assert report["holds"] == {"identical": False, "close": True} and report["verdict"] in text
    assert report["close_bounds"] == {"float32": 1e-5}
    for r in report["tensors"].values():  # per step: ULPs and the relative error, side by side
        assert len(r["per_step_rel"]) == len(r["per_step_ulp"]) == 30
        assert max(r["per_step_rel"]) == r["max_rel"] and (r["max_rel"] > 0) == (r["max_ulp"] > 0)
    assert report["device"] == "CPU (cpu, 1 torch thread)"  # small preset: single-threaded by default
    assert out_png.stat().st_size > 10_000


def test_cli_require_identical_fails_with_status_3(capsys):
    assert main(["crosscheck", "--stack", "mimi-encoder", "--steps", "3", "--batch", "2", "-q",
                 "--kernels", "reference", "--require", "identical"]) == 3
    captured = capsys.readouterr()
    assert "verdict: close: " in captured.out  # the run is close, not identical
    err = captured.err.strip()
    assert err.startswith("personaplex-jax: --require identical does not hold: ") and "\n" not in err
    assert "k differs at 3/3 steps (first: step 0)" in err


def test_cli_default_runs_the_twins(monkeypatch):
    """The main job's default: the temporal stack on the twin kernels (the whole run is `bash run.sh
    main`; the twin step's bits over wraps and recycling: tests/test_twin.py; a twin run through the
    command line, its verdict and JSON: tests/test_frame_twin.py)."""
    calls = []

    def record(stack, **kwargs):
        calls.append((stack, kwargs["kernels"]))
        raise ValueError("recorded")  # main's one-line error: nothing runs

    monkeypatch.setattr(cc, "crosscheck", record)
    assert main(["crosscheck", "-q"]) == 1
    assert calls == [("temporal", "twin")]


@pytest.mark.parametrize("argv,message", [
    (["crosscheck", "--checkpoint", "/no/such/file.safetensors"], "no such file"),
    (["crosscheck", "--plot", "out.pdf"], "expected a .png"),
    (["crosscheck", "--device", "tpu"], "--device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["crosscheck", "--device", "cuda:x"], "--device: expected"),
    (["crosscheck", "--json", "/no/such/dir/r.json"], "--json: cannot write /no/such/dir/r.json: directory"),
    (["crosscheck", "--plot", "/no/such/dir/r.png"], "--plot: cannot write /no/such/dir/r.png: directory"),
    (["crosscheck", "--json", "/"], "--json: / is a directory"),
])
def test_cli_bad_arguments_one_line_error(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cc, "crosscheck", _must_not_run)  # refused up front, before any work
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("personaplex-jax: error:") and message in err and "\n" not in err


def _must_not_run(*args, **kwargs):
    raise AssertionError("the run started although an argument is bad")


def test_cli_plot_without_matplotlib_fails_before_the_run(tmp_path, capsys, monkeypatch):
    """matplotlib is the `plot` extra (declared in pyproject.toml): without it --plot is refused up
    front, saying how to install it, and nothing is written."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert any(req.startswith("matplotlib") for req in pyproject["project"]["optional-dependencies"]["plot"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(cc, "crosscheck", _must_not_run)
    assert main(["crosscheck", "--plot", str(tmp_path / "r.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("personaplex-jax: error: --plot: matplotlib is not installed; "
                   "pip install -e '.[plot]' (or drop --plot)")
    assert not list(tmp_path.iterdir())


def test_cli_config_not_utf8_names_the_file(tmp_path, capsys, monkeypatch):
    config = tmp_path / "c.json"
    config.write_bytes(b'{"context": 12, "note": "\xff"}')
    monkeypatch.setattr(cc, "crosscheck", _must_not_run)
    assert main(["crosscheck", "--config", str(config)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"personaplex-jax: error: --config {config}: not UTF-8 text (JSON is): byte 0xff at offset 25"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build without CUDA")
def test_cli_device_cuda_without_cuda_one_line_error(capsys, monkeypatch):
    monkeypatch.setattr(cc, "crosscheck", _must_not_run)
    assert main(["crosscheck", "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("personaplex-jax: error: --device 'cuda': this torch build sees no CUDA GPU "
                   "(torch.cuda.is_available() is False); use cpu")


def test_cli_bad_checkpoint(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    assert main(["crosscheck", "--checkpoint", str(bad)]) == 1
    assert "not a readable safetensors file" in capsys.readouterr().err
    from jax_impl.config import PRESETS
    from torch_bridge import MimiTransformer

    small = tmp_path / "small.safetensors"
    MimiTransformer.from_config(PRESETS["mimi-small"]).save_safetensors(small, "encoder_transformer")
    assert main(["crosscheck", "--stack", "mimi-encoder", "--checkpoint", str(small)]) == 1  # full preset
    err = capsys.readouterr().err.strip()
    assert "--num-heads: required" in err and "has dim 32" in err and "\n" not in err
    assert main(["crosscheck", "--stack", "mimi-encoder", "--size", "small", "--steps", "5", "-q",
                 "--kernels", "reference", "--checkpoint", str(small)]) == 0


@pytest.mark.parametrize("argv", [["crosscheck"], ["crosscheck", "--stack", "mimi-encoder"],
                                  ["crosscheck", "--stack", "codec"], ["crosscheck", "--stack", "depformer"],
                                  ["crosscheck", "--stack", "frame"], ["crosscheck", "--stack", "speech-frame"],
                                  ["stream"]])
def test_cli_batch_that_cannot_fit_one_line_error(argv, capsys, monkeypatch):
    """--batch 10**9 once reached torch's allocator (a traceback of a 12 TB ring): refused before
    anything is allocated, naming --batch and how many rows the device's memory could hold."""
    import torch_bridge.crosscheck_codec as ccc
    import torch_bridge.crosscheck_lm as ccl
    import torch_bridge.crosscheck_speech as ccs

    for module, name in ((cc, "crosscheck"), (ccc, "crosscheck_codec"), (ccl, "crosscheck_lm"),
                         (ccs, "crosscheck_speech_frame")):
        monkeypatch.setattr(module, name, _must_not_run)
    assert main([*argv, "--batch", str(10**9)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("personaplex-jax: error: --batch: expected at most ") and "\n" not in err
    assert "rows on cpu, got 1000000000: a row takes at least " in err and "GiB of memory" in err


def test_cli_batch_bound_is_the_memory_over_a_rows_state(capsys, monkeypatch):
    """The bound is exact: a row of the temporal run holds its state twice (torch's and JAX's, the
    JAX state's bytes counted for both), and a device of 10 rows' bytes takes --batch 10, not 11."""
    import jax

    from jax_impl.state import init_state
    from torch_bridge import cli

    row = 2 * sum(x.nbytes for x in jax.tree.leaves(init_state(PRESETS["temporal-small"], 1)))
    monkeypatch.setattr(cli, "_device_memory", lambda device: 10 * row)
    ran = []

    def record(stack, **kwargs):
        ran.append(kwargs["batch"])
        raise ValueError("recorded")  # main's one-line error: nothing runs

    monkeypatch.setattr(cc, "crosscheck", record)
    assert main(["crosscheck", "--batch", "10", "-q"]) == 1 and ran == [10]
    assert capsys.readouterr().err.strip() == "personaplex-jax: error: recorded"
    assert main(["crosscheck", "--batch", "11", "-q"]) == 1 and ran == [10]
    assert capsys.readouterr().err.strip() == (
        f"personaplex-jax: error: --batch: expected at most 10 rows on cpu, got 11: a row takes at least {row:,} "
        f"bytes (its streaming state, torch's and JAX's), {11 * row / 2**30:,.1f} GiB in all, more than its "
        f"{10 * row / 2**30:,.1f} GiB of memory")


@pytest.mark.parametrize("argv,flag", [(["--steps", "0"], "--steps"), (["--seed", "-1"], "--seed"),
                                       (["--threads", "0"], "--threads"), (["--require", "exact"], "--require")])
def test_cli_usage_errors_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", *argv])
    assert e.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize("error,caught", [(ValueError("bad value"), True), (CheckpointError("bad file"), True),
                                          (FileNotFoundError(2, "No such file"), True),
                                          (TypeError("a bug"), False), (KeyError("a bug"), False),
                                          (RuntimeError("a bug"), False), (AttributeError("a bug"), False)])
def test_cli_catches_only_what_a_user_causes(error, caught, monkeypatch, capsys):
    """Bad input and files become one line; a programming bug keeps its traceback."""
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(cc, "crosscheck", fail)
    if caught:
        assert main(["crosscheck", "-q"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("personaplex-jax: error: ") and "\n" not in err
    else:
        with pytest.raises(type(error)):
            main(["crosscheck", "-q"])


@pytest.mark.parametrize("kwargs,error,message", [
    ({"frames": -1}, ValueError, "frames must be positive, got -1"),
    ({"frames": 0}, ValueError, "frames must be positive, got 0"),
    ({"frames": 11}, ValueError, "frames must be at most the ring's capacity (10), got 11"),
    ({"frames": 2.0}, TypeError, "frames must be an int or None"),
    ({"steps": True}, TypeError, "steps must be an int, got bool"),
    ({"steps": 0}, ValueError, "steps must be positive"),
    ({"batch": -2}, ValueError, "batch must be positive"),
    ({"batch": False}, TypeError, "batch must be an int"),
    ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"threads": 0}, ValueError, "threads must be positive"),
    ({"device": "tpu"}, ValueError, "device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ({"device": 0}, TypeError, "device must be a str"),
    ({"dtype": "float16"}, ValueError, "dtype must be one of"),
    ({"convention": "kyutai"}, ValueError, "convention must be one of"),
    ({"layer_loop": "vmap"}, ValueError, "layer_loop must be one of"),
    ({"recycle": 1}, TypeError, "recycle must be a bool"),
    ({"progress": "tqdm"}, TypeError, "progress must be a callable"),
    ({"config": PRESETS["temporal-small"]}, ValueError, "does not fit stack 'mimi-encoder'"),
])
def test_crosscheck_arguments_checked_up_front(kwargs, error, message, monkeypatch):
    monkeypatch.setattr(cc, "_run", _must_not_run)
    with pytest.raises(error) as e:
        crosscheck("mimi-encoder", **kwargs)
    assert message in str(e.value)


def test_crosscheck_threads_small_presets_single_threaded_and_restored(monkeypatch):
    seen = []

    def record(*args, **kwargs):  # the run itself, stubbed: only the thread setting matters here
        seen.append(torch.get_num_threads())

    monkeypatch.setattr(cc, "_run", record)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        crosscheck("mimi-encoder")  # small preset on the CPU: 1 thread
        crosscheck("mimi-encoder", threads=2)
        crosscheck("mimi-encoder", config=PRESETS["mimi"], device="cpu")  # real size: torch's default
        assert seen == [1, 2, 2] and torch.get_num_threads() == 2  # restored after each
    finally:
        torch.set_num_threads(before)
    assert cc.default_threads(PRESETS["mimi-small"], "cpu") == 1
    assert cc.default_threads(PRESETS["temporal"], "cpu") is None
    assert cc.default_threads(PRESETS["mimi-small"], "cuda") is None


def _report(**pairs) -> CrosscheckReport:
    """A report of one step from (torch, jax) numpy pairs."""
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[name] = TensorRecord(name)
        tensors[name].add(0, np.asarray(a), np.asarray(b))
    return CrosscheckReport(stack="mimi-encoder", config=asdict(PRESETS["mimi-small"]), dtype="float32", batch=1,
                            frames=1, steps=1,
                            device="cpu", tensors=tensors, torch_ms=[1.0], jax_ms=[1.0])


def test_verdict_and_levels():
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    pos = np.arange(4)
    same = _report(out=(x, x.copy()), positions=(pos, pos.copy()))
    assert same.holds("identical") and same.verdict() == "verdict: every tensor bit-identical at every step"
    near = _report(out=(x, x + np.float32(2e-6)), positions=(pos, pos.copy()))
    assert near.holds("close") and not near.holds("identical")
    assert near.failures("identical") == ["out differs at 1/1 steps (first: step 0)"]
    assert near.verdict().startswith("verdict: close: integer state identical at every step; floats within "
                                     "max rel 2e-06 (float32, worst out; bound 1e-05)")
    far = _report(out=(x, x + np.float32(2e-5)), positions=(pos, pos.copy()))
    assert far.failures("close") == ["out: max rel 2e-05 > 1e-05 (float32)"]
    ints = _report(out=(x, x.copy()), positions=(pos, pos + 1))
    assert ints.verdict() == "verdict: NOT close: positions differs at 1/1 steps (first: step 0)"
    with pytest.raises(ValueError, match="level must be one of"):
        near.holds("exact")
    with pytest.raises(AssertionError, match="out: max rel 2e-05 > 1e-05"):
        far.require(level="close")
    with pytest.raises(ValueError, match=r"require: no tensor \['logits'\]"):
        near.require(identical=["logits"])
    with pytest.raises(ValueError, match="has no text_logits"):
        near.require(greedy=True)


def test_values_that_are_not_finite_on_one_side_are_not_close(tmp_path):
    """A NaN or inf where the other side has a number (or an inf of the other sign) has no distance:
    max rel inf, `close` fails; NaN against NaN agrees in value. The JSON stays strict."""
    x = np.ones(4, np.float32)
    for a, b in ((x, np.float32([np.nan, 1, 1, 1])), (np.float32([np.nan, 1, 1, 1]), np.float32([np.nan, 2, 1, 1])),
                 (np.float32([np.inf, 1, 1, 1]), np.float32([np.inf, 100, 1, 1])),
                 (np.float32([np.inf, 1, 1, 1]), np.float32([-np.inf, 1, 1, 1]))):
        report = _report(out=(a, b))
        if np.isnan(a[0]) and np.isnan(b[0]):
            assert report.tensors["out"].max_rel == 1.0  # the finite difference, scaled by the finite values
        elif np.isinf(a[0]) and np.isinf(b[0]) and a[0] == b[0]:
            assert report.tensors["out"].max_rel == 99.0
        else:
            assert report.tensors["out"].max_rel == float("inf")
        assert not report.holds("close"), (a, b)
        report.write_json(tmp_path / "r.json")

        def refuse(name):
            raise ValueError(f"non-standard JSON: {name}")

        json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    nan_both = _report(out=(np.float32([np.nan, 1]), np.float32([np.nan, 1])))
    assert nan_both.holds("identical")


def test_argmax_record_counts_near_ties_and_fails_real_differences():
    record = rp.ArgmaxRecord("text_logits", tie_tol=1e-4)
    torch_logits = np.array([[1.0, 0.99999, -1.0], [1.0, 0.5, -1.0]], np.float32)  # row 0: a near tie
    record.add(0, torch_logits, torch_logits[:, [1, 0, 2]])  # both rows' argmax flipped
    assert record.per_step_agree == [0] and record.near_ties == 1 and record.unexplained == 1
    assert record.first_unexplained == (0, (1,))
    assert "differ without a near tie at 1 places (first: step 0 at [1])" in record.failure()
    ok = rp.ArgmaxRecord("text_logits", tie_tol=1e-4)
    ok.add(0, torch_logits, torch_logits * 1.000001)
    assert ok.per_step_agree == [2] and ok.failure() is None


def test_cli_require_help_states_the_bounds_in_force(capsys):
    with pytest.raises(SystemExit):
        main(["crosscheck", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"max rel {rp.CLOSE_MAX_REL['float32']:g} (float32) / {rp.CLOSE_MAX_REL['bfloat16']:g} (bfloat16)" in text


def test_default_steps_wrap_the_ring_on_the_cpu_twins_and_stay_300_elsewhere(monkeypatch):
    """On the CPU the twin kernels run torch's side under Triton's interpreter: a run of the default
    length wraps the small preset's ring three times (not 300 interpreted steps); 300 on a GPU, for
    the reference kernels and wherever three wraps would take longer."""
    temporal, mimi = PRESETS["temporal-small"], PRESETS["mimi-small"]
    assert cc.default_steps(temporal, 1, "twin", "cpu") == 72 >= 2 * temporal.capacity
    assert cc.default_steps(mimi, 2, "twin", "cpu") == 15 and 15 * 2 >= 2 * mimi.capacity
    assert cc.default_steps(temporal, 1, "reference", "cpu") == 300
    assert cc.default_steps(temporal, 1, "twin", "cuda:0") == 300
    assert cc.default_steps(PRESETS["temporal"], 1, "twin", "cpu") == 300  # three wraps of 3000: more
    steps = []
    monkeypatch.setattr(cc, "_run", lambda *args, **kwargs: steps.append(kwargs["steps"]))
    crosscheck("temporal", kernels="twin")
    crosscheck("mimi-encoder", kernels="twin")
    crosscheck("temporal", kernels="twin", steps=5)
    crosscheck("temporal")
    assert steps == [72, 15, 5, 300]


def test_progress_lines_a_line_every_few_seconds():
    import io

    out = io.StringIO()
    assert list(cc.progress_lines("crosscheck temporal", every=0, stream=out)(range(3))) == [0, 1, 2]
    assert out.getvalue().splitlines() == [f"crosscheck temporal: {i}/3 steps, 0 s" for i in range(3)]
    out = io.StringIO()
    assert list(cc.progress_lines("x", every=60, stream=out)(range(3))) == [0, 1, 2]
    assert out.getvalue() == "x: 0/3 steps, 0 s\n"  # the first step, then one line per minute


def test_cli_shows_progress_on_a_stderr_that_is_not_a_terminal(capsys):
    """stderr redirected (pytest's capture is not a TTY): plain progress lines, none with -q."""
    args = ["crosscheck", "--stack", "mimi-encoder", "--steps", "3", "--batch", "2", "--kernels", "reference"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.startswith("crosscheck mimi-encoder: 0/3 steps, 0 s\n"), err
    assert main([*args, "-q"]) == 0
    assert capsys.readouterr().err == ""
