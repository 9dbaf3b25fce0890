"""The language-model frame by batch size, against moshi's `LMGen` in the same run.

    python -m benchmarks.frame_bench --out $OUT                # frame_bench.json (one H200, ~8 minutes)
    python -m benchmarks.frame_bench --dep-q 8 --out $OUT      # Moshi's 8 inner steps instead of PersonaPlex's 16
    python -m benchmarks.frame_bench --small --out /tmp/fb     # CPU smoke run (small presets)

bf16, random weights, real sizes (depformer dim 1024, 6 layers, 16 heads, hidden 2816, card 2048,
8 weight sets; the temporal 7B with every slot of its 3000-slot ring visible, offsets at capacity).
For each B of --batches (default 1,4,16,64), one record

    {stack, B, dep_q, kernels, pallas_backend, sync_ms, pipelined_ms, floor_ms, floor_every_step_ms,
     kernels_per_frame, kernels_per_inner_step, compile_s, output_digest, public_graph_ms, public_eager_ms,
     public_kernels_per_frame, public_note, device, date, versions}

(codec records also `sync_interleaved_ms`, `public_interleaved_ms`: below)

- stack "depformer": the JAX depformer frame (`make_depformer_step(cfg, kernels)`, host checks
  included, greedy) for each of --kernels (twin, reference) on fixed inputs (a text token and a
  temporal output per row);
- stack "frame": the whole JAX LM frame (`make_frame_step(kernels="twin")`, state donated: the
  temporal step and the depformer on their twins);
- stack "codec": the Mimi codec's encode + decode of one 80 ms frame (`codec.encode_fn` then
  `decode_fn`, one jitted program, state donated, the encoder's codes decoded) for each of --kernels,
  the codec's state after a warm start (its rings fill over the timed frames); public: moshi's
  streaming `MimiModel` (`get_mimi(None, ...)`, random weights and codebooks, bf16 on the GPU)
  `decode(encode(pcm))` under `streaming(B)`: public_graph_ms with moshi's own CUDA graphs (an
  outer graph cannot capture it: moshi graphs parts of it itself), public_eager_ms without; and,
  where moshi is importable, ours and moshi's (its graphs) called in turn --steps times each after the
  other measurements, sync_interleaved_ms and public_interleaved_ms the medians: their ratio is the
  one the host's drift between measurements does not move (moshi's codec took 4.2-6.2 ms in one run
  and 7.3-11.7 in another the same day);
- stack "speech-frame": the whole JAX speech frame (`make_speech_frame_step(kernels="twin")`: codec
  encode, LM frame, codec decode), the LM's ring full and its delays passed (every frame decodes);
  no public figure (moshi's is the sum of its codec's and its `LMGen.step`'s: the two stacks above);
- sync_ms: median of synchronized frames (outputs ready before the next frame, waited for by
  `jax_impl.until_ready` on the output: `timing.time_step`, `timing.time_call`); pipelined_ms: frames launched back to back, one wait (mean); after the
  first call (compile_s) --warmup frames (5), then --steps timed (30); --quick: 2 and 10;
- floor_ms: the weight bytes a frame must read at the copy rate measured in this run (bytes read +
  written per second, `timing.copy_bandwidth`): each distinct depformer weight set once (8), and for
  the frame also the temporal weights and its ring; floor_every_step_ms: the same with each inner
  step reading its own set (dep_q set reads, moshi's layout); the embedding rows gathered are not counted;
- pallas_backend: the Pallas GPU backend of the JAX side's kernels (`kernels_pallas.backend`); with
  `--pallas-backends triton,mosaic_gpu` every JAX case runs on each in turn, in the same process, and
  output_digest (sha256 of the first call's outputs, from the same inputs and state) says whether the
  two gave the same bits;
- kernels_per_frame: CUDA kernels of one frame (torch.profiler, which sees JAX's kernels too);
  kernels_per_inner_step: the depformer's / dep_q;
- public_*: moshi's own stepper in the same run (`moshi` 0.2.13's `LMModel` with these sizes,
  dep_q weight sets as PersonaPlex's loader makes them, random bf16 weights, greedy): for "depformer", `LMGen.depformer_step` (its `forward_depformer`
  loop) wrapped in `moshi.utils.compile.CUDAGraphed` as `LMGen` wraps it; for "frame",
  `LMGen.step` with its own CUDA graphs (its ring's offsets at capacity). public_graph_ms: median
  of synchronized calls (call + `torch.cuda.synchronize`, host-timed as sync_ms is); public_eager_ms:
  the same without CUDA graphs (`no_cuda_graph()`); public_kernels_per_frame: the eager call's
  kernels. moshi's torch.compile of its norms and gating is on, as on CUDA by default
  (`--moshi-no-compile`: off). moshi is imported without its `__init__` (`tests.moshi_oracle`);
  where it is missing the public fields are null and `public_note` says why.

moshi runs first, then its model and graphs are released (torch hands its memory back) and JAX's side
runs: the two 7B models and their rings do not fit on one H200 together at B=64, and JAX's allocator
may keep what it took.
Then `sessions_in_80ms`: the largest measured B whose synchronized frame fits 80 ms (ours and
moshi's; and the speech frame's, ours). A case that fails (e.g. out of memory) is recorded under `errors`; one not started for
lack of time (--time-budget) under `skipped`. The JSON is rewritten after every case. Never part of
the tests. On the CPU (--small) the GPU-only fields are null.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib.metadata
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")  # rings of 50 GB: scale_bench says why
if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:  # the deprecated name; both set is an error
    os.environ.setdefault("XLA_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_impl
from benchmarks.scale_bench import full_state, profile_step
from benchmarks.timing import (
    copy_bandwidth,
    host_ms,
    interleaved_medians_us,
    kernel_profile,
    run_meta,
    synchronized_step,
    time_call,
    time_step,
)
from jax_impl import codec as jax_codec
from jax_impl import frame as jax_frame
from jax_impl import speech_frame as jax_speech
from jax_impl.codec_config import CodecConfig
from jax_impl.depformer_config import DepformerConfig, buffer_shapes
from jax_impl.frame_config import FRAME_PRESETS, FrameConfig
from jax_impl.speech_frame_config import SPEECH_PRESETS, SpeechFrameConfig
from kernels_pallas import backend
from torch_bridge import Depformer, LMFrame, to_jax
from torch_bridge.codec import MimiCodec
from torch_bridge.frame import jax_frame_params
from torch_bridge.speech_frame import SpeechFrame

STACKS = ("depformer", "frame", "codec", "speech-frame")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16
FRAME_BUDGET_MS = 80.0  # one frame of 12.5 Hz audio
# a record's fields measured on the JAX side (null where that side was not measured)
OURS_FIELDS = ("kernels", "pallas_backend", "output_digest", "sync_ms", "pipelined_ms", "floor_ms", "floor_every_step_ms", "kernels_per_frame",
               "kernels_per_inner_step", "compile_s")
PER_SET = ("in_proj", "out_proj", "linear_in", "linear_out", "depformer_in", "linears")  # [.., weight_sets, ..]


def digest(outputs) -> str:
    """sha256 of the bits of every array in `outputs` (a pytree), in order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(outputs):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def release() -> None:
    """Hand back what Python no longer holds and torch's cached blocks (graphs' pools included)."""
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()


