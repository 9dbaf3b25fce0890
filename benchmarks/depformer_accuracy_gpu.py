"""The depformer's bfloat16 codes against a float32 run of the same weights: how often the twin
depformer (JAX, Pallas twins) and moshi's own depformer (its operations: the torch reference path,
`Depformer(kernels="reference")`, bit-exact with moshi's `LMModel` depformer, tests/test_depformer.py)
pick the float32 run's token, each in bfloat16.

    python -m benchmarks.depformer_accuracy_gpu --out DIR            # GPU: real sizes (PersonaPlex, 16 steps)
    python -m benchmarks.depformer_accuracy_gpu --small --out /tmp/da  # CPU smoke run (small preset)

Random bf16 weights (N(0, --std), the norm scales at 1) and inputs (text tokens, temporal outputs
~ N(0, 1)), greedy. The float32 run is the torch reference path on the bf16 weights upcast (TF32
off), free-running: its codes are the frame's answer. Each bfloat16 depformer is then
**teacher-forced** with those codes (`audio_tokens` = the float32 codes, all provided), so every
inner step sees the float32 run's inputs and each step's agreement counts that step's own
rounding; free-running, the first disagreement of a row would change every later step's input
and the rate would measure how errors propagate, differently for each depformer.

Per depformer: agree (codes equal to the float32 run's) of codes (frames x B x dep_q), rate, and
of the disagreements how many sit at a near tie of the float32 logits (top-2 gap under
--tie of the row's largest |logit|). JSON: DIR/depformer_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import torch

import jax_impl
from benchmarks.timing import run_meta
from jax_impl.depformer_config import DEPFORMER_PRESETS, DepformerConfig
from torch_bridge import Depformer, to_jax

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def twin_codes(step, params, text, out, forced) -> torch.Tensor:
    """The JAX twin depformer's codes [B, dep_q], teacher-forced with `forced` [B, dep_q]."""
    provided = torch.ones_like(forced, dtype=torch.bool)
    codes, _ = step(params, to_jax(text.int()), to_jax(out), to_jax(forced.int()), to_jax(provided))
    return torch.from_numpy(np.array(codes)).long()


def tally(name: str, codes: torch.Tensor, want: torch.Tensor, gap: torch.Tensor, tie: float, acc: dict) -> None:
    """Adds a frame's agreement of `codes` with `want` (and the near ties among its disagreements) to acc[name]."""
    a = acc.setdefault(name, {"agree": 0, "codes": 0, "disagree_near_tie": 0})
    same = codes.cpu() == want.cpu()
    a["agree"] += int(same.sum())
    a["codes"] += same.numel()
    a["disagree_near_tie"] += int((~same & (gap.cpu() < tie)).sum())


def measure(cfg: DepformerConfig, frames: int, B: int, std: float, tie: float, seed: int) -> dict:
    """{depformer: {agree, codes, rate, disagree_near_tie}} over `frames` frames of B rows."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dep = Depformer.from_config(cfg, dtype=torch.bfloat16, device=DEVICE)
    dep.init_weights(std=std, generator=g)
    ref = Depformer.from_config(cfg, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        for name, w in ref.weights().items():
            w.copy_(dep.weights()[name].float())
    params = jax_impl.check_depformer_params(cfg, {k: to_jax(w) for k, w in dep.weights().items()})
    step = jax_impl.make_depformer_step(cfg, kernels="twin")
    acc: dict = {}
    for _ in range(frames):
        text = torch.randint(0, cfg.text_card + 1, (B,), generator=g, device=DEVICE)
        out = torch.randn(B, 1, cfg.temporal_dim, generator=g, device=DEVICE).to(torch.bfloat16)
        want, logits = ref(text, out.float(), return_logits=True)                       # free-running float32
        top2 = logits.topk(2, dim=-1).values
        gap = (top2[..., 0] - top2[..., 1]) / logits.abs().amax(dim=-1).clamp_min(1e-30)  # [B, dep_q]
        provided = torch.ones_like(want, dtype=torch.bool)
        tally("jax_twin_bf16", twin_codes(step, params, text, out, want), want, gap, tie, acc)
        tally("moshi_ops_bf16", dep(text, out, want, provided), want, gap, tie, acc)
    for a in acc.values():
        a["rate"] = a["agree"] / a["codes"]
    return acc


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="directory of depformer_accuracy.json")
    parser.add_argument("--small", action="store_true", help="the small preset on the CPU (a smoke run)")
    parser.add_argument("--dep-q", type=int, default=16, choices=(8, 16), help="16: PersonaPlex, 8: Moshi")
    parser.add_argument("--frames", type=int, default=None, help="frames (default 64; --small: 2)")
    parser.add_argument("--batch", type=int, default=None, help="rows a frame (default 64; --small: 2)")
    parser.add_argument("--std", type=float, default=0.02, help="the weights' standard deviation")
    parser.add_argument("--tie", type=float, default=1e-2, help="a near tie: top-2 gap under this of the row's scale")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not GPU and not args.small:
        raise SystemExit("depformer_accuracy_gpu.py: no CUDA device; pass --small for the CPU smoke run")
    if args.frames is not None and args.frames < 1 or args.batch is not None and args.batch < 1:
        parser.error("--frames and --batch must be >= 1")
    frames = args.frames or (2 if args.small else 64)
    B = args.batch or (2 if args.small else 64)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 run in float32
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    preset = ("personaplex" if args.dep_q == 16 else "moshi") + ("-small" if args.small else "")
    cfg = DEPFORMER_PRESETS[preset]
    t0 = time.perf_counter()
    results = measure(cfg, frames, B, args.std, args.tie, args.seed)
    record = {**run_meta(), "preset": preset, "frames": frames, "B": B, "dep_q": cfg.dep_q, "std": args.std,
              "tie": args.tie, "mode": "teacher-forced", "reference": "torch reference path, float32",
              "depformers": results, "seconds": round(time.perf_counter() - t0, 1)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "depformer_accuracy.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    for name, a in results.items():
        print(f"{name:16s} {a['agree']}/{a['codes']} = {100 * a['rate']:.2f}% agree with float32 "
              f"({a['disagree_near_tie']} of the {a['codes'] - a['agree']} others at a near tie)")
    print(f"wrote {path}")


if __name__ == "__main__":
    jnp.zeros(())  # JAX's backend up before torch takes the GPU's memory
    main()
