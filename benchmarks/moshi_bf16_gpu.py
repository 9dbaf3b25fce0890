"""Our torch path against moshi's StreamingTransformer on the GPU, bf16, real sizes.

Builds our stack (ring convention "moshi") and moshi's with the same weights (ours exported in the
Moshi checkpoint layout and loaded into moshi), steps both --steps times on the same random inputs and
active masks, and compares the active rows with torch.equal at every step.

Every op of both paths is recorded (F.linear inputs and outputs, rms_norm / layer_norm, RoPE, the SDPA
inputs and output, each layer's output), in execution order; at the first step where anything differs,
the first differing record names the op. Also recorded: the SDPA backend each side gets
(`torch._fused_sdp_choice`), the attention and GEMM kernels each side launches at a few steps (profiler),
a rerun of our SDPA and linears on the same inputs (determinism), and where RoPE tables computed other
ways (on the CPU, in float64) first differ from torch's CUDA cos/sin.

--part eager:    moshi with its torch.compile off (`no_compile()`, as NO_TORCH_COMPILE=1): same kernels
                 as ours is possible.
--part compiled: moshi as it runs on CUDA by default (its `_rms_norm`, `apply_rope` and gating kernel
                 go through torch.compile / Inductor); distance per step, and each compiled function
                 against its eager self on the same inputs.

    python -m benchmarks.moshi_bf16_gpu --out DIR [--part eager|compiled] [--stacks temporal,mimi]

Writes DIR/moshi_bf16_gpu_<part>.json and prints a summary. Not part of the test suite
(tests/test_torch_vs_moshi_gpu.py is the test).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BACKENDS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
KERNEL_WORDS = ("fmha", "flash", "attention", "attn", "cudnn", "gemm", "gemv", "nvjet", "cutlass", "xmma",
                "splitk", "sm90", "sm80", "triton")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--part", choices=["eager", "compiled", "sdpa"], default="eager")
    p.add_argument("--sdpa", choices=["default", "no-cudnn"], default="default",
                   help="no-cudnn: both paths step under sdpa_kernel([FLASH, EFFICIENT, MATH])")
    p.add_argument("--stacks", default="temporal,mimi")
    p.add_argument("--steps", type=int, default=None, help="default: 300 (eager), 50 temporal / 100 mimi (compiled)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--active-prob", type=float, default=0.8, help="rows 1.. are active with this probability")
    p.add_argument("--wrap-steps", type=int, default=100,
                   help="temporal, eager part: a second run from offset context - wrap_steps/2 (0: none)")
    p.add_argument("--profile-steps", default="0,66,last")
    p.add_argument("--small", action="store_true", help="the small presets (a dry run of the plumbing)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--probe-reps", type=int, default=40, help="--part sdpa: calls per backend and length")
    p.add_argument("--time-budget", type=float, default=400.0, help="seconds; later stacks are skipped past it")
    return p.parse_args()


ARGS = parse_args()
# moshi reads NO_TORCH_COMPILE when it is imported: "" keeps torch.compile on (the compiled part);
# the eager part also runs moshi under no_compile().
os.environ["NO_TORCH_COMPILE"] = "1" if ARGS.part == "eager" else ""

import torch

from jax_impl.config import PRESETS, with_options
from tests.moshi_oracle import _import_moshi_transformer, moshi_stack, prefill_rings
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.tables import rope_freqs

tr = _import_moshi_transformer()
import moshi.modules.gating as mgating
import moshi.modules.rope as mrope
import moshi.utils.compile as mcompile

import torch_bridge.layers as tlayers
import torch_bridge.model as tmodel
import torch_bridge.tables as ttables

F = torch.nn.functional


# ----------------------------------------------------------------------------- recording
class Recorder:
    """Records (kind, tensor) per side in execution order; `side` None records nothing."""

    def __init__(self):
        self.side: str | None = None
        self.record_linear = True
        self.check_rerun = False
        self.log = {"moshi": [], "ours": []}
        self.rerun: list[tuple[str, torch.Tensor]] = []
        self.backends = {"moshi": collections.Counter(), "ours": collections.Counter()}
        self.step_backends = {"moshi": set(), "ours": set()}
        self._rope_k_next = False

    def new_step(self):
        self.log = {"moshi": [], "ours": []}
        self.rerun = []
        self.step_backends = {"moshi": set(), "ours": set()}
        self._rope_k_next = False

    def add(self, kind, t):
        if self.side is not None:
            self.log[self.side].append((kind, t))


REC = Recorder()
ORIG = {}


def install_patches():
    """Wrap the ops both paths call (looked up at call time) so that REC sees them; numerics unchanged."""
    ORIG.update(linear=F.linear, sdpa=F.scaled_dot_product_attention, layer_norm=F.layer_norm,
                m_rms=tr._rms_norm, m_rope=mrope.apply_rope, o_rms=tlayers.rms_norm_f32,
                o_rope=tlayers.apply_rope)

    def linear(input, weight, bias=None):
        y = ORIG["linear"](input, weight, bias)
        if REC.side is not None and REC.record_linear:
            REC.add("linear.x", input)
            REC.add("linear.y", y)
            if REC.check_rerun and REC.side == "ours":
                REC.rerun.append(("linear", (ORIG["linear"](input, weight, bias) != y).any()))
        return y

    def sdpa(q, k, v, attn_mask=None, *args, **kwargs):
        out = ORIG["sdpa"](q, k, v, attn_mask, *args, **kwargs)
        if REC.side is not None:
            for name, t in (("sdpa.q", q), ("sdpa.k", k), ("sdpa.v", v), ("sdpa.mask", attn_mask), ("sdpa.out", out)):
                REC.add(name, t)
            try:
                choice = BACKENDS.get(int(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, False)), "?")
            except Exception as err:  # noqa: BLE001 (private API: record, never fail)
                choice = f"unknown ({type(err).__name__})"
            REC.backends[REC.side][choice] += 1
            REC.step_backends[REC.side].add(choice)
            if REC.check_rerun and REC.side == "ours":
                REC.rerun.append(("sdpa", (ORIG["sdpa"](q, k, v, attn_mask, *args, **kwargs) != out).any()))
        return out

    def layer_norm(input, *args, **kwargs):
        y = ORIG["layer_norm"](input, *args, **kwargs)
        REC.add("layer_norm.y", y)
        return y

    def m_rms(*args, **kwargs):
        y = ORIG["m_rms"](*args, **kwargs)
        REC.add("rms_norm.y", y)
        return y

    def o_rms(*args, **kwargs):
        y = ORIG["o_rms"](*args, **kwargs)
        REC.add("rms_norm.y", y)
        return y

    def m_rope(*args, **kwargs):
        qo, ko = ORIG["m_rope"](*args, **kwargs)
        REC.add("rope.q", qo)
        REC.add("rope.k", ko)
        return qo, ko

    def o_rope(*args, **kwargs):
        y = ORIG["o_rope"](*args, **kwargs)
        REC.add("rope.k" if REC._rope_k_next else "rope.q", y)  # ring_attention rotates q, then k
        REC._rope_k_next = not REC._rope_k_next
        return y

    F.linear, F.scaled_dot_product_attention, F.layer_norm = linear, sdpa, layer_norm
    tr._rms_norm, mrope.apply_rope = m_rms, m_rope
    tlayers.rms_norm_f32 = tmodel.rms_norm_f32 = o_rms
    tlayers.apply_rope = o_rope


def hook_layers(ours, theirs):
    orig_fn = ours._layer_fn

    def layer_fn(*args, **kwargs):
        y = orig_fn(*args, **kwargs)
        REC.add("layer.y", y[0])  # the carry: (x, ring_k, ring_v)
        return y

    ours._layer_fn = layer_fn
    for layer in theirs.layers:
        layer.register_forward_hook(lambda _m, _i, out: REC.add("layer.y", out))


LINEAR_NAMES = {"temporal": ["in_proj", "out_proj", "linear_in (gating)", "linear_out (gating)"],
                "mimi": ["in_proj", "out_proj", "linear1", "linear2"]}


def _describe(t):
    if t is None:
        return None
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).replace("torch.", ""),
            "contiguous": t.is_contiguous(), "ptr_mod_256": t.data_ptr() % 256}


def _name_records(log, stack, num_layers):
    """Human names for the records: layer (or head), kind, which linear."""
    names, layer, lin = [], 0, 0
    for kind, _t in log:
        where = f"layer {layer}" if layer < num_layers else "head"
        if kind.startswith("linear."):
            which = LINEAR_NAMES[stack][lin // 2] if layer < num_layers else "text_linear"
            names.append(f"{where} {kind} [{which}]")
            lin += 1
        else:
            names.append(f"{where} {kind}")
        if kind == "layer.y":
            layer, lin = layer + 1, 0
    return names


def compare_logs(active, stack, num_layers, full=False):
    """First differing record (active rows) between the two sides' logs of this step."""
    a, b = REC.log["moshi"], REC.log["ours"]
    kinds_a, kinds_b = [k for k, _ in a], [k for k, _ in b]
    if kinds_a != kinds_b:
        n = next((i for i, (x, y) in enumerate(zip(kinds_a, kinds_b, strict=False)) if x != y), min(len(a), len(b)))
        return {"aligned": False, "n_moshi": len(a), "n_ours": len(b), "first_mismatch_index": n,
                "moshi_kinds": kinds_a[max(0, n - 3):n + 3], "ours_kinds": kinds_b[max(0, n - 3):n + 3]}
    flags = []
    for (_k, x), (_k2, y) in zip(a, b, strict=True):
        if x is None or y is None:
            flags.append(torch.tensor(x is not y, device=active.device))
        elif x.shape != y.shape:
            flags.append(torch.tensor(True, device=active.device))
        else:
            flags.append((x[active] != y[active]).any())
    flags = torch.stack(flags).cpu().tolist() if flags else []
    names = _name_records(a, stack, num_layers)
    result = {"aligned": True, "n_records": len(a), "n_differing": int(sum(flags))}
    if not any(flags):
        return result
    i = flags.index(True)
    (_, x), (_, y) = a[i], b[i]
    info = {"index": i, "name": names[i], "moshi": _describe(x), "ours": _describe(y)}
    if x is not None and y is not None and x.shape == y.shape:
        xa, ya = x[active], y[active]
        d = (xa.float() - ya.float()).abs()
        flat = int(d.argmax())
        where = [int(v) for v in torch.unravel_index(torch.tensor(flat), d.shape)]
        info.update(max_abs=float(d.max()), n_diff=int((xa != ya).sum()), numel=xa.numel(),
                    where_active_row_index=where, moshi_value=float(xa.flatten()[flat]),
                    ours_value=float(ya.flatten()[flat]))
    result["first"] = info
    # the inputs of that op, as recorded just before it (all equal by construction: it is the first)
    result["previous"] = [names[j] for j in range(max(0, i - 4), i)]
    if full:
        result["all_differing"] = [names[j] for j, f in enumerate(flags) if f][:40]
    return result