def depformer_floor_bytes(cfg: DepformerConfig, itemsize: int) -> tuple[int, int]:
    """(distinct, every_step): the depformer weight bytes one frame reads, each distinct weight set
    once, or each inner step its own set (`step_sets`); the norms' scales each time a set is read.
    The embedding tables are not counted (a gather reads B rows of them)."""
    shapes = buffer_shapes(cfg)
    set_elems = sum(int(np.prod(shapes[name])) for name in PER_SET) // cfg.weight_sets
    norm_elems = int(np.prod(shapes["norm1_alpha"])) + int(np.prod(shapes["norm2_alpha"]))
    per_set = itemsize * (set_elems + norm_elems)
    return len(set(cfg.step_sets)) * per_set, len(cfg.step_sets) * per_set


def versions() -> dict:
    try:
        moshi_version = importlib.metadata.version("moshi")
    except importlib.metadata.PackageNotFoundError:
        moshi_version = None
    return {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"), "torch": torch.__version__,
            "moshi": moshi_version}


# ----------------------------------------------------------------------------- moshi (public)
def moshi_model(lm, cfg: FrameConfig, temporal_layers: int):
    """moshi's `LMModel` with the frame's sizes (as moshi's loaders build the 7B, PersonaPlex's dep_q and
    16 weight sets: its loader's copies), `temporal_layers` temporal layers, every weight ~ N(0, 0.02)
    and the norms' scales 1, bf16 on DEVICE. Built on the meta device first: no weights made twice."""
    t, d = cfg.temporal, cfg.depformer
    with torch.device("meta"):
        model = lm.LMModel(
            delays=list(cfg.delays), n_q=cfg.n_q, dep_q=cfg.dep_q, card=cfg.card, text_card=cfg.text_card,
            dim=t.dim, num_heads=t.num_heads, num_layers=temporal_layers, hidden_scale=t.hidden * 3 / 2 / t.dim,
            norm="rms_norm_f32", gating="silu", positional_embedding="rope", max_period=t.max_period, causal=True,
            layer_scale=None, context=t.context, depformer_dim=d.dim, depformer_dim_feedforward=d.hidden * 3 // 2,
            depformer_num_heads=d.num_heads, depformer_num_layers=d.num_layers, depformer_multi_linear=True,
            depformer_pos_emb="none", depformer_weights_per_step=True, device="meta", dtype=DTYPE)
    model = model.to_empty(device=DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("alpha"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def fill_moshi_ring(transformer, capacity: int) -> None:
    """Every slot of moshi's streaming rings visible (offsets at capacity). Its attention reads the
    whole ring whatever the fill; this makes the mask a full ring's too."""
    transformer._streaming_state.offsets.fill_(capacity)
    for layer in transformer.layers:
        mha = layer.self_attn._streaming_state
        mha.kv_cache.end_offset.fill_(capacity)
        mha.offset.fill_(capacity)


def time_moshi(call, warmup: int, steps: int, eager_steps: int, mcompile) -> dict:
    """public_graph_ms (GPU only), public_eager_ms, public_kernels_per_frame (GPU only) of `call()`
    (which goes through moshi's `CUDAGraphed`: warmed up, captured, then replayed)."""
    graph_ms = kernels = None
    if GPU:
        for _ in range(max(warmup, 3)):  # CUDAGraphed: one eager call (torch.compile's), the capture, replays
            call()
        sync()
        graph_ms = host_ms(lambda: (call(), sync()), steps)
    with mcompile.no_cuda_graph():
        call()
        sync()
        eager_ms = host_ms(lambda: (call(), sync()), eager_steps)
        if GPU:
            kernels = kernel_profile(call)[0]
    return {"public_graph_ms": graph_ms, "public_eager_ms": eager_ms, "public_kernels_per_frame": kernels}


@torch.no_grad()
def moshi_depformer(lm, mcompile, model, cfg: FrameConfig, B: int, args) -> dict:
    """moshi's depformer frame, `CUDAGraphed(LMGen.depformer_step)` as `LMGen` runs it, on fixed inputs."""
    gen = lm.LMGen(model, use_sampling=False)
    graphed = mcompile.CUDAGraphed(gen.depformer_step, disable=not GPU)
    g = torch.Generator(device=DEVICE).manual_seed(B)
    text = torch.randint(0, cfg.text_card, (B,), device=DEVICE, generator=g)
    out = torch.randn(B, 1, cfg.temporal.dim, device=DEVICE, generator=g).to(DTYPE)
    return time_moshi(lambda: graphed(text, out), args.warmup, args.steps, args.eager_steps, mcompile)


@torch.no_grad()
def moshi_frame(lm, mcompile, model, cfg: FrameConfig, B: int, args) -> dict:
    """moshi's `LMGen.step` (its own CUDA graphs), its ring full."""
    gen = lm.LMGen(model, use_sampling=False)
    g = torch.Generator(device=DEVICE).manual_seed(B)
    user = torch.randint(0, cfg.card, (B, cfg.user_codebooks, 1), device=DEVICE, generator=g)
    with gen.streaming(B):  # its rings and graphs go when the streaming ends
        fill_moshi_ring(model.transformer, cfg.temporal.capacity)
        return time_moshi(lambda: gen.step(user), args.warmup, args.steps, args.eager_steps, mcompile)


@contextlib.contextmanager
def moshi_codec_call(codec_cfg: CodecConfig, B: int):
    """moshi's streaming `MimiModel` (random weights and codebooks; bf16 on the GPU, float32 on the
    CPU): `decode(encode(pcm))` of one frame as a call, inside its `streaming(B)`."""
    from tests.moshi_oracle import moshi_mimi

    mimi = moshi_mimi(codec_cfg).to(device=DEVICE, dtype=DTYPE if GPU else torch.float32)
    pcm = torch.randn(B, 1, codec_cfg.frame_size, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(B))
    pcm = pcm.to(next(mimi.parameters()).dtype)
    with torch.no_grad(), mimi.streaming(B):
        yield lambda: mimi.decode(mimi.encode(pcm))


def moshi_codec(codec_cfg: CodecConfig, B: int, args, mcompile) -> dict:
    """moshi's codec frame (`moshi_codec_call`), its own CUDA graphs / eager."""
    with moshi_codec_call(codec_cfg, B) as call:
        return time_moshi(call, args.warmup, args.steps, args.eager_steps, mcompile)


def run_public(cfg: FrameConfig, stacks: list[str], batches: list[int], args, public: dict, errors: dict,
               past_budget, codec_cfg: CodecConfig) -> str | None:
    """moshi's depformer and frame for each B into `public[(stack, B)]`; returns a note for every public
    field where moshi is missing, else None."""
    os.environ["NO_TORCH_COMPILE"] = "1" if args.moshi_no_compile or not GPU else ""  # read when moshi is imported
    try:
        from tests.moshi_oracle import moshi_lm_module

        lm = moshi_lm_module()
        import moshi.utils.compile as mcompile
    except ImportError as err:
        return f"moshi not importable: {err}"
    if "codec" in stacks:
        for B in batches:
            name = f"public_codec_B{B}"
            if past_budget(name, public=True):
                continue
            try:
                public[("codec", B)] = moshi_codec(codec_cfg, B, args, mcompile)
            except Exception as err:  # noqa: BLE001 (recorded)
                errors[name] = f"{type(err).__name__}: {err}"[:1000]
                print("error", name, errors[name], flush=True)
            release()
            print(name, public.get(("codec", B)), flush=True)
    lm_stacks = [stack for stack in stacks if stack in ("depformer", "frame")]
    if not lm_stacks:
        return None
    try:
        model = moshi_model(lm, cfg, cfg.temporal.num_layers if "frame" in stacks else 1)
    except Exception as err:  # noqa: BLE001 (recorded)
        release()
        return f"moshi's LMModel could not be built: {type(err).__name__}: {err}"[:1000]
    for stack in lm_stacks:
        for B in batches:
            name = f"public_{stack}_B{B}"
            if past_budget(name, public=True):
                continue
            try:
                run = moshi_depformer if stack == "depformer" else moshi_frame
                public[(stack, B)] = run(lm, mcompile, model, cfg, B, args)
            except Exception as err:  # noqa: BLE001 (recorded: out of memory at B=64 is a result)
                errors[name] = f"{type(err).__name__}: {err}"[:1000]
                print("error", name, errors[name], flush=True)
            release()  # the case's generator, graphs and rings
            print(name, public.get((stack, B)), flush=True)
    del model
    release()
    return None


# ----------------------------------------------------------------------------- ours (JAX)
def bench_depformer(cfg: DepformerConfig, batches: list[int], kernels: list[str], args, bandwidth, emit,
                    errors: dict, past_budget) -> None:
    """The JAX depformer frame for each B and kernels; `emit(record)` each."""
    dep = Depformer.from_config(cfg, dtype=DTYPE, device=DEVICE)
    dep.init_weights(generator=torch.Generator(device=DEVICE).manual_seed(0))
    params = jax_impl.check_depformer_params(cfg, {k: to_jax(w) for k, w in dep.weights().items()})
    distinct, every = depformer_floor_bytes(cfg, DTYPE.itemsize)
    floors = {"floor_ms": None, "floor_every_step_ms": None} if bandwidth is None else {
        "floor_ms": 1e3 * distinct / bandwidth, "floor_every_step_ms": 1e3 * every / bandwidth}
    for kind in kernels:
        step = jax_impl.make_depformer_step(cfg, kernels=kind)
        for B in batches:
            name = f"depformer_{kind}_B{B}"
            if past_budget(name):
                continue
            try:
                emit({"stack": "depformer", "B": B, "dep_q": cfg.dep_q, "kernels": kind,
                      **time_depformer(step, params, cfg, B, args), **floors})
            except Exception as err:  # noqa: BLE001 (recorded)
                errors[name] = f"{type(err).__name__}: {err}"[:1000]
                print("error", name, errors[name], flush=True)


def time_depformer(step, params, cfg: DepformerConfig, B: int, args) -> dict:
    """sync_ms, pipelined_ms, kernels_per_frame (GPU), kernels_per_inner_step, compile_s of a JAX
    depformer `step` on fixed random inputs (text tokens, temporal outputs) of batch B."""
    k1, k2 = jax.random.split(jax.random.key(B))
    text = jax.random.randint(k1, (B,), 0, cfg.text_card, jnp.int32)
    x = jax.random.normal(k2, (B, 1, cfg.temporal_dim), jnp.bfloat16)
    t0 = time.perf_counter()
    first = jax_impl.until_ready(step(params, text, x))
    compile_s = time.perf_counter() - t0
    sync_ms, pipelined_ms = time_call(lambda: step(params, text, x), args.steps, args.warmup)
    launches = kernel_profile(lambda: jax_impl.until_ready(step(params, text, x)))[0] if GPU else None
    return {"sync_ms": sync_ms, "pipelined_ms": pipelined_ms, "kernels_per_frame": launches,
            "kernels_per_inner_step": None if launches is None else launches / cfg.dep_q, "compile_s": compile_s,
            "output_digest": digest(first)}


def frame_state(cfg: FrameConfig, B: int) -> jax_frame.FrameState:
    """A frame state with the temporal ring full (`scale_bench.full_state`: every slot visible), the
    token cache holding token 0 and the frame offsets past the delays (every stream read from the cache)."""
    temporal = full_state(cfg.temporal, B)
    cache = jnp.zeros((B, cfg.num_codebooks, cfg.cache_len), jnp.int32)
    return jax_frame.FrameState(temporal, cache, jnp.full((B,), cfg.temporal.capacity, temporal.offset.dtype))


def bench_frame(cfg: FrameConfig, batches: list[int], args, bandwidth, emit, errors: dict, past_budget) -> None:
    """The whole JAX LM frame for each B; `emit(record)` each."""
    kernels = "twin"
    frame = LMFrame.from_config(cfg, dtype=DTYPE, device=DEVICE)  # weights ~ N(0, 0.02), norms 1
    params = jax_frame_params(frame)
    step = jax_impl.make_frame_step(cfg, kernels=kernels, rope_freqs=frame.temporal.rope_freqs())
    temporal_bytes = sum(int(w.nbytes) for w in frame.temporal.weights().values())
    distinct, every = depformer_floor_bytes(cfg.depformer, DTYPE.itemsize)
    for B in batches:
        name = f"frame_B{B}"
        if past_budget(name):
            continue
        state = None
        try:
            state = frame_state(cfg, B)
            ring_bytes = int(state.temporal.k.nbytes + state.temporal.v.nbytes)
            user = jnp.zeros((B, cfg.user_codebooks), jnp.int32)
            active = jnp.ones((B,), bool)
            t0 = time.perf_counter()
            out, state = step(params, state, user, active)
            jax_impl.until_ready((out, state))
            compile_s, first = time.perf_counter() - t0, digest(out)
            sync_ms, pipelined_ms, state = time_step(step, params, state, user, active, args.steps,
                                                     warmup=args.warmup)
            launches, _, state = profile_step(step, params, state, user, active)
            floors = {"floor_ms": None, "floor_every_step_ms": None} if bandwidth is None else {
                "floor_ms": 1e3 * (temporal_bytes + ring_bytes + distinct) / bandwidth,
                "floor_every_step_ms": 1e3 * (temporal_bytes + ring_bytes + every) / bandwidth}
            emit({"stack": "frame", "B": B, "dep_q": cfg.dep_q, "kernels": kernels,
                  "sync_ms": sync_ms, "pipelined_ms": pipelined_ms,
                  **floors, "kernels_per_frame": launches, "kernels_per_inner_step": None, "compile_s": compile_s,
                  "output_digest": first})
        except Exception as err:  # noqa: BLE001 (recorded: a case that fails, e.g. out of memory, is a result)
            errors[name] = f"{type(err).__name__}: {err}"[:1000]
            print("error", name, errors[name], flush=True)
        del state
        release()


def bench_codec(cfg: CodecConfig, batches: list[int], kernels: list[str], args, emit, errors: dict,
                past_budget, moshi: bool) -> None:
    """The JAX codec's encode + decode of one frame, one jitted program, for each kernels and B; with
    `moshi` (importable), each also called in turn with moshi's (`interleaved_with_moshi`)."""
    codec = MimiCodec.from_config(cfg, dtype=DTYPE, device=DEVICE)
    codec.init_weights(generator=torch.Generator(device=DEVICE).manual_seed(0))
    params = codec.jax_params()
    for kind in kernels:
        encode = jax_codec.encode_fn(cfg, kernels=kind, rope_freqs=codec.rope_freqs())
        decode = jax_codec.decode_fn(cfg, kernels=kind, rope_freqs=codec.rope_freqs())

        def codec_frame(params, state, pcm, active, encode=encode, decode=decode):
            codes, state = encode(params, state, pcm, active)
            return decode(params, state, codes, active)

        step = jax.jit(backend.traced_on(codec_frame), donate_argnums=(1,))
        for B in batches:
            name = f"codec_{kind}_B{B}"
            if past_budget(name):
                continue
            state = None
            try:
                state = jax_codec.init_codec_state(cfg, B, jnp.bfloat16)
                pcm = jax.random.normal(jax.random.key(B), (B, 1, cfg.frame_size), jnp.bfloat16)
                active = jnp.ones((B,), bool)
                record, state = time_stateful(step, params, state, pcm, active, args)
                ours, theirs, state = (interleaved_with_moshi(step, params, state, pcm, active, cfg, B, args)
                                       if moshi else (None, None, state))
                emit({"stack": "codec", "B": B, "dep_q": None, "kernels": kind, **record,
                      "sync_interleaved_ms": ours, "public_interleaved_ms": theirs,
                      "floor_ms": None, "floor_every_step_ms": None, "kernels_per_inner_step": None})
            except Exception as err:  # noqa: BLE001 (recorded)
                errors[name] = f"{type(err).__name__}: {err}"[:1000]
                print("error", name, errors[name], flush=True)
            del state
            release()


def interleaved_with_moshi(step, params, state, pcm, active, cfg: CodecConfig, B: int, args):
    """(ours, moshi's, state): the medians, ms, of our synchronized codec frame and moshi's
    (`moshi_codec_call`, its CUDA graphs, then synchronized) called in turn, args.steps times each
    (`timing.interleaved_medians_us`): the host's drift, which moved moshi's codec by 2x between runs,
    hits both alike. moshi's CUDA graphs are captured first, with JAX idle: torch captures in CUDA's
    global mode, which a CUDA call of JAX's threads (its allocator freeing a step's buffers) breaks."""
    jax.block_until_ready(state)
    ours, holder = synchronized_step(step, params, state, pcm, active)
    with moshi_codec_call(cfg, B) as call:
        for _ in range(3):  # moshi's graphs: captured by the third call
            call()
            sync()
        medians = interleaved_medians_us({"ours": ours, "moshi": lambda: (call(), sync())}, args.steps,
                                         warmup=args.warmup)
    return medians["ours"] / 1e3, medians["moshi"] / 1e3, holder["state"]


def time_stateful(step, params, state, x, active, args) -> tuple[dict, object]:
    """({compile_s, sync_ms, pipelined_ms, kernels_per_frame (GPU), output_digest}, the state after them) of
    a donated `step(params, state, x, active)`."""
    t0 = time.perf_counter()
    out, state = step(params, state, x, active)
    jax_impl.until_ready((out, state))
    compile_s, first = time.perf_counter() - t0, digest(out)
    sync_ms, pipelined_ms, state = time_step(step, params, state, x, active, args.steps, warmup=args.warmup)
    launches, _, state = profile_step(step, params, state, x, active)
    return {"sync_ms": sync_ms, "pipelined_ms": pipelined_ms, "kernels_per_frame": launches,
            "compile_s": compile_s, "output_digest": first}, state


def bench_speech_frame(cfg: SpeechFrameConfig, batches: list[int], args, emit, errors: dict, past_budget) -> None:
    """The whole JAX speech frame on the twin kernels for each B, the LM's ring full (`frame_state`)."""
    kernels = "twin"
    frame = SpeechFrame.from_config(cfg, dtype=DTYPE, device=DEVICE)
    frame.codec.init_weights(generator=torch.Generator(device=DEVICE).manual_seed(0))  # the LM's: N(0, 0.02)
    params = frame.jax_params()
    codec_freqs, lm_freqs = frame.rope_freqs()
    step = jax_speech.make_speech_frame_step(cfg, kernels=kernels, codec_rope_freqs=codec_freqs,
                                             lm_rope_freqs=lm_freqs)
    for B in batches:
        name = f"speech-frame_B{B}"
        if past_budget(name):
            continue
        state = None
        try:
            state = jax_speech.SpeechFrameState(jax_codec.init_codec_state(cfg.codec, B, jnp.bfloat16),
                                                frame_state(cfg.lm, B))
            pcm = jax.random.normal(jax.random.key(B), (B, 1, cfg.frame_size), jnp.bfloat16)
            record, state = time_stateful(step, params, state, pcm, jnp.ones((B,), bool), args)
            emit({"stack": "speech-frame", "B": B, "dep_q": cfg.lm.dep_q, "kernels": kernels, **record,
                  "floor_ms": None, "floor_every_step_ms": None, "kernels_per_inner_step": None})
        except Exception as err:  # noqa: BLE001 (recorded)
            errors[name] = f"{type(err).__name__}: {err}"[:1000]
            print("error", name, errors[name], flush=True)
        del state
        release()


# ----------------------------------------------------------------------------- results
def sessions_in_80ms(records: list[dict], pallas_backend: str) -> dict:
    """The largest measured B whose synchronized frame (ours on `pallas_backend`; moshi's `LMGen.step`
    under its CUDA graphs) fits in 80 ms; and our whole speech frame's."""
    records = [r for r in records if r.get("pallas_backend") in (pallas_backend, None)]
    speech = {r["B"]: r["sync_ms"] for r in records if r["stack"] == "speech-frame" and r["sync_ms"] is not None}
    frames = [r for r in records if r["stack"] == "frame"]
    ours = {r["B"]: r["sync_ms"] for r in frames if r["sync_ms"] is not None}
    public = {r["B"]: r["public_graph_ms"] for r in frames if r["public_graph_ms"] is not None}

    def largest(ms_by_b):
        fits = [B for B, ms in ms_by_b.items() if ms <= FRAME_BUDGET_MS]
        return max(fits) if fits else None

    return {"frame_ms_by_B": ours, "largest_B": largest(ours), "public_frame_ms_by_B": public,
            "public_largest_B": largest(public), "speech_frame_ms_by_B": speech, "speech_largest_B": largest(speech)}


def merge(ours: list[dict], public: dict, public_note: str | None, dep_q: int, meta: dict) -> list[dict]:
    """Each of our records with moshi's figures of its (stack, B), then a record for each (stack, B)
    measured by moshi only (ours failed or was skipped), all with the run's device, date, versions."""
    empty = {"public_graph_ms": None, "public_eager_ms": None, "public_kernels_per_frame": None}
    out = []
    for r in ours:
        got = public.get((r["stack"], r["B"]))
        note = public_note or (None if got else "not measured (see errors / skipped)")
        out.append({**r, **(got or empty), "public_note": note, **meta})
    measured = {(r["stack"], r["B"]) for r in ours}
    for (stack, B), got in public.items():
        if (stack, B) not in measured:
            out.append({"stack": stack, "B": B, "dep_q": dep_q, **dict.fromkeys(OURS_FIELDS), **got,
                        "public_note": None, **meta})
    return out


def table(records: list[dict]) -> str:
    cols = ("stack", "B", "dep_q", "kernels", "pallas_backend", "sync_ms", "pipelined_ms", "floor_ms", "floor_every_step_ms",
            "kernels_per_frame", "kernels_per_inner_step", "public_graph_ms", "public_eager_ms",
            "public_kernels_per_frame", "sync_interleaved_ms", "public_interleaved_ms")

    def cell(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [cols] + [tuple(cell(r.get(c)) for c in cols) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for frame_bench.json")
    parser.add_argument("--batches", default=None, help="batch sizes (default 1,4,16,64; --small: 1,4)")
    parser.add_argument("--dep-q", type=int, default=16, choices=(16, 8),
                        help="inner steps a frame: 16 (PersonaPlex) or 8 (Moshi)")
    parser.add_argument("--kernels", default="twin,reference", help="the JAX depformer's and codec's kernels to time")
    parser.add_argument("--stacks", default=",".join(STACKS),
                        help="what to time, a comma-separated subset of depformer, frame, codec, speech-frame "
                             "(default: all)")
    parser.add_argument("--warmup", type=int, default=5, help="synchronized warm-up frames after the first call")
    parser.add_argument("--steps", type=int, default=30, help="timed frames per measurement")
    parser.add_argument("--eager-steps", type=int, default=5, help="timed frames of moshi without CUDA graphs")
    parser.add_argument("--quick", action="store_true", help="2 warm-up, 10 timed, 2 eager frames")
    parser.add_argument("--small", action="store_true", help="small presets on the CPU (a smoke run)")
    parser.add_argument("--no-public", action="store_true", help="no moshi part")
    parser.add_argument("--moshi-no-compile", action="store_true",
                        help="moshi without torch.compile of its norms and gating (its default on CUDA is on)")
    parser.add_argument("--pallas-backends", default=None,
                        help="the JAX side's Pallas GPU backends, each in turn (comma-separated: triton, mosaic_gpu; "
                             "default: the one kernels_pallas.backend chooses now)")
    parser.add_argument("--time-budget", type=float, default=450.0,
                        help="seconds: no case starts past it (moshi's past half of it); those are listed as skipped")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.eager_steps = 2, 10, 2
    if args.small:
        args.warmup, args.steps, args.eager_steps = min(args.warmup, 1), min(args.steps, 3), min(args.eager_steps, 2)
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.small else "1,4,16,64")).split(",") if b]
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.stacks = [s for s in args.stacks.split(",") if s]
    bad = [s for s in args.stacks if s not in STACKS]
    if bad or not args.stacks:
        parser.error(f"--stacks: expected a comma-separated subset of {', '.join(STACKS)}, got {bad or 'nothing'}")
    args.pallas_backends = (args.pallas_backends or backend.gpu_backend()).split(",")
    bad = [b for b in args.pallas_backends if b not in backend.BACKENDS]
    if bad:
        parser.error(f"--pallas-backends: expected a comma-separated subset of {', '.join(backend.BACKENDS)}, got {bad}")
    bad = [k for k in args.kernels if k not in ("twin", "reference")]
    if bad:
        parser.error(f"--kernels: expected a comma-separated subset of twin, reference, got {bad}")
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches: expected positive batch sizes, got {args.batches}")
    return args


def main() -> None:
    args = parse_args()
    if not GPU and not args.small:
        raise SystemExit("frame_bench.py: no CUDA device; pass --small for the CPU smoke run")
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    ours, public, errors, skipped = [], {}, {}, {}  # our records, moshi's (stack, B) -> figures, name -> why

    def past_budget(name: str, public: bool = False) -> bool:
        """Whether case `name` is past its time (moshi's: half the budget); if so it is listed under skipped."""
        budget = args.time_budget * (0.5 if public else 1.0)
        elapsed = time.monotonic() - start
        if elapsed > budget:
            skipped[name] = f"not started: {elapsed:.0f} s elapsed, past its budget of {budget:.0f} s (--time-budget)"
        return elapsed > budget

    preset = ("personaplex" if args.dep_q == 16 else "moshi") + ("-small" if args.small else "")
    cfg = FRAME_PRESETS[preset]
    speech_cfg = SPEECH_PRESETS[preset]  # real sizes: this LM frame with the Mimi codec; small: its own small LM
    bandwidth = copy_bandwidth() if GPU else None
    meta = run_meta()
    meta = {"device": meta["device"], "date": meta["date"], "versions": versions()}
    public_note = "not run (--no-public)" if args.no_public else None
    path = os.path.join(args.out, "frame_bench.json")

    def write() -> list[dict]:
        records = merge(ours, public, public_note, cfg.dep_q, meta)
        result = {"records": records, "sessions_in_80ms": sessions_in_80ms(records, args.pallas_backends[0]),
                  "copy_TBps": None if bandwidth is None else bandwidth / 1e12, "preset": preset,
                  "warmup": args.warmup, "steps": args.steps, "eager_steps": args.eager_steps,
                  "moshi_torch_compile": GPU and not args.moshi_no_compile, "errors": errors, "skipped": skipped,
                  "elapsed_s": time.monotonic() - start}
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
        return records

    def emit(record: dict) -> None:
        ours.append(record)
        print(record, flush=True)
        write()

    if not args.no_public:
        public_note = run_public(cfg, args.stacks, args.batches, args, public, errors, past_budget, speech_cfg.codec)
        write()
    for name in args.pallas_backends:  # each stack's factories made, and traced, on this backend
        with backend.use(name):
            def on_backend(record: dict, name=name) -> None:
                emit({**record, "pallas_backend": name})

            def budget(case: str, name=name) -> bool:
                return past_budget(f"{case}_{name}")

            def run(bench, *before, name=name, **options) -> None:
                """bench(*before, on_backend, failed, budget, **options); its failures into `errors`, named
                with the backend, written as it returns."""
                failed = {}
                bench(*before, on_backend, failed, budget, **options)
                errors.update({f"{case}_{name}": why for case, why in failed.items()})
                write()
                release()

            if "depformer" in args.stacks:
                run(bench_depformer, cfg.depformer, args.batches, args.kernels, args, bandwidth)
            if "frame" in args.stacks:
                run(bench_frame, cfg, args.batches, args, bandwidth)
            if "codec" in args.stacks:
                run(bench_codec, speech_cfg.codec, args.batches, args.kernels, args,
                    moshi=not args.no_public and public_note is None)
            if "speech-frame" in args.stacks:
                run(bench_speech_frame, speech_cfg, args.batches, args)
    records = write()
    print(table(records))
    print(json.dumps(sessions_in_80ms(records, args.pallas_backends[0])))
    if errors or skipped:
        print("errors:", list(errors), "skipped:", list(skipped))
    print(f"{time.monotonic() - start:.0f} s; {path}", flush=True)


if __name__ == "__main__":
    main()
