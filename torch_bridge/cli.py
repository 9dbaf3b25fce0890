"""personaplex-jax: parity and speed tools for the JAX and PyTorch streaming stacks.

commands:
  crosscheck   run the torch path and the JAX path side by side; report, tensor by tensor,
               whether they are bit-identical (max abs / max ULP / first difference)
  stream       stream frames through the torch stacks and print ms/step
  speak        stream a WAV file through the JAX speech frame and write the reply as a WAV

examples:
  personaplex-jax crosscheck                                # small presets on CPU, real sizes on GPU
  personaplex-jax crosscheck --stack mimi-encoder --steps 500 --convention moshi
  personaplex-jax crosscheck --checkpoint model.safetensors --dtype bfloat16 --json report.json
  personaplex-jax crosscheck --require close               # in CI: exit status 3 unless it holds
  personaplex-jax crosscheck --stack codec --steps 50       # the Mimi codec: codes and PCM, frame by frame
  personaplex-jax crosscheck --stack speech-frame --kernels twin   # codec + LM frame, every state tensor
  personaplex-jax speak --input in.wav --output out.wav     # a WAV through the JAX speech frame, the reply out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter

from jax_impl.checkpoint import CheckpointError
from jax_impl.config import RING_CONVENTIONS
from jax_impl.kernel_choice import TORCH_KERNELS

REQUIREMENT_NOT_MET = 3  # exit status of `crosscheck --require` when the run does not meet it


def _int_at_least(minimum: int, what: str, maximum: int | None = None):
    """An argparse type: an int >= minimum (and <= maximum), else "expected a <what> integer, got ..."."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "positive")