# ----------------------------------------------------------------------------- metrics
def distance(ours, ref, active):
    a, b = ours[active].float(), ref[active].float()
    d = (a - b).abs()
    flat = int(d.argmax())
    where = [int(v) for v in torch.unravel_index(torch.tensor(flat), d.shape)]
    return {"max_abs": float(d.max()), "rel_fro": float(d.norm() / b.norm().clamp_min(1e-30)),
            "frac_diff": float((a != b).float().mean()), "where": where, "ref_absmax": float(b.abs().max())}


def kernel_names(fn, *args):
    """The CUDA kernels one call of fn launches: {name: count} for the interesting ones, and the total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn(*args)
        torch.cuda.synchronize()
    counts, total = collections.Counter(), 0
    for ev in prof.events():
        if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            total += 1
            name = ev.name
            if any(w in name.lower() for w in KERNEL_WORDS):
                counts[name[:160]] += 1
    return result, {"total_kernels": total, "kernels": dict(sorted(counts.items()))}


def rope_table_probe(head_dim, max_period, device, positions=3000):
    """First position where cos/sin tables computed other ways differ from torch's CUDA cos/sin."""
    freqs = rope_freqs(head_dim, max_period, device)
    ts = torch.arange(positions, device=device, dtype=torch.float32)
    ang = ts[:, None] * freqs
    ref_c, ref_s = torch.cos(ang).cpu(), torch.sin(ang).cpu()
    out = {}
    variants = {
        "cpu_float32": lambda: (torch.cos(ang.cpu()), torch.sin(ang.cpu())),
        "cuda_float64_rounded": lambda: (torch.cos(ang.double()).float().cpu(), torch.sin(ang.double()).float().cpu()),
        "cuda_angles_in_float64": lambda: tuple(
            f(ts.double()[:, None] * freqs.double()).float().cpu() for f in (torch.cos, torch.sin)),
        "cpu_freqs_then_cuda": lambda: tuple(
            f(ts[:, None] * rope_freqs(head_dim, max_period, "cpu").to(device)).cpu() for f in (torch.cos, torch.sin)),
    }
    for name, make in variants.items():
        c, s = make()
        bad = ((c != ref_c) | (s != ref_s)).any(1)
        idx = bad.nonzero().flatten()
        out[name] = {"first_position": int(idx[0]) if idx.numel() else None, "positions_differing": int(bad.sum())}
    return out


