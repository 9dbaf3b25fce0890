"""personaplex-jax: parity and speed tools for the JAX and PyTorch streaming stacks.

commands:
  crosscheck   run the torch path and the JAX path side by side; report, tensor by tensor,
               whether they are bit-identical (max abs / max ULP / first difference)
  stream       stream frames through the torch stacks and print ms/step

examples:
  personaplex-jax crosscheck                                # small presets on CPU, real sizes on GPU
  personaplex-jax crosscheck --stack mimi-encoder --steps 500 --convention moshi
  personaplex-jax crosscheck --checkpoint model.safetensors --dtype bfloat16 --json report.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jax_impl.config import RING_CONVENTIONS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="personaplex-jax", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cc = sub.add_parser("crosscheck", help="torch vs JAX, tensor by tensor, on one schedule",
                        description="Run the torch path and the JAX path side by side on one schedule of "
                                    "inputs, active masks and recycle operations, and report for each tensor "
                                    "whether the two are bit-identical.")
    cc.add_argument("--stack", choices=["temporal", "mimi-encoder", "mimi-decoder"], default="temporal",
                    help="which stack (default: %(default)s)")
    cc.add_argument("--steps", type=_positive_int, default=300, help="steps to run (default: %(default)s)")
    cc.add_argument("--batch", type=_positive_int, default=4, help="rows (sessions) (default: %(default)s)")
    cc.add_argument("--frames", type=_positive_int, default=None,
                    help="T, frames per step (default: 1 for temporal, 2 for Mimi)")
    cc.add_argument("--convention", choices=list(RING_CONVENTIONS), default="personaplex",
                    help="ring position convention (default: %(default)s)")
    cc.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights, activations and ring (default: %(default)s)")
    cc.add_argument("--size", choices=["auto", "small", "full"], default="auto",
                    help="small presets or real sizes (default: small on CPU, full on GPU)")
    cc.add_argument("--checkpoint", metavar="PATH",
                    help="a Moshi/PersonaPlex safetensors file (implies --size full unless given)")
    cc.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    cc.add_argument("--seed", type=int, default=0, help="seed of the schedule and weights (default: 0)")
    cc.add_argument("--no-recycle", action="store_true", help="no reset_slot / bump_slot_start / reset_rows")
    cc.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    cc.add_argument("--plot", metavar="FILE.png", help="plot per-step differences and ms/step")
    cc.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    st = sub.add_parser("stream", help="stream frames through the torch stacks, print ms/step")
    st.add_argument("--steps", type=_positive_int, default=300)
    st.add_argument("--batch", type=_positive_int, default=4)
    return parser


def _crosscheck(args) -> int:
    from jax_impl.config import PRESETS

    from .crosscheck import crosscheck

    device = args.device
    size = args.size
    if size == "auto":
        size = "full" if args.checkpoint or (device or "").startswith("cuda") else "auto"
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        raise ValueError(f"--checkpoint: no such file: {args.checkpoint}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot: expected a .png file name, got {args.plot}")
    config = None
    if size != "auto":
        kind = "temporal" if args.stack == "temporal" else "mimi"
        config = PRESETS[kind if size == "full" else f"{kind}-small"]
    progress = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        def progress(it):
            return tqdm(it, desc=f"crosscheck {args.stack}", unit="step", leave=False)

    report = crosscheck(args.stack, steps=args.steps, batch=args.batch, convention=args.convention,
                        dtype=args.dtype, frames=args.frames, config=config, checkpoint=args.checkpoint,
                        device=device, seed=args.seed, recycle=not args.no_recycle, progress=progress)
    print(report.summary())
    if args.json:
        report.write_json(args.json)
        print(f"report written to {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _stream(args) -> int:
    import torch

    from jax_impl.config import PRESETS

    from .stacks import MimiTransformer, TemporalStreaming

    torch.manual_seed(0)
    print(f"{'stack':<16}{'T':>3}{'steps':>7}{'torch ms/step':>15}")
    for name, T in (("temporal-small", 1), ("mimi-small", 2)):
        config = PRESETS[name]
        cls = TemporalStreaming if name.startswith("temporal") else MimiTransformer
        stack = cls.from_config(config)
        stack.streaming_init(args.batch)
        times = []
        for x in torch.randn(args.steps, args.batch, T, config.dim):
            t0 = time.perf_counter()
            stack.step(x)
            times.append(time.perf_counter() - t0)
        print(f"{name:<16}{T:>3}{args.steps:>7}{1e3 * sorted(times)[len(times) // 2]:>15.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _crosscheck(args) if args.command == "crosscheck" else _stream(args)
    except KeyboardInterrupt:
        print("personaplex-jax: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, KeyError, OSError, RuntimeError) as err:
        print(f"personaplex-jax: error: {_one_line(str(err))}", file=sys.stderr)
        return 1


def _one_line(message: str) -> str:
    """A multi-line report (a checkpoint's every bad key) as one line: head, counts, first item."""
    head, *items = [line.strip() for line in message.splitlines() if line.strip()]
    if not items:
        return head
    kinds = {}
    for item in items:
        kinds.setdefault(item.split(":")[0], []).append(item)
    counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
    return f"{head.rstrip(':')}: {counts} (first: {items[0]})"


if __name__ == "__main__":
    sys.exit(main())
