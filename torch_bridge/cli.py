"""`personaplex-jax`: the project's command line.

    personaplex-jax stream [--steps N] [--batch B]   stream frames through the small presets
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from personaplex_config import PRESETS

from .stacks import MimiTransformer, TemporalStreaming


def _stream(args) -> int:
    torch.manual_seed(0)
    rows = []
    for name, T in (("temporal-small", 1), ("mimi-small", 2)):
        config = PRESETS[name]
        cls = TemporalStreaming if name.startswith("temporal") else MimiTransformer
        stack = cls.from_config(config)
        stack.streaming_init(args.batch)
        frames = torch.randn(args.steps, args.batch, T, config.dim)
        times = []
        for x in frames:
            t0 = time.perf_counter()
            stack.step(x)
            times.append(time.perf_counter() - t0)
        times.sort()
        rows.append((name, T, args.steps, 1e3 * times[len(times) // 2]))
    print(f"{'stack':<16}{'T':>3}{'steps':>7}{'torch ms/step':>15}")
    for name, T, steps, ms in rows:
        print(f"{name:<16}{T:>3}{steps:>7}{ms:>15.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="personaplex-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    stream = sub.add_parser("stream", help="stream frames through the small presets, print ms/step")
    stream.add_argument("--steps", type=int, default=300)
    stream.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    return _stream(args)


if __name__ == "__main__":
    sys.exit(main())