# ----------------------------------------------------------------------------- one stack
def build(stack, B, device, dtype):
    name = stack + ("-small" if ARGS.small else "")
    config = with_options(PRESETS[name], ring_convention="moshi")
    torch.manual_seed(ARGS.seed)
    cls = TemporalStreaming if stack == "temporal" else MimiTransformer
    ours = cls.from_config(config, dtype=dtype, device=device)  # init_weights: N(0, 0.02), norms 1, scales 0.01
    prefix = None if stack == "temporal" else "encoder_transformer"
    exported = ours.export_weights(prefix)
    theirs, out_norm, text_linear = moshi_stack(config, exported, B, device=device, dtype=dtype)
    del exported
    # the round trip is exact: moshi holds the same bits
    ours.streaming_init(B)
    return config, ours, theirs, out_norm, text_linear


def run_stack(stack, phases, device, dtype, compiled):
    """Build both stacks once; run each phase (start offset, steps); return the results by phase."""
    B = ARGS.batch
    t0 = time.time()
    config, ours, theirs, out_norm, text_linear = build(stack, B, device, dtype)
    hook_layers(ours, theirs)
    REC.record_linear = not compiled  # F.linear is traced inside moshi's compiled gating: leave it alone
    if compiled:
        F.linear = ORIG["linear"]
    result = {"stack": stack, "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
              "B": B, "T": 1 if stack == "temporal" else 2, "dtype": str(dtype), "moshi_compiled": compiled,
              "build_s": round(time.time() - t0, 1), "phases": {}}
    for start, steps in phases:
        if start:
            prefill_rings(ours, theirs, start, torch.Generator(device=device).manual_seed(ARGS.seed + 2))
        result["phases"][f"from_{start}"] = run_phase(stack, config, ours, theirs, out_norm, text_linear,
                                                      start, steps, device, dtype, compiled)
    result["sdpa_backends"] = {k: dict(v) for k, v in REC.backends.items()}
    for side in REC.backends:
        REC.backends[side].clear()
    result["rope_table_probe"] = rope_table_probe(config.head_dim, config.max_period, device)
    if compiled:
        result["compiled_vs_eager_ops"] = compiled_op_checks(config, ours, device, dtype)
    REC.new_step()  # drop the last step's records (they hold views of both rings)
    return result