def _seed(text: str) -> int:
    """An argparse type: a seed of torch's generators, 0..crosscheck.SEED_MAX."""
    from .crosscheck import SEED_MAX

    return _int_at_least(0, f"64-bit non-negative (0..{SEED_MAX})", SEED_MAX)(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text}")
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
    cc.add_argument("--stack", choices=["temporal", "mimi-encoder", "mimi-decoder", "codec", "depformer", "frame",
                                        "speech-frame"],
                    default="temporal", help="which stack; codec: the whole Mimi codec, frame by frame, codes and "
                    "PCM compared; depformer and frame: the language model's depformer and whole frame "
                    "(PersonaPlex sizes, small on the CPU); speech-frame: codec encode, LM frame, codec decode, "
                    "PCM, codes and every state tensor compared (PersonaPlex's sizes, --size small: its small "
                    "preset, the CPU's default) (default: %(default)s)")
    cc.add_argument("--steps", type=_positive_int, default=None,
                    help="steps to run (default: 300; temporal and Mimi on the CPU with the twin kernels: three "
                         "ring wraps, 72 and 15 steps of the small presets; codec on the CPU with the twin kernels: 8; "
                         "depformer, "
                         "frame and speech-frame: 40, on the CPU with the twin kernels 3, 8 and 6, the Triton "
                         "interpreter taking seconds a frame)")
    cc.add_argument("--batch", type=_positive_int, default=4, help="rows (sessions) (default: %(default)s)")
    cc.add_argument("--frames", type=_positive_int, default=None,
                    help="T, frames per step (default: 1 for temporal, 2 for Mimi)")
    cc.add_argument("--convention", choices=list(RING_CONVENTIONS), default=None,
                    help="ring position convention: 'moshi' for Kyutai Moshi models (a slot is labelled with "
                         "the position it holds, as moshi's RingKVCache: window C), 'personaplex' for NVIDIA "
                         "PersonaPlex (its stepper labels the next write slot with the next position: window "
                         "C-1 once the ring wraps). A model run under the other family's convention diverges "
                         "from its own once the ring wraps (default: personaplex; the codec's transformers "
                         "run moshi's, as both products ship them)"),
    cc.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights, activations and ring (default: %(default)s)")
    cc.add_argument("--size", choices=["auto", "small", "full"], default="auto",
                    help="small presets or real sizes (default: small on CPU, full on GPU)")
    cc.add_argument("--checkpoint", metavar="PATH",
                    help="a Moshi/PersonaPlex safetensors file (released names or a moshi module's "
                         "state_dict() names). Its shapes give dim, num_layers and hidden, text_card "
                         "(temporal) or ffn (Mimi); num_heads, context, max_period and norm_eps come from "
                         "the flags below, else --config, else the preset (--size; full unless --size small). "
                         "num_heads must be given when the file's dim is not the preset's. Pick --convention "
                         "for the file's family: 'moshi' for a Kyutai Moshi file, 'personaplex' for an "
                         "NVIDIA PersonaPlex one")
    cc.add_argument("--config", metavar="FILE.json", dest="config_json",
                    help="a JSON object of TemporalConfig / MimiConfig fields (all but ring_convention: "
                         "--convention) over the preset; flags override it")
    cc.add_argument("--num-heads", type=_positive_int, default=None,
                    help="attention heads (shapes do not show them; default: --config, else the preset)")
    cc.add_argument("--context", type=_positive_int, default=None,
                    help="ring capacity = attention context (default: --config, else the preset)")
    cc.add_argument("--max-period", type=_positive_float, default=None,
                    help="RoPE max period (default: --config, else the preset)")
    cc.add_argument("--norm-eps", type=_positive_float, default=None,
                    help="RMSNorm / LayerNorm epsilon (default: --config, else the preset)")
    cc.add_argument("--kernels", choices=list(TORCH_KERNELS), default=None,
                    help="twin: both paths on the twin kernels (Triton for torch, Pallas for JAX), bit-identical "
                         "and batch-invariant; reference: each framework's plain path, the torch reference "
                         "(bit-exact with moshi) against XLA, close but not bit-identical (default: twin; reference "
                         "for the codec and the speech frame, whose twin kernels run interpreted on the CPU at "
                         "seconds a frame)")
    cc.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    cc.add_argument("--seed", type=_seed, default=0,
                    help="seed of the schedule and weights, >= 0 (default: 0)")
    cc.add_argument("--no-recycle", action="store_true", help="no reset_slot / bump_slot_start / reset_rows")
    cc.add_argument("--threads", type=_positive_int, default=None,
                    help="torch CPU threads for the run (default: 1 for a small stack on the CPU, where "
                         "more threads only fight XLA and other jobs for the cores; else torch's default)")
    cc.add_argument("--require", choices=["identical", "close"], default=None,
                    help="exit with status 3 unless it holds: 'identical': every tensor bit-identical at "
                         "every step; 'close': integer tensors identical, float tensors within max rel "
                         "1e-05 (float32) / 0.05 (bfloat16), greedy tokens equal but at near ties")
    cc.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    cc.add_argument("--plot", metavar="FILE.png",
                    help="plot per-step differences and ms/step (needs matplotlib: pip install -e '.[plot]')")
    cc.add_argument("-q", "--quiet", action="store_true",
                    help="no progress on stderr (a bar on a terminal, else a line every few seconds)")
    sp = sub.add_parser("speak", help="a WAV file through the JAX speech frame, the model's reply to a WAV file",
                        description="Stream a WAV file (mono 16-bit PCM at the codec's rate, 24 kHz in the real "
                                    "sizes) through the JAX speech frame (codec encode, LM frame, codec decode) at "
                                    "12.5 Hz and write the model's reply; print the real-time factor and the "
                                    "per-frame latency. Random weights unless --checkpoint-dir: the reply is then "
                                    "noise from random weights.")
    sp.add_argument("--input", required=True, metavar="IN.wav", help="the user's speech")
    sp.add_argument("--output", required=True, metavar="OUT.wav", help="the model's reply (same rate, 16-bit)")
    sp.add_argument("--checkpoint-dir", metavar="DIR",
                    help="released files: the LM's model.safetensors (Moshi layout) and the Mimi "
                         "tokenizer-*.safetensors, for --preset's sizes (default: random weights)")
    sp.add_argument("--preset", choices=list(_speech_presets()), default=None,
                    help="sizes (default: personaplex on a GPU, personaplex-small on the CPU: seconds a run)")
    sp.add_argument("--kernels", choices=["reference", "twin"], default="reference",
                    help="the JAX step's kernels (default: %(default)s; twin runs interpreted on the CPU)")
    sp.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="weights and state (default: bfloat16 on a GPU, float32 on the CPU)")
    sp.add_argument("--device", default=None, help="torch device of the weights (default: cuda if available)")
    sp.add_argument("--seed", type=_seed, default=0, help="seed of the random weights (default: 0)")
    sp.add_argument("-q", "--quiet", action="store_true",
                    help="no progress on stderr (a bar on a terminal, else a line every few seconds)")
    st = sub.add_parser("stream", help="stream frames through the torch stacks, print ms/step")
    st.add_argument("--steps", type=_positive_int, default=300,
                    help="steps to stream per stack; the median ms/step is printed (default: %(default)s)")
    st.add_argument("--batch", type=_positive_int, default=4, help="rows (sessions) (default: %(default)s)")
    return parser


