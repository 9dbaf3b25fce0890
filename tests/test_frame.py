"""The whole LM frame: the torch `LMFrame` against moshi's `LMGen.step` (bit for bit), its input
checks and loader, and the JAX frame step against the torch frame."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from jax_impl.checkpoint import CheckpointError
from jax_impl.frame_config import FRAME_PRESETS, UNGENERATED_TOKEN
from torch_bridge.frame import LMFrame

from .moshi_oracle import moshi_lm_module
from .test_depformer import personaplex_expand

B = 3


def moshi_convention(cfg):
    return dataclasses.replace(cfg, temporal=dataclasses.replace(cfg.temporal, ring_convention="moshi"))


def random_frame(cfg, seed=0, std=0.3) -> LMFrame:
    frame = LMFrame.from_config(cfg)
    frame.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return frame


def moshi_lm(cfg, frame: LMFrame):
    """moshi's LMModel on the frame's weights (the depformer's loaded as PersonaPlex's loader does)."""
    lm = moshi_lm_module()
    t, d = cfg.temporal, cfg.depformer
    model = lm.LMModel(
        delays=list(cfg.delays), n_q=cfg.n_q, dep_q=cfg.dep_q, card=cfg.card, text_card=cfg.text_card, dim=t.dim,
        num_heads=t.num_heads, num_layers=t.num_layers, hidden_scale=t.hidden * 3 / 2 / t.dim, norm="rms_norm_f32",
        gating="silu", positional_embedding="rope", max_period=t.max_period, causal=True, layer_scale=None,
        context=t.context, depformer_dim=d.dim, depformer_dim_feedforward=d.hidden * 3 // 2,
        depformer_num_heads=d.num_heads, depformer_num_layers=d.num_layers, depformer_multi_linear=True,
        depformer_pos_emb="none", depformer_weights_per_step=True)
    weights = frame.export_weights()
    dep = {k: v for k, v in weights.items() if k in frame.depformer.export_weights()}
    model.load_state_dict({**weights, **personaplex_expand(dep, d)}, strict=True)
    return lm, model.eval()


@pytest.mark.parametrize("preset", ["moshi-small", "personaplex-small"])
def test_frame_bit_exact_with_moshi_lmgen(preset):
    """Greedy, 40 frames (the ring wraps, the delays fill), an idle row, a recycled row, and early exit
    against LMGen with the tail of the depformer's tokens replaced."""
    torch.manual_seed(0)
    cfg = moshi_convention(FRAME_PRESETS[preset])
    frame = random_frame(cfg)
    lm, model = moshi_lm(cfg, frame)
    gen = lm.LMGen(model, use_sampling=False, support_out_of_sync=True)  # masked outputs, never None
    seen = {}
    gen.on_text_logits_hook = lambda logits: seen.__setitem__("text_logits", logits[:, 0, 0].float().clone())
    gen.on_text_hook = lambda text: seen.__setitem__("text", text.clone())
    gen.on_audio_hook = lambda audio: seen.__setitem__("audio", audio.clone())
    g = torch.Generator().manual_seed(1)
    frame.streaming_init(B)
    exit_at = cfg.dep_q // 2
    with torch.no_grad(), gen.streaming(B):
        state = gen._streaming_state
        full_depformer = state.graphed_depth
        for t in range(40):
            active = torch.ones(B, dtype=torch.bool)
            if t % 5 == 3:
                active[1] = False
            if t == 17:
                mask = torch.tensor([False, False, True])
                gen.reset_streaming(mask)
                frame.reset_rows(mask)
            user = torch.randint(-1, cfg.card + 1, (B, cfg.user_codebooks), generator=g)
            kwargs = {}
            if 20 <= t < 30:  # early exit: the caller's tokens for the tail
                tail = torch.randint(0, cfg.card, (B, cfg.dep_q - exit_at), generator=g)
                state.graphed_depth = lambda text, out, tail=tail: torch.cat(
                    [full_depformer(text, out)[:, :exit_at], tail], 1)
                kwargs = {"dep_q_exit": exit_at, "replace_audio": tail}
            else:
                state.graphed_depth = full_depformer
            gen.set_exec_mask(active)
            ref = gen.step(user[:, :, None])
            out = frame.step(user, active, **kwargs)
            assert torch.equal(out.text_logits[active], seen["text_logits"][active]), f"text_logits differ at frame {t}"
            assert torch.equal(out.text[active], seen["text"][active]), f"text differs at frame {t}"
            assert torch.equal(out.audio[active], seen["audio"][active]), f"audio differs at frame {t}"
            assert (out.text[~active] == UNGENERATED_TOKEN).all() and (out.audio[~active] == UNGENERATED_TOKEN).all()
            assert torch.equal(out.tokens, ref[:, :, 0]), f"tokens differ at frame {t}"
            assert torch.equal(frame.frame_offset, state.offsets)
    assert (frame.temporal.state.offset > cfg.temporal.context).any(), "the ring must wrap"