def run_phase(stack, config, ours, theirs, out_norm, text_linear, start, steps, device, dtype, compiled):
    B = ARGS.batch
    T = 1 if stack == "temporal" else 2
    gen = torch.Generator(device=device).manual_seed(ARGS.seed + 1 + start)
    profile_at = set()
    for s in ARGS.profile_steps.split(","):
        if s:
            profile_at.add(steps - 1 if s == "last" else int(s))
    profile_at = {s for s in profile_at if 0 <= s < steps} if device == "cuda" and not start else set()

    def moshi_step(x, active):
        theirs.set_exec_mask(active)
        ref = theirs(x)
        if stack == "temporal":
            ref = out_norm(ref)
            return ref, text_linear(ref)[:, None]
        return ref, None

    def ours_step(x, active):
        res = ours.step(x, active)
        return res if stack == "temporal" else (res, None)

    per_step, first_diff, profiles, reruns_bad, first_step_layout = [], None, {}, [], None
    equal_steps = 0
    t_steps = time.time()
    with torch.no_grad():
        for step in range(steps):
            x = torch.randn(B, T, config.dim, generator=gen, device=device, dtype=dtype)
            active = torch.rand(B, generator=gen, device=device) < ARGS.active_prob
            active[0] = True
            REC.new_step()
            REC.check_rerun = step not in profile_at  # reruns would add kernels to the profile
            ctx = mcompile.no_compile() if not compiled else _null()
            with ctx, sdpa_context():
                REC.side = "moshi"
                if step in profile_at:
                    (ref, ref_logits), prof_m = kernel_names(moshi_step, x, active)
                else:
                    ref, ref_logits = moshi_step(x, active)
            REC.side = "ours"
            if step in profile_at:
                with sdpa_context():
                    (out, logits), prof_o = kernel_names(ours_step, x, active)
                profiles[step] = {"moshi": prof_m, "ours": prof_o,
                                  "same_kernel_set": set(prof_m["kernels"]) == set(prof_o["kernels"])}
            else:
                with sdpa_context():
                    out, logits = ours_step(x, active)
            REC.side = None
            rec = {"step": step, "active": active.cpu().tolist(),
                   "out_equal": bool(torch.equal(out[active], ref[active]))}
            if logits is not None:
                rec["logits_equal"] = bool(torch.equal(logits[active], ref_logits[active]))
                rec["argmax_equal"] = int((logits[active].argmax(-1) == ref_logits[active].argmax(-1)).sum())
            equal = rec["out_equal"] and rec.get("logits_equal", True)
            rec["backends"] = {k: sorted(v) for k, v in REC.step_backends.items()}
            bad = [k for k, f in REC.rerun if bool(f)]
            if bad:
                reruns_bad.append({"step": step, "ops": collections.Counter(bad)})
            if step == 0:
                first_step_layout = {side: [(k, _describe(t)) for k, t in REC.log[side][:16]]
                                     for side in ("moshi", "ours")}
            if not equal or (first_diff is None and step % 50 == 0):
                cmp = compare_logs(active, stack, config.num_layers, full=first_diff is None and not equal)
                if not equal:
                    rec["out"] = distance(out, ref, active)
                    if logits is not None:
                        rec["logits"] = distance(logits, ref_logits, active)
                    if first_diff is None:
                        first_diff = {"step": step, **cmp}
                        print(f"[{stack} from {start}] first difference at step {step}: "
                              f"{json.dumps(cmp.get('first'))}", flush=True)
                elif cmp.get("n_differing", 0) or not cmp.get("aligned", True):
                    rec["intermediate_differs"] = cmp
            equal_steps += equal
            per_step.append(rec)
    steps_s = time.time() - t_steps
    first_unequal = next((r["step"] for r in per_step if not (r["out_equal"] and r.get("logits_equal", True))), None)
    worst = {}
    for key in ("out", "logits"):
        vals = [r[key] for r in per_step if key in r]
        if vals:
            worst[key] = {"max_abs": max(v["max_abs"] for v in vals),
                          "rel_fro_max": max(v["rel_fro"] for v in vals),
                          "rel_fro_mean_over_differing_steps": sum(v["rel_fro"] for v in vals) / len(vals)}
    argmax = [r["argmax_equal"] for r in per_step if "argmax_equal" in r]
    n_active = sum(sum(r["active"]) for r in per_step)
    return {
        "start_offset": start, "steps": steps, "steps_s": round(steps_s, 1),
        "equal_steps": equal_steps, "first_unequal_step": first_unequal,
        "first_difference": first_diff, "worst": worst,
        "argmax_equal": f"{sum(argmax)}/{n_active}" if argmax else None,
        "final_offsets": ours.state.offset.cpu().tolist(),
        "wrapped": bool((ours.state.offset > config.context).any()),
        "rerun_differs": reruns_bad[:20], "n_rerun_differs": len(reruns_bad),
        "profiles": profiles, "first_step_layout": first_step_layout,
        "intermediate_differs_steps": [r["step"] for r in per_step if "intermediate_differs" in r],
        "per_step": per_step,
    }