def _speech_presets():
    from jax_impl.speech_frame_config import SPEECH_PRESETS

    return SPEECH_PRESETS


def _speak(args) -> int:
    from .crosscheck import progress_lines, resolve_device
    from .speak import speak

    if args.kernels == "twin" and resolve_device(args.device, "--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the codec's Pallas twins run interpreted too
    if not os.path.isfile(args.input):
        raise ValueError(f"--input: no such file: {args.input}")
    _check_writable("--output", args.output)
    progress = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        def progress(it):
            return tqdm(it, desc="speak", unit="frame", leave=False)
    elif not args.quiet:
        progress = progress_lines("speak")
    speak(args.input, args.output, preset=args.preset, checkpoint_dir=args.checkpoint_dir, kernels=args.kernels,
          dtype=args.dtype, device=args.device, seed=args.seed, progress=progress)
    return 0


def _crosscheck(args) -> int:
    from jax_impl.state import init_state

    from .crosscheck import crosscheck, default_config, progress_lines, resolve_device

    args.kernels = args.kernels or ("reference" if args.stack in ("codec", "speech-frame") else "twin")
    if args.kernels == "twin" and resolve_device(args.device, "--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton runs on the CPU only interpreted
    progress = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        def progress(it):
            return tqdm(it, desc=f"crosscheck {args.stack}", unit="step", leave=False)
    elif not args.quiet:  # a log or a pipe: a plain line every few seconds
        progress = progress_lines(f"crosscheck {args.stack}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot: expected a .png file name, got {args.plot}")
    if args.plot:
        _require_matplotlib()
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            _check_writable(flag, path)  # now, not after the whole run
    if args.stack in ("depformer", "frame", "speech-frame"):
        return _crosscheck_lm(args, progress)

    device = args.device
    size = args.size
    if size == "auto":
        size = "full" if args.checkpoint or (device or "").startswith("cuda") else "auto"
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        raise ValueError(f"--checkpoint: no such file: {args.checkpoint}")
    if args.stack == "codec":
        report = _crosscheck_codec(args, size, progress)
    else:
        config, note = _crosscheck_config(args, size)
        if note:
            print(note)
        where = resolve_device(device, "--device")
        shapes = config or default_config(args.stack, where)
        _check_batch(args.batch, where, lambda b: init_state(shapes, b, args.dtype))
        report = crosscheck(args.stack, steps=args.steps, batch=args.batch,
                            convention=args.convention or "personaplex", dtype=args.dtype, frames=args.frames,
                            config=config, checkpoint=args.checkpoint, device=device, seed=args.seed,
                            recycle=not args.no_recycle, threads=args.threads, kernels=args.kernels,
                            progress=progress)
    print(report.summary())
    if args.json:
        report.write_json(args.json)
        print(f"report written to {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
    if args.require and not report.holds(args.require):
        print(f"personaplex-jax: --require {args.require} does not hold: "
              f"{'; '.join(report.failures(args.require))}", file=sys.stderr)
        return REQUIREMENT_NOT_MET
    return 0


def _require_matplotlib() -> None:
    """--plot draws with matplotlib, an optional dependency (the package's `plot` extra): refused
    before the run, not after minutes of it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot: matplotlib is not installed; pip install -e '.[plot]' "
                         "(or drop --plot)") from None


def _crosscheck_lm(args, progress) -> int:
    """`crosscheck --stack depformer|frame|speech-frame` (`crosscheck_lm`, `crosscheck_speech_frame`):
    the flags of a stack's config do not apply."""
    import jax

    from jax_impl.frame import init_frame_state
    from jax_impl.frame_config import FRAME_PRESETS
    from jax_impl.speech_frame import init_speech_frame_state
    from jax_impl.speech_frame_config import SPEECH_PRESETS

    from .crosscheck import default_preset, resolve_device
    from .crosscheck_lm import crosscheck_lm
    from .crosscheck_speech import crosscheck_speech_frame

    given = [flag for flag, value in (("--checkpoint", args.checkpoint), ("--config", args.config_json),
                                      ("--convention", args.convention),
                                      ("--frames", args.frames), ("--num-heads", args.num_heads),
                                      ("--context", args.context), ("--max-period", args.max_period),
                                      ("--norm-eps", args.norm_eps)) if value is not None]
    if args.stack != "speech-frame" and args.size != "auto":
        given.append("--size")
    if given:
        raise ValueError(f"{', '.join(given)}: not taken by --stack {args.stack} (it runs PersonaPlex's sizes, "
                         f"small on the CPU)")
    where = resolve_device(args.device, "--device")
    preset = {"auto": None, "small": "personaplex-small", "full": "personaplex"}[args.size]
    lm = FRAME_PRESETS[default_preset(where)]
    if args.stack == "speech-frame":
        cfg = SPEECH_PRESETS[preset or default_preset(where)]
        _check_batch(args.batch, where, lambda b: init_speech_frame_state(cfg, b, args.dtype))
    elif args.stack == "frame":
        _check_batch(args.batch, where, lambda b: init_frame_state(lm, b, args.dtype))
    else:  # the depformer keeps no state between steps; a step's logits: float32 [B, dep_q, card]
        _check_batch(args.batch, where, lambda b: jax.ShapeDtypeStruct((b, lm.depformer.dep_q, lm.depformer.card),
                                                                        "float32"),
                     held="a step's logits, torch's and JAX's")
    if args.stack == "speech-frame":
        report = crosscheck_speech_frame(steps=args.steps, batch=args.batch, dtype=args.dtype, preset=preset,
                                         device=args.device, seed=args.seed, recycle=not args.no_recycle,
                                         threads=args.threads, kernels=args.kernels, progress=progress)
    else:
        report = crosscheck_lm(args.stack, steps=args.steps, batch=args.batch, dtype=args.dtype, device=args.device,
                               seed=args.seed, recycle=not args.no_recycle, threads=args.threads or 1,
                               kernels=args.kernels, progress=progress)
    print(report.summary())
    if args.json:
        report.write_json(args.json)
    if args.plot:
        report.plot(args.plot)
    if args.require and not report.holds(args.require):
        print(f"personaplex-jax: --require {args.require} does not hold: "
              f"{'; '.join(report.failures(args.require))}", file=sys.stderr)
        return REQUIREMENT_NOT_MET
    return 0


def _crosscheck_codec(args, size: str, progress):
    """`crosscheck_codec` from the flags. The transformer stacks' config flags do not apply: the codec's
    config is a preset (--size) or, with --checkpoint, the released Mimi's."""
    from jax_impl.codec import init_codec_state
    from jax_impl.codec_config import CODEC_PRESETS

    from .crosscheck import resolve_device
    from .crosscheck_codec import crosscheck_codec, default_codec_config

    for flag, value in (("--convention", args.convention), ("--frames", args.frames), ("--config", args.config_json),
                        *((_FLAGS[f], getattr(args, f)) for f in _FLAGS)):
        if value is not None:
            raise ValueError(f"{flag}: does not apply to --stack codec (its config is the preset of --size, "
                             f"or the released Mimi's with --checkpoint)")
    config = None if size == "auto" else CODEC_PRESETS["mimi" if size == "full" else "mimi-small"]
    where = resolve_device(args.device, "--device")
    shapes = config or default_codec_config(where)
    _check_batch(args.batch, where, lambda b: init_codec_state(shapes, b, args.dtype))
    steps = args.steps or (8 if args.kernels == "twin" and where == "cpu" else 300)
    return crosscheck_codec(steps=steps, batch=args.batch, dtype=args.dtype, config=config,
                            checkpoint=args.checkpoint, device=args.device, seed=args.seed,
                            recycle=not args.no_recycle, threads=args.threads, kernels=args.kernels,
                            progress=progress)


def _check_writable(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written before the run, not after minutes of it
    (nothing is created: a refused or failed run leaves no empty file behind)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag}: {path} is a directory; expected a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag}: cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag}: cannot write {path}: permission denied")


def _check_batch(batch: int, device: str, arrays, held: str = "its streaming state, torch's and JAX's",
                 copies: int = 2) -> None:
    """Refuse a --batch whose rows cannot fit the device's memory, before anything is allocated (torch's
    allocator would raise, or the system end the run part-way). arrays(b): the JAX arrays of b rows the
    run holds at once, each with a row axis (b rows: b times one row's bytes), as shapes (jax.eval_shape:
    nothing is made); copies: how many times the run holds them (2: torch's and JAX's). Only those are
    counted, against all of the device's memory: a refused run could never fit (one let through may
    still not)."""
    import jax

    row = copies * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: arrays(1))))
    memory = _device_memory(device)
    if batch * row > memory:
        raise ValueError(f"--batch: expected at most {memory // row} rows on {device}, got {batch}: a row takes at "
                         f"least {row:,} bytes ({held}), {batch * row / 2**30:,.1f} GiB in all, more than its "
                         f"{memory / 2**30:,.1f} GiB of memory")


