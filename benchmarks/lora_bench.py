"""LoRA fine-tuning of the 7B temporal stack, against the same LoRA on moshi's own torch transformer,
and what a gradient costs against the forward.

    python -m benchmarks.lora_bench --out $OUT              # lora_bench.json (one H200)
    python -m benchmarks.lora_bench --small --out /tmp/lb   # CPU smoke run (temporal-small)

A training step, the same on both sides: the temporal stack with bf16 frozen weights ~ N(0, 0.02)
(norms 1), random; LoRA of rank 16 (--rank), scale 2, on the in-projection and the FFN's linear_in
and linear_out of every layer; a batch of B=4 (--batch) sequences of 64 frames (--frames) of teacher
forcing: the stack's input x [B, 64, dim] (random: the embeddings' sum a frame) and one target text
token a frame (random: the next text token); the loss is the text head's cross-entropy (logits in
float32) at every frame, mean over B x 64; its gradient w.r.t. the adapters; global-norm clip 1 and
AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1: moshi-finetune's) on float32 adapters.

- moshi (runs first, then released): moshi 0.2.13's `StreamingTransformer` with the 7B sizes, its
  out norm and a text linear, the 64 frames as one sequence (its non-streaming forward, as
  moshi-finetune trains); LoRA as moshi-finetune puts it: `moshi.modules.lora.replace_all_linear_with_lora`
  on each layer's in-projection (a fused Linear: q, k and v adapted) and gating (linear_in,
  linear_out), A kaiming-uniform, B zero, bf16 adapters whose gradients go to float32 master copies
  for the clip and AdamW, copied back after the step (its mixed precision). Torch autograd, without
  and with moshi's per-layer `checkpointing` (torch.utils.checkpoint).
- JAX: `jx.step_fn(cfg, kernels)` with `jax_impl.lora` adapters (float32, on the in-projection's q
  and v rows and linear_in, linear_out); the whole train step (loss, gradient, clip, AdamW) one
  jitted call, the adapters and optimizer state donated. Modes: "sequence", the 64 frames in one
  step call (T=64: the weights read once a pass); "streamed", a `lax.scan` of 64 T=1 steps (the
  weights read once a frame, forward and backward); each without and with `remat_layers`. The ring:
  capacity = context = --context (default: the frames): a fresh stream of 64 frames sees every
  position at any context >= 64, so the outputs are the 7B's at its context 3000 (--context 3000:
  the serving ring; each streamed frame's backward then keeps a 6 GB ring: it does not fit).

Each case: step_ms, the median of --steps synchronized steps after the first (compile_s) and --warmup
more; frames_per_s = B * frames * 1000 / step_ms; peak_gb (torch `max_memory_allocated`, reset per
case; JAX `peak_bytes_in_use`, each JAX case in a process of its own so the peak is its own);
loss_first / loss_last (the loss falls). `speedup`: moshi's best step_ms over ours, per JAX case.

Gradient cost (`grad_cost`): one streamed step (T=1) at B on the 7B's serving ring (context 3000,
every slot visible), for each of --kernels and each gradient, a process each: forward_ms (the
loss, jitted) and fwd_bwd_ms (`value_and_grad` of the same loss, jitted), w.r.t. the adapters
("lora": the forward with them; the backward computes input gradients through the frozen weights)
or w.r.t. the weights, the rings and x ("full": the plain forward; what a streamed backward through
time needs); ratio = fwd_bwd_ms / forward_ms, against the usual bound of 3. A kernel without a
derivative (or refusing the adapters: "twin") is an error recorded under `errors`. A case that fails (out of memory) is recorded under `errors`; one not started
for lack of time (--time-budget) under `skipped`. The JSON is rewritten after every case. Never part of
the tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card
if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
    os.environ.setdefault("XLA_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jax_impl as jx
from benchmarks.frame_bench import versions
from benchmarks.scale_bench import full_state
from benchmarks.timing import host_ms, run_meta

GPU = torch.cuda.is_available()
MODES = ("sequence", "streamed")
GRAD_WRT = ("lora", "full")
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM, SCALE = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0, 2.0


def train_config(args) -> jx.TemporalConfig:
    base = jx.PRESETS["temporal-small" if args.small else "temporal"]
    return jx.with_options(base, context=args.context or args.frames)


def batch(cfg, args) -> tuple[np.ndarray, np.ndarray]:
    """(x float32 [B, frames, dim], targets int32 [B, frames]) of a fixed seed, in numpy (the moshi side
    makes no JAX array on the card); each side rounds x to bf16 (to nearest even: the same values)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((args.batch, args.frames, cfg.dim), np.float32)
    return x, rng.integers(0, cfg.text_card, (args.batch, args.frames), np.int32)