def test_jax_frame_equals_torch_frame():
    """Greedy, then sampled (same seeds) with early exit: 30 frames each side by side, an idle row,
    reset_slot / reset_rows; every token equal, the state equal (integers) at the end."""
    import jax.numpy as jnp

    from jax_impl import frame as jf
    from torch_bridge.frame import jax_frame_params

    torch.set_num_threads(1)
    cfg = FRAME_PRESETS["moshi-small"]
    frame = random_frame(cfg, seed=3)
    params = jax_frame_params(frame)
    rope = frame.temporal.rope_freqs()
    seeds = torch.tensor([11, 2**31 + 5, 7])
    runs = [({}, {}), ({"temperature": 0.8, "top_k": 5, "text_temperature": 0.7, "text_top_k": 10}, {"dep_q_exit": 3})]
    g = torch.Generator().manual_seed(2)
    for sampling, exit_kw in runs:
        frame.streaming_init(B)
        state = jf.init_frame_state(cfg, B)
        step = jf.make_frame_step(cfg, rope_freqs=rope, **sampling, **exit_kw)
        for t in range(30):
            if t == 9:
                frame.reset_slot(1)
                state = jf.jit_reset_slot(state, 1)
            if t == 21:
                mask = torch.tensor([True, False, True])
                frame.reset_rows(mask)
                state = jf.jit_reset_rows(state, mask.numpy())
            active = torch.tensor([True, t % 4 != 2, True])
            user = torch.randint(-1, cfg.card + 1, (B, cfg.user_codebooks), generator=g)
            tail = None
            if exit_kw:
                tail = torch.randint(0, cfg.card, (B, cfg.dep_q - exit_kw["dep_q_exit"]), generator=g)
            ours = frame.step(user, active, replace_audio=tail, seeds=seeds, **sampling, **exit_kw)
            out, state = step(params, state, user.numpy(), active.numpy(),
                              None if tail is None else tail.numpy(), seeds.numpy())
            for name in ("tokens", "text", "audio"):
                assert np.array_equal(getattr(ours, name).numpy(), np.asarray(getattr(out, name))), \
                    f"{name} differs at frame {t} ({sampling}, {exit_kw})"
            np.testing.assert_allclose(np.asarray(out.text_logits), ours.text_logits.numpy(), rtol=0, atol=2e-5)
        assert np.array_equal(np.asarray(state.token_cache), frame.token_cache.numpy())
        assert np.array_equal(np.asarray(state.frame_offset), frame.frame_offset.numpy())
        assert np.array_equal(np.asarray(state.temporal.offset), frame.temporal.state.offset.numpy())
        assert np.array_equal(np.asarray(state.temporal.start_offset), frame.temporal.state.start_offset.numpy())
    assert int(jnp.max(state.temporal.offset)) > cfg.temporal.context  # the ring wrapped