def _device_memory(device: str) -> int:
    """Bytes of memory of a torch device: a GPU's, else the host's (physical memory)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_FLAGS = {"num_heads": "--num-heads", "context": "--context", "max_period": "--max-period",
          "norm_eps": "--norm-eps"}


def _crosscheck_config(args, size: str):
    """(config or None for crosscheck's default, a note saying where each field came from, or None).

    Precedence: the checkpoint's shapes (dim, num_layers, hidden / ffn, text_card: a flag or
    --config value that differs is an error), then the flags, then --config, then the preset
    (`size`: "full", "small", or "auto" for crosscheck's default for the device).
    """
    from jax_impl.checkpoint import infer_config, read_safetensors_shapes
    from jax_impl.config import PRESETS, with_options

    from .crosscheck import STACKS, default_config, resolve_device

    kind = "temporal" if args.stack == "temporal" else "mimi"
    given = {}  # field -> (value, where it came from)
    if args.config_json:
        where = f"--config {args.config_json}"
        given.update((k, (v, where)) for k, v in _read_config_json(args.config_json, kind).items())
    given.update((field, (getattr(args, field), flag)) for field, flag in _FLAGS.items()
                 if getattr(args, field) is not None)
    inferred = {}
    if args.checkpoint:
        shapes = read_safetensors_shapes(args.checkpoint)
        inferred = infer_config(shapes, kind, STACKS[args.stack][0], source=args.checkpoint)
    if not given and not inferred:
        return (None if size == "auto" else PRESETS[kind if size == "full" else f"{kind}-small"]), None
    base = (default_config(args.stack, resolve_device(args.device, "--device")) if size == "auto"
            else PRESETS[kind if size == "full" else f"{kind}-small"])
    preset = next(name for name, c in PRESETS.items() if c is base)
    for field, value in inferred.items():
        if field in given and given[field][0] != value:
            raise ValueError(f"{given[field][1]}: {field}={given[field][0]} contradicts {args.checkpoint}, "
                             f"whose shapes give {field}={value}")
    if inferred and "num_heads" not in given and inferred["dim"] != base.dim:
        raise ValueError(f"--num-heads: required: {args.checkpoint} has dim {inferred['dim']}, and num_heads "
                         f"cannot be inferred from shapes (the {preset} preset's num_heads={base.num_heads} "
                         f"is for dim {base.dim}); pass --num-heads or num_heads in --config")
    sources = {field: where for field, (_, where) in given.items()}
    sources.update(dict.fromkeys(inferred, args.checkpoint))
    config = with_options(base, **{k: v for k, (v, _) in given.items()}, **inferred)
    by_source: dict[str, list[str]] = {}
    for f in dataclasses.fields(config):
        if f.name != "ring_convention":
            where = sources.get(f.name, f"the {preset} preset")
            by_source.setdefault(where, []).append(f"{f.name}={getattr(config, f.name)}")
    return config, "config: " + "; ".join(f"from {where}: {', '.join(v)}" for where, v in by_source.items())


def _read_config_json(path: str, kind: str) -> dict:
    """The fields of a --config JSON object, checked against TemporalConfig / MimiConfig: every
    name known, ints as ints, floats as numbers (an int is taken exactly as a float)."""
    from jax_impl.checkpoint import unique_keys
    from jax_impl.config import MimiConfig, TemporalConfig

    cls = TemporalConfig if kind == "temporal" else MimiConfig
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=unique_keys(f"--config {path}"))
    except OSError as err:
        raise ValueError(f"--config: cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path}: not UTF-8 text (JSON is): byte {err.object[err.start]:#04x} "
                         f"at offset {err.start}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--config {path}: not JSON: {err}") from None
    fields = [f.name for f in dataclasses.fields(cls) if f.name != "ring_convention"]
    if not isinstance(data, dict):

        raise ValueError(f"--config {path}: expected a JSON object of {cls.__name__} fields, "  # noqa: TRY004
                         f"got {type(data).__name__}")
    if "ring_convention" in data:
        raise ValueError(f"--config {path}: ring_convention is set by --convention, not in the file")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"--config {path}: unknown {cls.__name__} field(s) {unknown}; its fields: {fields}")
    out = {}
    for name, value in data.items():
        want_float = isinstance(getattr(cls, name), float)
        ok = isinstance(value, (int, float) if want_float else int) and not isinstance(value, bool)
        if not ok or (want_float and not (math.isfinite(float(value)) and float(value) == value)):
            what = "a finite number" if want_float else "an integer"
            raise ValueError(f"--config {path}: {name} must be {what}, got {value!r}")
        out[name] = float(value) if want_float else value
    return out


def _stream(args) -> int:
    import jax
    import torch

    from jax_impl.config import PRESETS
    from jax_impl.state import init_state

    from .model import MimiTransformer, TemporalStreaming

    runs = (("temporal-small", 1), ("mimi-small", 2))
    for name, T in runs:  # one stack at a time: its state and its --steps inputs, torch's only
        config = PRESETS[name]
        _check_batch(args.batch, "cpu", lambda b, c=config, T=T: (
            init_state(c, b), jax.ShapeDtypeStruct((args.steps, b, T, c.dim), "float32")),
            held=f"its state and {args.steps} steps' inputs", copies=1)
    torch.manual_seed(0)
    print(f"{'stack':<16}{'T':>3}{'steps':>7}{'torch ms/step':>15}")
    for name, T in runs:
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
        return {"crosscheck": _crosscheck, "speak": _speak, "stream": _stream}[args.command](args)
    except KeyboardInterrupt:
        print("personaplex-jax: interrupted", file=sys.stderr)
        return 130
    except (ValueError, CheckpointError, OSError) as err:
        # What a user can cause: bad values (ValueError), checkpoints that do not fit or cannot be
        # read (CheckpointError), files (OSError). Anything else is a bug: its traceback shows.
        print(f"personaplex-jax: error: {_one_line(err)}", file=sys.stderr)
        return 1


def _one_line(err: Exception) -> str:
    """A multi-line report (a checkpoint's every bad key) as one line: its heads, how many problems of
    each kind, the first. A CheckpointError's `problems` are counted, not its message's lines: the
    message may summarize a kind in one line (`check_fit`), add advice, and join the reports of
    several parts (a codec's convolutions and transformers), each under a head of its own."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    heads = [line.rstrip(":") for line in lines if not line[0].isspace()]
    items = list(getattr(err, "problems", ())) or [line.strip() for line in lines if line[0].isspace()]
    if not items:
        return "; ".join(heads)
    kinds = Counter(item.partition(": ")[0] for item in items)  # the kind: the text before the first ': '
    counts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    return f"{'; '.join(heads)}: {counts} (first: {items[0]})"


if __name__ == "__main__":
    sys.exit(main())