def sdpa_context():
    """The SDPA backends both paths may use: torch's choice, or every backend but cuDNN."""
    if ARGS.sdpa == "default":
        return _null()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sdpa_probe(device, reps=40):
    """Does SDPA give the same bits twice on the same inputs? Per backend, per visible length L.

    Shapes of the two stacks' attention (q [B, H, T, D] against a ring [B, H, C, D], bool mask: slots
    0..L-1 visible), random bf16 inputs. Also the ring sliced to its L visible slots with no mask.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = {"temporal": (32, 128, 3000, 1, [8, 16, 32, 48, 56, 60, 63, 64, 65, 66, 67, 70, 72, 80, 96, 112, 127,
                                                 128, 129, 160, 192, 256, 512, 1024, 2048, 2999, 3000]),
             "mimi": (8, 64, 250, 2, [8, 16, 32, 63, 64, 65, 66, 100, 128, 129, 200, 249, 250])}
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH}
    g = torch.Generator(device=device).manual_seed(5)
    out = {}
    for name, (H, D, C, T, lengths) in cases.items():
        B = ARGS.batch
        q = torch.randn(B, H, T, D, generator=g, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, H, C, D, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(B, H, C, D, generator=g, device=device, dtype=torch.bfloat16)
        res = out[name] = {}
        for L in lengths:
            mask = (torch.arange(C, device=device) < L).view(1, 1, 1, C).expand(B, 1, T, C).contiguous()
            row = res[str(L)] = {}
            variants = {f"{b}_ring_mask": (backends[b], q, k, v, mask) for b in backends}
            variants["cudnn_sliced_no_mask"] = (backends["cudnn"], q, k[:, :, :L], v[:, :, :L], None)
            variants["default_ring_mask"] = (None, q, k, v, mask)
            for vname, (backend, *args) in variants.items():
                try:
                    ctx = sdpa_kernel(backend) if backend is not None else _null()
                    with ctx:
                        ref = ORIG["sdpa"](*args)
                        diffs = [ORIG["sdpa"](*args) for _ in range(reps)]
                    n = sum(not torch.equal(d, ref) for d in diffs)
                    mx = max(float((d.float() - ref.float()).abs().max()) for d in diffs)
                    row[vname] = {"differ": f"{n}/{reps}", "max_abs": mx}
                except RuntimeError as err:
                    row[vname] = {"error": str(err).split("\n")[0][:160]}
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        q, k, v = (torch.randn(4, 32, n, 128, device=device, dtype=torch.bfloat16) for n in (1, 3000, 3000))
        mask = torch.ones(4, 1, 1, 3000, dtype=torch.bool, device=device)
        out["choice_with_use_deterministic_algorithms"] = BACKENDS.get(
            int(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)), "?")
    except Exception as err:  # noqa: BLE001 (record, never fail)
        out["choice_with_use_deterministic_algorithms"] = f"{type(err).__name__}: {err}"[:200]
    finally:
        torch.use_deterministic_algorithms(False)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def compiled_op_checks(config, ours, device, dtype):
    """moshi's compiled functions against their eager selves (and ours) on the same random inputs."""
    g = torch.Generator(device=device).manual_seed(123)
    B, T = ARGS.batch, (1 if isinstance(ours, TemporalStreaming) else 2)
    H, D = config.num_heads, config.head_dim
    res = {}

    def cmp(name, a, b):
        a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
        res[name] = [{"equal": bool(torch.equal(x, y)), "max_abs": float((x.float() - y.float()).abs().max()),
                      "frac_diff": float((x != y).float().mean())} for x, y in zip(a, b, strict=True)]

    rms = ORIG["m_rms"]  # moshi's torch_compile_lazy wrapper; .__wrapped__ is the eager function
    rope = ORIG["m_rope"]
    gate = mgating.gating_forward_kernel
    with torch.no_grad():
        q = torch.randn(B, H, T, D, generator=g, device=device, dtype=dtype)
        k = torch.randn(B, H, T, D, generator=g, device=device, dtype=dtype)
        offset = torch.tensor([0, 65, 1000, 2999][:B] + [7] * max(0, B - 4), device=device)
        cmp("apply_rope: compiled vs eager", rope(q, k, offset, config.max_period, True, False),
            rope.__wrapped__(q, k, offset, config.max_period, True, False))
        cos, sin = ttables.rope_tables(offset, T, D, config.max_period)
        cmp("apply_rope: compiled vs ours", rope(q, k, offset, config.max_period, True, False),
            (ORIG["o_rope"](q, cos, sin), ORIG["o_rope"](k, cos, sin)))
        if isinstance(ours, TemporalStreaming):
            x = torch.randn(B, T, config.dim, generator=g, device=device, dtype=dtype)
            alpha = (1 + 0.1 * torch.randn(1, 1, config.dim, generator=g, device=device)).to(dtype).float()
            cmp("_rms_norm: compiled vs eager", rms(x, alpha, torch.float, config.norm_eps),
                rms.__wrapped__(x, alpha, torch.float, config.norm_eps))
            cmp("_rms_norm: compiled vs ours", rms(x, alpha, torch.float, config.norm_eps),
                ORIG["o_rms"](x, alpha, config.norm_eps))
            w_in, w_out = ours.linear_in[0], ours.linear_out[0]
            cmp("gating_forward_kernel: compiled vs eager", gate(w_in, w_out, F.silu, x),
                gate.__wrapped__(w_in, w_out, F.silu, x))
    return res