def random_params(cfg) -> dict:
    """bf16 variables ~ N(0, 0.02), norms 1, made leaf by leaf in bf16 (no float32 copy of a 12 GB
    stacked weight, which would be the process's peak)."""
    shapes = jax.eval_shape(lambda: jx.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes))))

    def make(path, leaf):
        if str(path[-1].key).endswith("alpha"):
            return jnp.ones(leaf.shape, jnp.bfloat16)
        return jax.jit(lambda k: jax.random.normal(k, leaf.shape, jnp.bfloat16) * 0.02)(next(keys))

    return jax.tree_util.tree_map_with_path(make, shapes)


def peak_gb() -> float | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else stats["peak_bytes_in_use"] / 1e9


def text_loss(logits, targets):
    """Mean cross-entropy of logits [..., V] (float32) against targets [...]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


# ----------------------------------------------------------------------------- JAX
def jax_train(cfg, args, mode: str, remat: bool) -> dict:
    """One JAX training case: the jitted train step timed synchronized."""
    params = random_params(cfg)
    state = jx.init_state(cfg, args.batch, jnp.bfloat16)
    x, targets = (jnp.asarray(a, t) for a, t in zip(batch(cfg, args), (jnp.bfloat16, jnp.int32), strict=True))
    lora = jx.init_lora(cfg, jax.random.key(1), args.rank, scale=SCALE)
    opt = optax.chain(optax.clip_by_global_norm(MAX_NORM),
                      optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY))
    step = jx.step_fn(cfg, kernels="reference", remat_layers=remat)

    def loss_fn(lora, params, state, x, targets):
        p = jx.with_lora(params, lora)
        if mode == "sequence":
            (_, logits), _ = step(p, state, x)
            return text_loss(logits[:, 0], targets)

        def frame(st, xt):
            (_, logits), st = step(p, st, xt[:, None])
            return st, logits[:, 0, 0]

        _, logits = jax.lax.scan(frame, state, x.swapaxes(0, 1))  # [frames, B, V]
        return text_loss(logits, targets.swapaxes(0, 1))

    def train_step(lora, opt_state, params, state, x, targets):
        loss, grads = jax.value_and_grad(loss_fn)(lora, params, state, x, targets)
        updates, opt_state = opt.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    jitted = jax.jit(train_step, donate_argnums=(0, 1))
    held = {"lora": lora, "opt": opt.init(lora), "losses": []}

    def one():
        held["lora"], held["opt"], loss = jitted(held["lora"], held["opt"], params, state, x, targets)
        jx.until_ready((loss, held["lora"]))
        held["losses"].append(float(loss))

    t0 = time.perf_counter()
    one()
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        one()
    ms = host_ms(one, args.steps)
    return {"side": "jax", "mode": mode, "remat": remat, "step_ms": ms, "compile_s": compile_s,
            "peak_gb": peak_gb(), "loss_first": held["losses"][0], "loss_last": held["losses"][-1]}


def jax_grad_cost(cfg, args, kernels: str, wrt: str) -> dict:
    """forward_ms and fwd+bwd of the loss of one T=1 step on a full serving ring: w.r.t. the adapters
    (the forward with them), or w.r.t. the weights, the rings and x (the forward without)."""
    params = random_params(cfg)
    state = full_state(cfg, args.batch)
    x = jax.random.normal(jax.random.key(2), (args.batch, 1, cfg.dim), jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(3), (args.batch, 1), 0, cfg.text_card, jnp.int32)
    step = jx.step_fn(cfg, kernels=kernels)

    def loss(params, k, v, x):
        (_, logits), _ = step(params, state._replace(k=k, v=v), x)
        return text_loss(logits[:, 0], targets)

    if wrt == "lora":
        lora = jx.init_lora(cfg, jax.random.key(1), args.rank, scale=SCALE)
        # the frozen weights an argument, not a closure: captured, XLA would embed 14 GB of constants
        fn, operands, argnums = (lambda lora, p, *rest: loss(jx.with_lora(p, lora), *rest)), (lora, params), 0
    else:
        fn, operands, argnums = loss, (params,), (0, 1, 2, 3)
    operands += (state.k, state.v, x)
    forward, grad = jax.jit(fn), jax.jit(jax.value_and_grad(fn, argnums=argnums))
    fwd_ms = timed(lambda: forward(*operands), args)[0]
    ms, compile_s = timed(lambda: grad(*operands), args)
    return {"kernels": kernels, "grad_wrt": wrt, "B": args.batch, "context": cfg.context, "forward_ms": fwd_ms,
            "fwd_bwd_ms": ms, "ratio": ms / fwd_ms, "bound": 3.0, "compile_s": compile_s, "peak_gb": peak_gb()}


def timed(call, args) -> tuple[float, float]:
    """(median synchronized ms after the first call and --warmup more, the first call's seconds)."""
    t0 = time.perf_counter()
    jx.until_ready(call())
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        jx.until_ready(call())
    return host_ms(lambda: jx.until_ready(call()), args.steps), compile_s


def child(args) -> None:
    """One JAX case (--case), its record(s) printed as the last line of stdout (JSON)."""
    kind, a, b = args.case.split(":")
    if kind == "train":
        out = jax_train(train_config(args), args, a, b == "remat")
    else:
        out = jax_grad_cost(jx.PRESETS["temporal-small" if args.small else "temporal"], args, a, b)
    print(json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- moshi (public)
def moshi_train(cfg, args, checkpointing: bool) -> dict:
    """moshi's StreamingTransformer with LoRA, trained as moshi-finetune does (module docstring)."""
    from tests.moshi_oracle import moshi_lm_module

    moshi_lm_module()  # registers the moshi package without its __init__
    from moshi.modules import lora as mlora
    from moshi.modules import transformer as mtr

    device, dtype = ("cuda" if GPU else "cpu"), torch.bfloat16
    with torch.device("meta"):
        model = mtr.StreamingTransformer(
            d_model=cfg.dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers, dim_feedforward=cfg.hidden * 3 // 2,
            causal=True, context=cfg.context, positional_embedding="rope", max_period=cfg.max_period,
            norm="rms_norm_f32", gating="silu", layer_scale=None, checkpointing=checkpointing, device="meta",
            dtype=dtype)
    model = model.to_empty(device=device)
    out_norm = mtr.create_norm_fn("rms_norm_f32", cfg.dim, device=device)
    text_linear = torch.nn.Linear(cfg.dim, cfg.text_card, bias=False, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), ("text_linear", text_linear.weight)]:
            if name.endswith("alpha"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for layer in model.layers:
            mlora.replace_all_linear_with_lora(layer.self_attn.in_projs, args.rank, SCALE)
            mlora.replace_all_linear_with_lora(layer.gating, args.rank, SCALE)
    for p in [*model.parameters(), *out_norm.parameters(), text_linear.weight]:
        p.requires_grad_(False)
    trainable = []
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, mlora.LoRALinear):
                torch.nn.init.kaiming_uniform_(m.lora_A.weight, a=5 ** 0.5, generator=g)
                torch.nn.init.zeros_(m.lora_B.weight)
                trainable += [m.lora_A.weight.requires_grad_(True), m.lora_B.weight.requires_grad_(True)]
    masters = [p.detach().float().requires_grad_(True) for p in trainable]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    model.train()
    x, targets = batch(cfg, args)
    x, targets = torch.from_numpy(x).to(device, dtype), torch.from_numpy(targets).to(device, torch.long)
    losses = []

    def one():
        logits = text_linear(out_norm(model(x)))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        for p, m in zip(trainable, masters, strict=True):
            m.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(trainable, masters, strict=True):
                p.copy_(m)
        losses.append(loss.item())  # synchronizes

    if GPU:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    one()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        one()
    ms = host_ms(one, args.steps)
    peak = torch.cuda.max_memory_allocated() / 1e9 if GPU else None
    return {"side": "moshi", "mode": "sequence", "remat": checkpointing, "step_ms": ms, "compile_s": first_s,
            "peak_gb": peak, "loss_first": losses[0], "loss_last": losses[-1]}


def release() -> None:
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- driver
def run_child(case: str) -> dict:
    """A JAX case in a process of its own (its peak memory its own: JAX's cannot be reset); its record."""
    cmd = [sys.executable, "-m", "benchmarks.lora_bench", *sys.argv[1:], "--case", case]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {done.returncode}: " + " | ".join(tail))
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for lora_bench.json")
    parser.add_argument("--small", action="store_true", help="temporal-small on the CPU (a smoke run)")
    parser.add_argument("--batch", type=int, default=None, help="B (default 4; --small: 2)")
    parser.add_argument("--frames", type=int, default=None, help="frames a sequence (default 64; --small: 8)")
    parser.add_argument("--rank", type=int, default=None, help="LoRA rank (default 16; --small: 4)")
    parser.add_argument("--context", type=int, default=None, help="the training ring's context (default: --frames)")
    parser.add_argument("--modes", default="sequence,streamed", help="JAX modes: sequence, streamed")
    parser.add_argument("--remat", default="off,on", help="JAX remat_layers / moshi checkpointing: off, on")
    parser.add_argument("--kernels", default="reference", help="the gradient cost's kernels (reference, pallas, twin)")
    parser.add_argument("--parts", default="moshi,jax,grad_cost", help="what to run: moshi, jax, grad_cost")
    parser.add_argument("--warmup", type=int, default=2, help="synchronized steps after the first, untimed")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--moshi-no-compile", action="store_true", help="moshi without its torch.compile")
    parser.add_argument("--time-budget", type=float, default=540.0, help="seconds: no case starts past it")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child's JAX case
    args = parser.parse_args(argv)
    small = args.small
    args.batch = args.batch or (2 if small else 4)
    args.frames = args.frames or (8 if small else 64)
    args.rank = args.rank or (4 if small else 16)
    if small:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    for name, allowed in (("modes", MODES), ("remat", ("off", "on")), ("parts", ("moshi", "jax", "grad_cost")),
                          ("kernels", ("reference", "pallas", "twin"))):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"--{name}: expected a comma-separated subset of {', '.join(allowed)}, got {bad or 'nothing'}")
        setattr(args, name, values)
    for name in ("batch", "frames", "rank", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive int, got {getattr(args, name)}")
    if args.context is not None and args.context < args.frames:
        parser.error(f"--context: must hold the {args.frames} frames, got {args.context}")
    return args


def main() -> None:
    args = parse_args()
    if args.case:
        child(args)
        return
    if not GPU and not args.small:
        raise SystemExit("lora_bench.py: no CUDA device; pass --small for the CPU smoke run")
    os.environ["NO_TORCH_COMPILE"] = "1" if args.moshi_no_compile or not GPU else ""  # read at moshi's import
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lora_bench.json")
    start = time.monotonic()
    cfg = train_config(args)
    meta = run_meta()
    result = {"device": meta["device"], "date": meta["date"], "versions": versions(),
              "setup": {"preset": "temporal-small" if args.small else "temporal", "B": args.batch,
                        "frames": args.frames, "context": cfg.context, "rank": args.rank, "scale": SCALE,
                        "loss": "text head cross-entropy at every frame, mean over B x frames",
                        "optimizer": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY,
                                      "clip_global_norm": MAX_NORM},
                        "warmup": args.warmup, "steps": args.steps,
                        "moshi_torch_compile": GPU and not args.moshi_no_compile},
              "train": [], "speedup": {}, "grad_cost": [], "errors": {}, "skipped": {}}

    def write():
        moshi = [r["step_ms"] for r in result["train"] if r["side"] == "moshi"]
        result["speedup"] = {f"{r['mode']}_remat_{r['remat']}": min(moshi) / r["step_ms"]
                             for r in result["train"] if r["side"] == "jax" and moshi}
        result["elapsed_s"] = time.monotonic() - start
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    def case(name: str, run) -> None:
        elapsed = time.monotonic() - start
        if elapsed > args.time_budget:
            result["skipped"][name] = f"not started: {elapsed:.0f} s elapsed, past --time-budget {args.time_budget:.0f}"
            return
        try:
            run()
        except Exception as err:  # noqa: BLE001 (recorded: out of memory, a kernel without a derivative)
            result["errors"][name] = f"{type(err).__name__}: {err}"[:1000]
            print("error", name, result["errors"][name], flush=True)
        release()
        write()

    def add_train(record: dict) -> None:
        record.update(B=args.batch, frames=args.frames, context=cfg.context, rank=args.rank,
                      frames_per_s=args.batch * args.frames * 1e3 / record["step_ms"])
        result["train"].append(record)
        print(record, flush=True)

    if "moshi" in args.parts:
        for remat in args.remat:
            case(f"moshi_checkpointing_{remat}", lambda r=remat: add_train(moshi_train(cfg, args, r == "on")))
    if "jax" in args.parts:
        for mode in args.modes:
            for remat in args.remat:
                case(f"jax_{mode}_remat_{remat}", lambda m=mode, r=remat: add_train(
                    run_child(f"train:{m}:{'remat' if r == 'on' else 'plain'}")))
    if "grad_cost" in args.parts:
        for kernels in args.kernels:
            for wrt in GRAD_WRT:
                case(f"grad_cost_{kernels}_{wrt}", lambda k=kernels, w=wrt: result["grad_cost"].append(
                    run_child(f"grad:{k}:{w}")))
    write()
    for r in result["train"]:
        print(f"{r['side']:5} {r['mode']:9} remat={r['remat']!s:5} {r['step_ms']:9.1f} ms  "
              f"{r['frames_per_s']:8.1f} frames/s  peak {r['peak_gb']} GB  loss {r['loss_first']:.4f} -> "
              f"{r['loss_last']:.4f}")
    for r in result["grad_cost"]:
        print(f"grad {r['kernels']} wrt {r['grad_wrt']}: forward {r['forward_ms']:.2f} ms, fwd+bwd "
              f"{r['fwd_bwd_ms']:.2f} ms = {r['ratio']:.2f}x (bound 3)")
    print(json.dumps(result["speedup"]), "errors:", list(result["errors"]), "skipped:", list(result["skipped"]))
    print(f"{time.monotonic() - start:.0f} s; {path}", flush=True)


if __name__ == "__main__":
    main()