@pytest.mark.parametrize("preset", ["moshi-small", "personaplex-small"])
def test_load_weights_from_moshi_state_dict(preset):
    """A moshi LMModel's state_dict() (moshi's module names, PersonaPlex's copied sets) loads back into
    a fresh frame exactly; a missing or mis-shaped weight is refused with every problem named, nothing written."""
    cfg = moshi_convention(FRAME_PRESETS[preset])
    frame = random_frame(cfg)
    _, model = moshi_lm(cfg, frame)
    state_dict = model.state_dict()
    other = random_frame(cfg, seed=9)
    before = {k: v.clone() for k, v in other.export_weights().items()}
    bad = dict(state_dict)
    del bad["emb.3.weight"], bad["transformer.layers.1.norm2.alpha"]
    bad["depformer_in.0.weight"] = bad["depformer_in.0.weight"][:, :-1]
    with pytest.raises(CheckpointError) as err:
        other.load_weights(bad, source="lm")
    for key in ("missing: emb.3.weight", "missing: transformer.layers.1.norm2.alpha", "depformer_in.0.weight"):
        assert key in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in other.export_weights().items()), "a refused load wrote"
    other.load_weights(state_dict)
    assert all(torch.equal(v, frame.export_weights()[k]) for k, v in other.export_weights().items())