def main():
    device = ARGS.device
    dtype = torch.bfloat16
    os.makedirs(ARGS.out, exist_ok=True)
    install_patches()
    compiled = ARGS.part == "compiled"
    t0 = time.time()
    header = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "sdp_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                        "math": torch.backends.cuda.math_sdp_enabled(),
                        "cudnn": torch.backends.cuda.cudnn_sdp_enabled()},
        "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "part": ARGS.part,
    }
    results = {"header": header, "stacks": {}}
    tag = ARGS.part + ("" if ARGS.sdpa == "default" else f"_{ARGS.sdpa}")
    path = os.path.join(ARGS.out, f"moshi_bf16_gpu_{tag}.json")
    header["sdpa"] = ARGS.sdpa
    if ARGS.part == "sdpa":
        results["sdpa_probe"] = probe = sdpa_probe(device, ARGS.probe_reps)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        for name, rows in probe.items():
            if isinstance(rows, str):
                print(f"{name}: {rows}")
                continue
            for L, row in rows.items():
                print(f"sdpa probe {name} L={L}: " + ", ".join(
                    f"{k} {v.get('differ', v.get('error'))} ({v.get('max_abs', '-')})" for k, v in row.items()))
        print(f"wrote {path}")
        return
    for stack in ARGS.stacks.split(","):
        if time.time() - t0 > ARGS.time_budget:
            results["stacks"][stack] = {"skipped": f"time budget {ARGS.time_budget}s spent"}
            continue
        steps = ARGS.steps or (300 if not compiled else (50 if stack == "temporal" else 100))
        phases = [(0, steps)]
        if stack == "temporal" and not compiled and ARGS.wrap_steps:
            # temporal does not wrap in 300 steps: also start near the end of the ring and cross it
            context = PRESETS[stack + ("-small" if ARGS.small else "")].context
            phases.append((max(1, context - ARGS.wrap_steps // 2), ARGS.wrap_steps))
        try:
            r = run_stack(stack, phases, device, dtype, compiled)
        except Exception as err:  # noqa: BLE001 (keep what the other stacks found)
            import traceback

            traceback.print_exc()
            r = {"error": f"{type(err).__name__}: {err}"[:2000]}
        results["stacks"][stack] = r
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        summary(stack, r)
    results["total_s"] = round(time.time() - t0, 1)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(json.dumps(header))
    print(f"wrote {path} ({results['total_s']} s)")


def summary(stack, r):
    if "error" in r or "skipped" in r:
        print(f"[{stack}] {r}")
        return
    print(f"[{stack}] moshi_compiled={r['moshi_compiled']} build {r['build_s']}s "
          f"sdpa backends={r['sdpa_backends']}")
    for name, p in r["phases"].items():
        tag = f"[{stack} {name}]"
        print(f"{tag} steps={p['steps']} equal_steps={p['equal_steps']} first_unequal={p['first_unequal_step']} "
              f"wrapped={p['wrapped']} offsets={p['final_offsets']} ({p['steps_s']}s) "
              f"rerun_differs={p['n_rerun_differs']} intermediates_differ_at={p['intermediate_differs_steps'][:5]}")
        if p["worst"]:
            print(f"{tag} worst={json.dumps(p['worst'])} argmax_equal={p['argmax_equal']}")
        fd = p["first_difference"]
        if fd:
            print(f"{tag} first differing op at step {fd['step']}: {json.dumps(fd.get('first'))} "
                  f"previous={fd.get('previous')}")
            if not fd.get("aligned", True):
                print(f"{tag} logs not aligned: {json.dumps(fd)}")
        for s, q in p["profiles"].items():
            other = [k for k in q["moshi"]["kernels"] if "gemm" not in k.lower() and "nvjet" not in k]
            print(f"{tag} step {s}: kernels moshi {q['moshi']['total_kernels']} ours {q['ours']['total_kernels']}, "
                  f"same GEMM/attention kernel set: {q['same_kernel_set']}; moshi's others: {other[:6]}")
    print(f"[{stack}] rope tables: {json.dumps(r['rope_table_probe'])}")
    if "compiled_vs_eager_ops" in r:
        print(f"[{stack}] compiled ops: {json.dumps(r['compiled_vs_eager_ops'])}")


if __name__ == "__main__":
    main()
