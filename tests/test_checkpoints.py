"""Checkpoints on both sides: all-or-nothing torch loads, one dtype rule and one error type
(`CheckpointError`, naming the path and the key), moshi's own key names, sizes inferred from
a file's shapes (and the CLI on a small file), norm_eps threaded through the torch stacks."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

import jax_impl as jx
from jax_impl.checkpoint import CheckpointError, check_checkpoint, infer_config
from jax_impl.config import PRESETS, with_options
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.cli import main

from .moshi_oracle import moshi_stack

TCFG = PRESETS["temporal-small"]
MCFG = PRESETS["mimi-small"]
MIDDLE = "transformer.layers.1.gating.linear_in.weight"  # the 5th of the 8 weight kinds, layer 1 of 2


def make(cfg, seed=0, dtype=torch.float32):
    cls = TemporalStreaming if isinstance(cfg, type(TCFG)) else MimiTransformer
    stack = cls.from_config(cfg, dtype=dtype)
    stack.init_weights(generator=torch.Generator().manual_seed(seed))
    return stack


def snapshot(stack):
    return {k: (v.clone(), v.data_ptr()) for k, v in stack.weights().items()}


def assert_unchanged(stack, before):
    for k, v in stack.weights().items():
        assert v.data_ptr() == before[k][1], f"{k}: buffer replaced"
        assert torch.equal(v, before[k][0]), f"{k}: overwritten by a failed load"


# ------------------------------------------------------------------------------ 1. no partial loads
@pytest.mark.parametrize("bad,message", [
    (lambda t: torch.empty(t.shape, device="meta"), f"no data: {MIDDLE}: a meta tensor"),
    (lambda t: t.double(), f"wrong dtype: {MIDDLE}: float64"),
    (lambda t: t.to(torch.int32), f"wrong dtype: {MIDDLE}: int32"),
    (lambda t: t.to_sparse(), f"not dense: {MIDDLE}: layout torch.sparse_coo"),
])
def test_torch_load_is_all_or_nothing(bad, message):
    stack = make(TCFG, seed=1)
    src = make(TCFG, seed=2).export_weights()
    keys = list(src)
    assert 0 < keys.index(MIDDLE) < len(keys) - 1  # weights both before and after it in the dict
    src[MIDDLE] = bad(src[MIDDLE])
    before = snapshot(stack)
    with pytest.raises(CheckpointError) as err:
        stack.load_weights(src)
    assert message in str(err.value) and str(err.value).startswith("state_dict does not fit")
    assert_unchanged(stack, before)
    good = make(TCFG, seed=2)
    stack.load_weights(good.export_weights())  # the same stack still loads, in place
    assert all(torch.equal(v, good.weights()[k]) and v.data_ptr() == before[k][1]
               for k, v in stack.weights().items())


def test_torch_load_lists_every_problem_and_refuses_a_list():
    stack = make(MCFG)
    src = make(MCFG, seed=3).export_weights("decoder_transformer")
    k1 = "decoder_transformer.transformer.layers.0.linear1.weight"
    k2 = "decoder_transformer.transformer.layers.1.norm2.bias"
    src[k1] = src[k1].tolist()
    src[k2] = src[k2].numpy().astype(np.float64)
    before = snapshot(stack)
    with pytest.raises(CheckpointError) as err:
        stack.load_weights(src, "decoder_transformer")
    msg = str(err.value)
    assert f"not a tensor: {k1}: list" in msg and f"wrong dtype: {k2}: float64" in msg
    assert "missing" not in msg and "narrow" not in msg  # the list's key is there; float64 is not "narrowed"
    assert_unchanged(stack, before)


# ------------------------------------------------------------------------------ 3. numpy into torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_load_takes_numpy_arrays_exactly(dtype):
    src = make(TCFG, seed=4, dtype=dtype)
    ck = jx.export_checkpoint(TCFG, jx.params_from_stacked(TCFG, src.weights()))  # numpy (bf16: ml_dtypes)
    assert next(iter(ck.values())).dtype == (np.float32 if dtype == torch.float32 else ml_dtypes.bfloat16)
    dst = make(TCFG, seed=5, dtype=dtype)
    dst.load_weights(ck)
    for k, v in dst.weights().items():
        assert torch.equal(v, src.weights()[k]), k
    f32 = make(TCFG, seed=5)
    if dtype == torch.bfloat16:  # exact widening from numpy bf16 too
        f32.load_weights(ck)
        assert torch.equal(f32.in_proj, src.in_proj.float())


# ------------------------------------------------------------------------------ 2. JAX loaders
@pytest.mark.parametrize("np_dtype", [np.float64, np.int32, np.bool_])
def test_jax_loaders_refuse_non_float_and_float64_naming_the_key(np_dtype):
    stack = make(TCFG)
    ck = {k: v.numpy() for k, v in stack.export_weights().items()}
    ck[MIDDLE] = ck[MIDDLE].astype(np_dtype)
    name = np.dtype(np_dtype).name
    with pytest.raises(CheckpointError, match=f"wrong dtype: {MIDDLE}: {name}; a weight must be one of"):
        jx.params_from_checkpoint(TCFG, ck)
    flat = {k: v.numpy() for k, v in stack.weights().items()}
    flat["linear_in"] = flat["linear_in"].astype(np_dtype)
    with pytest.raises(CheckpointError, match=f"wrong dtype: linear_in: {name}"):
        jx.params_from_stacked(TCFG, flat)
    with pytest.raises(CheckpointError, match=f"wrong dtype: linear_in: {name}"):  # torch source, same rule
        jx.params_from_stacked(TCFG, {**stack.weights(), "linear_in": torch.from_numpy(flat["linear_in"])})


def test_jax_loaders_refuse_lists_meta_mixed_and_float64_targets():
    stack = make(TCFG)
    ck = stack.export_weights()
    with pytest.raises(CheckpointError, match=f"not an array: {MIDDLE}: list"):
        jx.params_from_checkpoint(TCFG, {**ck, MIDDLE: ck[MIDDLE].tolist()})
    with pytest.raises(CheckpointError, match=f"no data: {MIDDLE}: a meta tensor"):
        jx.params_from_checkpoint(TCFG, {**ck, MIDDLE: torch.empty(ck[MIDDLE].shape, device="meta")})
    with pytest.raises(CheckpointError, match="mixed dtypes: bfloat16, float32: pass dtype="):
        jx.params_from_checkpoint(TCFG, {**ck, MIDDLE: ck[MIDDLE].bfloat16()})
    mixed = jx.params_from_checkpoint(TCFG, {**ck, MIDDLE: ck[MIDDLE].bfloat16()}, dtype=jnp.float32)
    assert {a.dtype for a in jax.tree_util.tree_leaves(mixed)} == {jnp.dtype(jnp.float32)}
    with pytest.raises(ValueError, match="^dtype: expected None or one of float32, .*, got float64$"):
        jx.params_from_checkpoint(TCFG, ck, dtype=np.float64)


def test_float64_file_refused_by_both_sides_naming_path_and_key(tmp_path):
    path = tmp_path / "f64.safetensors"
    ck = {k: v.numpy().astype(np.float64) for k, v in make(TCFG).export_weights().items()}
    save_numpy(ck, str(path))
    with pytest.raises(CheckpointError) as err:
        jx.load_safetensors(TCFG, path)
    assert str(err.value).startswith(str(path)) and f"wrong dtype: {MIDDLE}: float64" in str(err.value)
    stack = make(TCFG)
    before = snapshot(stack)
    with pytest.raises(CheckpointError) as err:
        stack.load_safetensors(path)
    assert str(err.value).startswith(str(path)) and f"wrong dtype: {MIDDLE}: float64" in str(err.value)
    assert_unchanged(stack, before)


@pytest.mark.parametrize("damage", ["empty", "truncated", "junk"])
def test_unreadable_files_one_error_naming_the_path(tmp_path, damage):
    good = tmp_path / "good.safetensors"
    make(TCFG).save_safetensors(good)
    path = tmp_path / f"{damage}.safetensors"
    data = good.read_bytes()
    path.write_bytes({"empty": b"", "truncated": data[:-100], "junk": b"\x08" + data[1:200]}[damage])
    stack = make(TCFG)
    before = snapshot(stack)
    for load in (lambda: jx.load_safetensors(TCFG, path), lambda: stack.load_safetensors(path)):
        with pytest.raises(CheckpointError, match=f"^{path} is not a readable safetensors file"):
            load()
    assert_unchanged(stack, before)


def test_files_that_misstate_their_tensors_are_refused_naming_the_path_and_key(tmp_path):
    """A header naming a key twice (JSON would keep the last entry: its bytes read in another
    dtype), a float8 tensor (numpy holds none), a directory: one CheckpointError each, on both
    sides, the stack unchanged."""
    good = tmp_path / "good.safetensors"
    make(TCFG).save_safetensors(good)
    data = good.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    entry = json.dumps(MIDDLE) + ":" + json.dumps(json.loads(header)[MIDDLE], separators=(",", ":"))
    twice = header.replace("{", "{" + entry.replace('"F32"', '"F16"') + ",", 1).encode()
    (tmp_path / "twice.safetensors").write_bytes(len(twice).to_bytes(8, "little") + twice + data[8 + n:])
    f8 = {k: v.float().to(torch.float8_e4m3fn) if k == MIDDLE else v for k, v in make(TCFG).export_weights().items()}
    save_torch(f8, str(tmp_path / "f8.safetensors"))
    stack = make(TCFG)
    before = snapshot(stack)
    for name, jax_message, torch_message in (
            ("twice.safetensors", f"its header names '{MIDDLE}' twice", f"its header names '{MIDDLE}' twice"),
            ("f8.safetensors", f"tensor '{MIDDLE}' cannot be read: its dtype F8_E4M3", f"wrong dtype: {MIDDLE}"),
            ("", "is a directory, not a safetensors file", "is a directory, not a safetensors file")):
        path = tmp_path / name
        with pytest.raises(CheckpointError, match=f"^{path}.*{jax_message}"):
            jx.load_safetensors(TCFG, path)
        with pytest.raises(CheckpointError, match=f"^{path}(.|\n)*{torch_message}"):
            stack.load_safetensors(path)
    assert_unchanged(stack, before)
    params = jx.load_safetensors(TCFG, good)
    for save in (lambda p: stack.save_safetensors(p), lambda p: jx.save_safetensors(TCFG, params, p)):
        with pytest.raises(ValueError, match=f"cannot write the safetensors file {tmp_path}: it is a directory"):
            save(tmp_path)
    # what a JAX save is given is checked first: a transposed leaf would be reshaped into the file
    bad = {"params": {**params["params"], "text_linear": params["params"]["text_linear"].T}}
    with pytest.raises(CheckpointError, match="variables do not fit(.|\n)*wrong shape: text_linear"):
        jx.save_safetensors(TCFG, bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_bfloat16_file_loads_exactly_on_both_sides(tmp_path):
    src = make(MCFG, seed=6, dtype=torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    src.save_safetensors(path, "encoder_transformer")
    params = jx.load_safetensors(MCFG, path, "encoder_transformer")
    dst = make(MCFG, seed=7, dtype=torch.bfloat16)
    dst.load_safetensors(path, "encoder_transformer")
    flat = jx.weights.stacked_weights(MCFG, params)
    for k, v in src.weights().items():
        assert flat[k].dtype == jnp.bfloat16
        bits = v.view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(np.asarray(flat[k]).view(np.uint16), bits)
        assert torch.equal(dst.weights()[k], v)


# ------------------------------------------------------------------------------ 5. one checker, one error
def test_one_error_type_for_every_weight_check():
    assert issubclass(CheckpointError, ValueError) and not issubclass(CheckpointError, KeyError)
    assert not hasattr(jx.weights, "ParamsError") and not hasattr(jx.weights, "FLOAT_DTYPES")
    params = jx.init_params(TCFG, jax.random.key(0))
    flat = jx.weights.stacked_weights(TCFG, params)
    layers = {**params["params"]["layers"], "in_proj": jnp.zeros(3)}
    bad_tree = {"params": {**params["params"], "layers": layers}}
    bad_ck = {**jx.export_checkpoint(TCFG, params), "out_norm.alpha": np.zeros(3, np.float32)}
    head = "state_dict does not fit TemporalConfig(dim=64, num_layers=2) with prefix '(none)':\n"
    calls = [
        (lambda: jx.check_params(TCFG, bad_tree),
         "params do not fit TemporalConfig(dim=64, num_layers=2):\n"
         + "  wrong shape: layers/in_proj: expected [2, 192, 64], got [3]"),
        (lambda: jx.params_from_stacked(TCFG, {**flat, "in_proj": np.zeros(3, np.float32)}),
         "stacked weights do not fit TemporalConfig(dim=64, num_layers=2):\n"
         + "  wrong shape: in_proj: expected [2, 192, 64], got [3]"),
        (lambda: jx.params_from_checkpoint(TCFG, bad_ck),
         head + "  wrong shape: out_norm.alpha: expected [1, 1, 64], got [3]"),
        (lambda: make(TCFG).load_weights(bad_ck),  # numpy arrays into torch
         head + "  wrong shape: out_norm.alpha: expected [1, 1, 64], got [3]"),
    ]
    for call, text in calls:
        with pytest.raises(CheckpointError) as err:
            call()
        assert str(err.value) == text


# ------------------------------------------------------------------------------ 6. moshi's own key names
def test_moshi_names_accepted_and_duplicates_refused():
    ck = {k: tuple(v.shape) for k, v in make(MCFG).export_weights("encoder_transformer").items()}
    p = "encoder_transformer.transformer.layers.1.self_attn."
    moshi_names = {"in_proj_weight": "in_projs.0.weight", "out_proj.weight": "out_projs.0.weight"}
    renamed = {}
    for k, v in ck.items():
        for ours_, theirs_ in moshi_names.items():
            k = k.replace(ours_, theirs_)
        renamed[k] = v
    keys = check_checkpoint(renamed, MCFG, "encoder_transformer")
    assert keys[p + "in_projs.0.weight"][0].name == "in_proj"
    assert keys[p + "out_projs.0.weight"][0].name == "out_proj"
    assert set(keys) == set(renamed)
    with pytest.raises(CheckpointError) as err:
        check_checkpoint({**ck, p + "in_projs.0.weight": ck[p + "in_proj_weight"],
                          p + "in_projs.1.weight": ck[p + "in_proj_weight"]}, MCFG, "encoder_transformer")
    assert str(err.value).splitlines()[1:] == [
        f"  unexpected: {p}in_projs.1.weight",
        f"  duplicate: {p}in_projs.0.weight: the same weight as {p}in_proj_weight"]


@pytest.mark.parametrize("kind", ["temporal", "mimi"])
def test_moshi_module_state_dict_file_loads_on_both_sides_bit_exact(tmp_path, kind):
    cfg = with_options(TCFG if kind == "temporal" else MCFG, ring_convention="moshi")
    prefix, T, B = (None, 1, 2) if kind == "temporal" else ("decoder_transformer", 2, 2)
    gen = torch.Generator().manual_seed(11)
    theirs, out_norm, text_linear = moshi_stack(cfg, make(cfg, seed=8).export_weights(prefix), B)
    with torch.no_grad():  # the file's weights are moshi's own, not a copy of any stack of ours
        for module in (theirs, out_norm, text_linear):
            for w in ([] if module is None else module.parameters()):
                w.add_(0.01 * torch.randn(w.shape, generator=gen))
    stack_key = "transformer." if kind == "temporal" else "decoder_transformer.transformer."
    sd = {stack_key + k: v for k, v in theirs.state_dict().items()}
    if kind == "temporal":
        sd.update({"out_norm.alpha": out_norm.alpha, "text_linear.weight": text_linear.weight})
    assert "transformer.layers.0.self_attn.in_projs.0.weight" in "".join(sd)
    path = tmp_path / "moshi_module.safetensors"
    save_torch({k: v.detach().contiguous() for k, v in sd.items()}, str(path))

    ours = make(cfg, seed=9)
    ours.load_safetensors(path, prefix)
    attn = dict(theirs.layers[1].self_attn.named_parameters())
    assert torch.equal(ours.in_proj[1], attn["in_projs.0.weight"])
    assert torch.equal(ours.out_proj[1], attn["out_projs.0.weight"])
    params = jx.load_safetensors(cfg, path, prefix)
    for k, v in jx.weights.stacked_weights(cfg, params).items():
        np.testing.assert_array_equal(np.asarray(v), ours.weights()[k].numpy(), err_msg=k)

    ours.streaming_init(B)
    jax_step, state = jax.jit(jx.step_fn(cfg)), jx.init_state(cfg, B)
    with torch.no_grad():
        for step in range(cfg.context // T + 6):  # past the ring's wrap
            x = torch.randn(B, T, cfg.dim, generator=gen)
            ref = theirs(x)
            out = ours.step(x)
            jax_out, state = jax_step(params, state, jnp.asarray(x.numpy()), None)
            if kind == "temporal":
                ref = out_norm(ref)
                (out, logits), (jax_out, _) = out, jax_out
                assert torch.equal(logits, text_linear(ref)[:, None]), f"text_logits differ at step {step}"
            assert torch.equal(out, ref), f"step {step}: max abs {(out - ref).abs().max().item()}"
            np.testing.assert_allclose(np.asarray(jax_out), ref.numpy(), rtol=0, atol=2e-5)
    assert int(ours.state.offset[0]) > cfg.context


# ------------------------------------------------------------------------------ 7. sizes from shapes
def test_infer_config_reads_the_sizes_and_names_what_it_lacks():
    big = with_options(TCFG, dim=96, num_heads=6, num_layers=3, hidden=40, text_card=17)
    ck = jx.export_checkpoint(big, jx.init_params(big, jax.random.key(0)))
    shapes = {k: tuple(v.shape) for k, v in ck.items()}
    assert infer_config(shapes, "temporal") == {"dim": 96, "num_layers": 3, "hidden": 40, "text_card": 17}
    mshapes = {k: tuple(v.shape) for k, v in make(MCFG).export_weights("encoder_transformer").items()}
    assert infer_config(mshapes, "mimi", "encoder_transformer") == {"dim": 32, "num_layers": 2, "ffn": 64}
    with pytest.raises(CheckpointError, match="holds no mimi stack: no key starts with decoder_transformer"):
        infer_config(mshapes, "mimi", "decoder_transformer")
    # a size is a whole number (64.5 was read as 64), a stray key no stack of its index (10**12 layers)
    key = "transformer.layers.0.self_attn.in_proj_weight"
    for shape in ((288.0, 96.5), None, (288, True)):
        with pytest.raises(CheckpointError, match=rf"wrong shape: {re.escape(key)}: expected 2 positive int dimensions"):
            infer_config({**shapes, key: shape}, "temporal")
    with pytest.raises(CheckpointError, match=r"missing: layer 3 \(999999999996 of the 1000000000000 layers that "
                                              r"transformer.layers.999999999999. implies are absent\)"):
        infer_config({**shapes, "transformer.layers.999999999999.x": (1,)}, "temporal")
    del shapes["text_linear.weight"]
    with pytest.raises(CheckpointError, match=r"missing: text_linear.weight \(it gives text_card\)"):
        infer_config(shapes, "temporal", source="f.safetensors")


def test_cli_crosscheck_small_checkpoint(tmp_path, capsys):
    path = tmp_path / "small.safetensors"
    jx.save_safetensors(TCFG, jx.init_params(TCFG, jax.random.key(3)), path)
    assert main(["crosscheck", "--checkpoint", str(path), "--num-heads", "4", "--steps", "5", "-q",
                 "--kernels", "reference"]) == 0
    out = capsys.readouterr().out
    assert (f"config: from {path}: dim=64, num_layers=2, hidden=176, text_card=96; "
            f"from --num-heads: num_heads=4; from the temporal preset: context=3000") in out
    assert "cross-check temporal: dim 64, 2 layers, context 3000" in out

    assert main(["crosscheck", "--checkpoint", str(path), "--steps", "5", "-q"]) == 1
    err = capsys.readouterr().err
    assert "--num-heads: required" in err and "num_heads cannot be inferred from shapes" in err

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"num_heads": 8, "context": 12, "norm_eps": 1e-6}))
    assert main(["crosscheck", "--checkpoint", str(path), "--config", str(config), "--context", "16",
                 "--steps", "5", "-q", "--kernels", "reference"]) == 0
    out = capsys.readouterr().out
    assert f"from --config {config}: num_heads=8, norm_eps=1e-06; from --context: context=16" in out

    for bad, message in [({"dim": 128}, "dim=128 contradicts"),
                         ({"heads": 4}, "unknown TemporalConfig field(s) ['heads']"),
                         ({"num_heads": 4.0}, "num_heads must be an integer"),
                         ({"ring_convention": "moshi"}, "ring_convention is set by --convention")]:
        config.write_text(json.dumps(bad))
        assert main(["crosscheck", "--checkpoint", str(path), "--config", str(config), "-q"]) == 1
        assert message in capsys.readouterr().err


def test_cli_help_says_which_convention_fits_which_family(capsys):
    with pytest.raises(SystemExit):
        main(["crosscheck", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'moshi' for Kyutai Moshi models" in text and "RingKVCache" in text
    assert "'personaplex' for NVIDIA PersonaPlex" in text and "'moshi' for a Kyutai Moshi file" in text


# ------------------------------------------------------------------------------ 4. norm_eps
@pytest.mark.parametrize("base", [TCFG, MCFG])
def test_norm_eps_changes_the_torch_model_and_matches_jax(base):
    custom = with_options(base, norm_eps=0.5)
    cls = TemporalStreaming if base is TCFG else MimiTransformer
    assert cls.from_config(custom).config == custom
    sizes = {"hidden": base.hidden, "text_card": base.text_card} if base is TCFG else {"ffn": base.ffn}
    assert cls(dim=base.dim, num_layers=base.num_layers, num_heads=base.num_heads, context=base.context,
               norm_eps=0.5, **sizes).config == custom
    default, changed = make(base), make(custom)
    for stack in (default, changed):  # Mimi's layer scales at 1, not 0.01: the norms show in the output
        stack.init_weights(layer_scale=1.0, generator=torch.Generator().manual_seed(10))
    T = 1 if base is TCFG else 2
    x = torch.randn(2, T, base.dim, generator=torch.Generator().manual_seed(1)) * 0.3  # mean square ~0.09
    outs = []
    for stack in (default, changed):
        stack.streaming_init(2)
        out = stack.step(x)
        outs.append(out[0] if isinstance(out, tuple) else out)
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    params = jx.params_from_stacked(custom, changed.weights())
    jax_out, _ = jax.jit(jx.step_fn(custom))(params, jx.init_state(custom, 2), jnp.asarray(x.numpy()), None)
    jax_out = np.asarray(jax_out[0] if isinstance(jax_out, tuple) else jax_out)
    np.testing.assert_allclose(jax_out, outs[1].numpy(), rtol=0, atol=1e-5)
    for eps in (0.0, 1e300, 1e-50):  # inf and 0 in float32, where the norms add it
        with pytest.raises(ValueError, match=rf"norm_eps must be a float > 0 that float32 holds .*, got {re.escape(repr(eps))}"):
            with_options(base, norm_eps=eps)
    assert with_options(base, norm_eps=np.float32(1e-5)).norm_eps == np.float32(1e-5)  # numpy's reals are numbers
    # RoPE's longest wavelength: inf made every frequency NaN (every output NaN, on both sides)
    for period in (float("inf"), float("nan"), 10**400, "10000", None, 1.0):  # 10**400: no float holds it
        with pytest.raises(ValueError, match=rf"max_period must be a finite number > 1 .*, got {re.escape(repr(period))}"):
            with_options(base, max_period=period)
    # a size past int32 is no model's (JAX ended the process making a ring of context 2**62)
    with pytest.raises(ValueError, match=r"(Temporal|Mimi)Config.context must be a positive int of at most 2147483647, got "):
        with_options(base, context=2**62)


def test_a_file_of_another_config_is_a_few_lines_naming_infer_config(tmp_path):
    """The small preset's weights checked against the 7B config: ~200 problems, told in a few lines
    (one a kind, with counts) that point to infer_config and --num-heads; every problem kept in
    `.problems`. A few wrong shapes are listed in full, with the same pointer."""
    src = make(TCFG).export_weights()
    shapes = {k: tuple(v.shape) for k, v in src.items()}
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(shapes, PRESETS["temporal"], source="model.safetensors")
    lines = str(err.value).splitlines()
    assert len(lines) <= 5, str(err.value)
    assert lines[0] == (f"model.safetensors does not fit TemporalConfig(dim=4096, num_layers=32) with prefix "
                        f"'(none)': {len(err.value.problems)} problems (every one in this error's .problems):")
    assert "infer_config" in lines[-1] and "--num-heads" in lines[-1]
    missing = [p for p in err.value.problems if p.startswith("missing: ")]
    wrong = [p for p in err.value.problems if p.startswith("wrong shape: ")]
    assert len(missing) == 30 * 6 and len(wrong) == 2 * 7 and len(err.value.problems) == len(missing) + len(wrong)
    assert "missing: transformer.layers.31.gating.linear_out.weight" in missing
    assert lines[1].startswith("  missing: 180 (transformer.layers.2.self_attn.in_proj_weight; ")
    assert lines[2].startswith("  wrong shape: 14 (transformer.layers.0.self_attn.in_proj_weight: expected "
                               "[12288, 4096], got [192, 64]; ")
    wider = with_options(TCFG, hidden=256)
    with pytest.raises(CheckpointError) as err:
        make(wider).load_weights(src)  # torch's loader: the same error
    lines = str(err.value).splitlines()
    assert lines[1:5] == [f"  {p}" for p in err.value.problems] and len(err.value.problems) == 4
    assert lines[1] == ("  wrong shape: transformer.layers.0.gating.linear_in.weight: expected [512, 64], "
                        "got [352, 64]")
    assert len(lines) == 6 and "infer_config" in lines[5] and "--num-heads" in lines[5]