def test_bad_input_is_refused_and_changes_nothing():
    from jax_impl import frame as jf
    from torch_bridge.frame import jax_frame_params

    cfg = FRAME_PRESETS["moshi-small"]
    frame = random_frame(cfg)
    frame.streaming_init(B)
    user = torch.zeros(B, cfg.user_codebooks, dtype=torch.long)
    frame.step(user)
    saved = [t.clone() for t in (frame.token_cache, frame.frame_offset, frame.temporal.state.k,
                                 frame.temporal.state.offset)]
    out_of_range = user.clone()
    out_of_range[1, 2] = cfg.card + 1
    cases = [
        ({"user_tokens": out_of_range}, ValueError, "user_tokens must hold token ids in 0..40"),
        ({"user_tokens": user[:, :3]}, ValueError, "user_tokens must have shape"),
        ({"user_tokens": user.float()}, TypeError, "user_tokens must be an integer"),
        ({"user_tokens": user, "active": torch.ones(B + 1, dtype=torch.bool)}, ValueError, "step(active)"),
        ({"user_tokens": user, "dep_q_exit": 0}, ValueError, "dep_q_exit must be an int in 1..8"),
        ({"user_tokens": user, "dep_q_exit": 9}, ValueError, "dep_q_exit must be an int in 1..8"),
        ({"user_tokens": user, "dep_q_exit": 5}, ValueError, "replace_audio must be given exactly"),
        ({"user_tokens": user, "dep_q_exit": 5, "replace_audio": torch.full((B, 3), -3)}, ValueError,
         "replace_audio must hold token ids"),
        ({"user_tokens": user, "temperature": 0.5}, ValueError, "seeds must be an integer"),
        ({"user_tokens": user, "temperature": 0.5, "seeds": torch.ones(B, dtype=torch.bool)}, ValueError,
         "seeds must be an integer"),
        ({"user_tokens": user, "text_temperature": 0.5, "seeds": torch.ones(B, dtype=torch.long, device="meta")},
         ValueError, "seeds is on meta"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
            frame.step(**kwargs)
    with pytest.raises(IndexError, match="reset_slot"):
        frame.reset_slot(B)
    assert all(torch.equal(a, b) for a, b in zip(saved, (frame.token_cache, frame.frame_offset,
                                                           frame.temporal.state.k, frame.temporal.state.offset)))
    # a table without data, or not dense, is refused with every other tensor: nothing is written
    weights = frame.export_weights()
    for spoil in (lambda t: t.to("meta"), lambda t: t.to_sparse()):
        source = {k: v * 2 for k, v in weights.items()}
        source["emb.3.weight"] = spoil(source["emb.3.weight"])
        with pytest.raises(CheckpointError, match="emb.3.weight"):
            frame.load_weights(source)
    assert all(torch.equal(v, weights[k]) for k, v in frame.export_weights().items())

    params = jax_frame_params(frame)
    state = jf.init_frame_state(cfg, B)
    with pytest.raises(ValueError, match="dep_q_exit must be an int in 1..8"):
        jf.make_frame_step(cfg, dep_q_exit=0)
    step = jf.make_frame_step(cfg, dep_q_exit=5)
    n = user.numpy()
    for args, message in [((out_of_range.numpy(), None, np.zeros((B, 3), np.int32)), "user_tokens must hold"),
                          ((n, None, None), "replace_audio must be given exactly"),
                          ((n, None, np.full((B, 3), cfg.card + 1, np.int32)), "replace_audio must hold")]:
        with pytest.raises(ValueError, match=message):
            step(params, state, *args)
    # the dtype of a row mask is a TypeError, its shape a ValueError, as on the torch frame
    with pytest.raises(TypeError, match=r"step\(active\): active must be a bool array, got int32"):
        step(params, state, n, np.ones(B, np.int32), np.zeros((B, 3), np.int32))
    with pytest.raises(ValueError, match=rf"step\(active\): active must have shape \[{B}\]"):
        step(params, state, n, np.ones(B + 1, bool), np.zeros((B, 3), np.int32))
    with pytest.raises(TypeError, match=r"reset_rows\(mask\): mask must be a bool array"):
        jf.jit_reset_rows(state, np.ones(B, np.int32))
    with pytest.raises(IndexError, match="reset_slot"):
        jf.jit_reset_slot(state, B)
    # the params are checked when the step is traced: 1 of the 16 audio tables would drop 15 from the input
    with pytest.raises(ValueError, match=r"params\['emb'\] must be float32\[16, 41, 48\]"):
        step({**params, "emb": params["emb"][:1]}, state, n, None, np.zeros((B, 3), np.int32))
    out, new = step(params, state, n, None, np.zeros((B, 3), np.int32))  # the state is still valid
    assert np.array_equal(np.asarray(new.frame_offset), [1, 1, 1])
    assert np.array_equal(np.asarray(out.audio[:, 5:]), np.zeros((B, 3)))
    for call in (lambda: step(params, state, n, None, np.zeros((B, 3), np.int32)), lambda: jf.jit_reset_slot(state, 0)):
        with pytest.raises(ValueError, match="donated to an earlier call"):
            call()


def test_a_frame_past_the_offsets_dtype_is_refused_on_both_sides():
    """A frame from one below the index dtype's largest offset steps (to it); the next, from the
    returned state or a state made by hand (frame_offset), raises OverflowError naming the offset, its
    row and the recycling op, before anything runs: every state array bit-equal, nothing donated (the
    recycled row then steps). The torch frame refuses the same frame, its int64 offsets notwithstanding."""
    import jax
    import jax.numpy as jnp

    from jax_impl import frame as jf
    from jax_impl.state import index_dtype, index_max
    from torch_bridge.frame import jax_frame_params

    cfg, top, idx = FRAME_PRESETS["moshi-small"], index_max(), np.dtype(index_dtype()).name
    frame = random_frame(cfg)
    params = jax_frame_params(frame)
    step = jf.make_frame_step(cfg, rope_freqs=frame.temporal.rope_freqs())
    user = np.zeros((2, cfg.user_codebooks), np.int32)
    state = jf.init_frame_state(cfg, 2)
    near = [jnp.array([3, top - 1], state.temporal.offset.dtype) for _ in range(2)]  # two buffers: both donated
    _, state = step(params, state._replace(temporal=state.temporal._replace(offset=near[0], start_offset=near[1])),
                    user)
    assert np.asarray(state.temporal.offset).tolist() == [4, top]
    by_hand = jf.init_frame_state(cfg, 2)
    by_hand = by_hand._replace(frame_offset=jnp.array([top, 0], by_hand.frame_offset.dtype))
    for bad, name in ((state, r"temporal.offset\[1\]"), (by_hand, r"frame_offset\[0\]")):
        before = [np.array(a) for a in jax.tree.leaves(bad)]
        with pytest.raises(OverflowError, match=rf"step\(state\): {name} is {top}: 1 more .* would pass {top}, "
                                                rf"the largest {idx} offset; .*jit_reset_rows"):
            step(params, bad, user)
        assert not any(a.is_deleted() for a in jax.tree.leaves(bad))
        assert all(np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(bad), strict=True))
    _, state = step(params, jf.jit_reset_rows(state, np.array([False, True])), user)
    assert np.asarray(state.temporal.offset).tolist() == [5, 1]

    frame.streaming_init(2)
    for t in (frame.temporal.state.offset, frame.temporal.state.start_offset):
        t.copy_(torch.tensor([3, top - 1]))
    frame.step(torch.from_numpy(user))
    assert frame.temporal.state.offset.tolist() == [4, top]
    ring = frame.temporal.state
    tensors = (frame.token_cache, frame.frame_offset, ring.k, ring.v, ring.offset, ring.start_offset)
    before = [t.clone() for t in tensors]
    with pytest.raises(OverflowError, match=rf"step: temporal.offset\[1\] is {top}: 1 more .* would pass {top}, "
                                            rf"the largest {idx} offset.*reset_rows"):
        frame.step(torch.from_numpy(user))
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
    frame.reset_rows(torch.tensor([False, True]))
    frame.step(torch.from_numpy(user))
    assert frame.temporal.state.offset.tolist() == [5, 1]


def test_crosscheck_depformer_and_frame(capsys):
    """`crosscheck --stack depformer|frame --kernels reference`: tokens and integer state identical,
    floats close; the CLI runs it and refuses the flags it does not take."""
    from torch_bridge.cli import main
    from torch_bridge.crosscheck_lm import crosscheck_lm

    report = crosscheck_lm("frame", steps=5, batch=2, seed=1)
    report.require(identical=["tokens", "text", "audio", "token_cache", "frame_offset", "offset", "start_offset"],
                   level="close", greedy=True)
    assert main(["crosscheck", "--stack", "depformer", "--steps", "3", "--batch", "2", "--kernels", "reference",
                 "--require", "close"]) == 0
    assert "codes         yes" in capsys.readouterr().out
    assert main(["crosscheck", "--stack", "frame", "--context", "8"]) != 0
    assert "--context: not taken by --stack frame" in capsys.readouterr().err
    assert main(["crosscheck", "--stack", "depformer", "--size", "full"]) != 0  # it would run the small sizes
    assert "--size: not taken by --stack depformer" in capsys.readouterr().err
    assert main(["crosscheck", "--stack", "depformer", "--plot", "r.txt"]) != 0  # before the run, not after it
    assert "--plot: expected a .png file name" in capsys.readouterr().err


# ------------------------------------------------------------------------------ construction-time refusals
def test_frames_refuse_twin_on_a_depformer_head_dim_not_a_power_of_two_when_made():
    """The twin frame needs power-of-two head dims in both stacks: a depformer of head dim 12 is refused
    by LMFrame, make_frame_step and frame_fn up front, naming the depformer and its head dim."""
    from jax_impl import frame as jf

    cfg = FRAME_PRESETS["moshi-small"]
    odd = dataclasses.replace(cfg, depformer=dataclasses.replace(cfg.depformer, dim=48, num_heads=4))
    for where, make in (("LMFrame", lambda k: LMFrame.from_config(odd, kernels=k)),
                        ("make_frame_step", lambda k: jf.make_frame_step(odd, kernels=k)),
                        ("frame_fn", lambda k: jf.frame_fn(odd, kernels=k))):
        with pytest.raises(ValueError, match=rf"^{where}\(kernels\): kernels='twin' needs power-of-two head dims "
                                             rf"\(.*\); the depformer stack's is 12 \(head_dim = dim 48 // num_heads 4\)"):
            make("twin")
        make("reference")


def test_init_frame_state_refuses_a_stacks_config_by_name():
    from jax_impl import frame as jf
    from jax_impl.config import PRESETS

    with pytest.raises(TypeError, match=r"^init_frame_state\(cfg\): cfg must be a FrameConfig, got TemporalConfig$"):
        jf.init_frame_state(PRESETS["temporal-small"], 2)
