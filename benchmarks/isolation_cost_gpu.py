"""GPU cost of session isolation: what the isolation costs, and what the alternative would.

    python -m benchmarks.isolation_cost_gpu --out $OUT/isolation.json [--steps 30]
    python -m benchmarks.isolation_cost_gpu --small --out /tmp/isolation.json   # CPU smoke run

The isolation: `reset_slot` / `reset_rows` zero the recycled rows' rings, and a
step does not write positions below start_offset (`StepTables.write_mask`), so a masked slot
never holds an old session's NaN / Inf. Per step the only change is which [B, T] writes the
scatter keeps (the same op as without it: `where(write_mask, slot, C + t)` instead of
`where(active, ...)`) and a select on the attention output ([B, H, T, D]) for rows that see
nothing; the cost sits in the resets. The alternative keeps the resets free and
instead stops masked values entering the arithmetic in every layer of every step: zero the
invisible slots' values before the second product (XLA), or hand SDPA zeroed copies of k and v
(the torch path, whose SDPA cannot be told).

Measured, temporal stack at the real sizes (7B: bf16, B=4, ring full: offsets at capacity,
every slot random and visible), weights shared by both frameworks (DLPack):
- step_ms: the jitted JAX step with the Pallas kernels (the GPU default) and with XLA's;
  XLA's again with the alternative's attention patched in; the torch path's step, eager;
- recycle_ms: reset_slot / reset_rows with the ring clearing against offsets-only ops
  (no isolation), bump_slot_start; JAX (donated jit, host checks included) and torch;
- attention_ms: one layer's attention alone, as run and with the alternative: XLA
  `masked_attention` vs the same with v selected to 0 at invisible slots; torch SDPA vs SDPA
  on k, v copies with the invisible slots zeroed.
Prints the JSON record and writes it to --out. Never run by the tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import jax_impl
import jax_impl.ops as jops
from jax_impl.config import PRESETS
from torch_bridge import TemporalStreaming
from torch_bridge.dlpack import to_jax

B = 4
_masked_attention = jops.masked_attention  # the step's attention (the patch below replaces the name)


def timed(fn, n: int, sync) -> float:
    """Median ms of fn(); sync() waits for the device (CUDA events would miss JAX's host work)."""
    fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def masked_attention_values_zeroed(q, k, v, mask):
    """The alternative: v selected to 0 at slots no query of the row sees, then as `masked_attention`."""
    visible = jnp.any(mask, axis=2)[..., None]  # [B, 1, C, 1]
    return _masked_attention(q, k, jnp.where(visible, v, jnp.zeros((), v.dtype)), mask)


def sdpa_values_zeroed(q, k, v, mask):
    """The torch counterpart: SDPA reads whatever k, v hold, so it gets zeroed copies."""
    hidden = ~mask.any(dim=2).unsqueeze(-1)  # [B, 1, C, 1]
    return F.scaled_dot_product_attention(q, k.masked_fill(hidden, 0), v.masked_fill(hidden, 0), mask)


def random_state(config, dtype, device, key=1):
    s = jax_impl.init_state(config, B, dtype)
    k1, k2 = jax.random.split(jax.random.key(key))
    s = s._replace(k=jax.random.normal(k1, s.k.shape, dtype), v=jax.random.normal(k2, s.v.shape, dtype),
                   offset=jnp.full_like(s.offset, config.capacity))
    return jax.device_put(s, device)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--small", action="store_true", help="small preset, CPU-sized smoke run")
    ap.add_argument("--steps", type=int, default=30, help="timed calls per measurement (median)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        raise SystemExit("isolation_cost_gpu.py: no CUDA device; pass --small for the CPU smoke run")
    device = "cuda" if cuda else "cpu"
    config = PRESETS["temporal-small" if args.small else "temporal"]
    n = 3 if args.small else args.steps
    tdtype, jdtype = torch.bfloat16, jnp.bfloat16

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rec = {"config": "temporal-small" if args.small else "temporal", "B": B, "dtype": "bfloat16",
           "device": torch.cuda.get_device_name() if cuda else "cpu", "jax_backend": jax.default_backend(),
           "date": datetime.date.today().isoformat(), "timed_calls": n}

    module = TemporalStreaming.from_config(config, dtype=tdtype, device=device)
    module.init_weights(generator=torch.Generator(device=device).manual_seed(0))
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    jdev = params["params"]["layers"]["in_proj"].devices().pop()
    freqs = module.rope_freqs()
    x_t = torch.randn(B, 1, config.dim, device=device, dtype=tdtype)
    active_t = torch.ones(B, dtype=torch.bool, device=device)
    x, active = to_jax(x_t), to_jax(active_t)

    # ---------------------------------------------------------------- JAX step
    step_ms = {}
    holder = {"state": random_state(config, jdtype, jdev)}
    variants = {"jax_pallas": ("pallas" if cuda else None), "jax_xla": "reference"}
    for name, kernels in variants.items():
        if kernels is None:  # the Pallas kernels are the GPU path; interpreted on a CPU they time nothing useful
            continue
        step = jax_impl.make_step(config, layer_loop="python", kernels=kernels, rope_freqs=freqs)

        def run(step=step):
            _, holder["state"] = step(params, holder["state"], x, active)
            jax.block_until_ready(holder["state"])

        step_ms[name] = timed(run, n, sync)
        print(name, step_ms[name], flush=True)
    jops.masked_attention = masked_attention_values_zeroed  # looked up when the step is traced
    try:
        alt = jax.jit(jax_impl.step_fn(config, layer_loop="python", kernels="reference", rope_freqs=freqs),
                      donate_argnums=(1,))

        def run_alt():
            _, holder["state"] = alt(params, holder["state"], x, active)
            jax.block_until_ready(holder["state"])

        step_ms["jax_xla_values_zeroed"] = timed(run_alt, n, sync)
    finally:
        jops.masked_attention = _masked_attention
    print("jax_xla_values_zeroed", step_ms["jax_xla_values_zeroed"], flush=True)

    # ---------------------------------------------------------------- JAX recycle ops
    rows = np.array([True, False, True, False])
    before_reset_slot = jax.jit(lambda s, b: s._replace(
        start_offset=jnp.where(jnp.arange(B) == b, s.offset, s.start_offset)), donate_argnums=(0,))
    before_reset_rows = jax.jit(lambda s, m: s._replace(
        offset=jnp.where(m, 0, s.offset), start_offset=jnp.where(m, 0, s.start_offset)), donate_argnums=(0,))
    ops = {"reset_slot_clearing": lambda s: jax_impl.jit_reset_slot(s, np.int32(1)),
           "reset_slot_offsets_only": lambda s: before_reset_slot(s, np.int32(1)),
           "reset_rows_clearing_2_rows": lambda s: jax_impl.jit_reset_rows(s, rows),
           "reset_rows_offsets_only": lambda s: before_reset_rows(s, jnp.asarray(rows)),
           "bump_slot_start": lambda s: jax_impl.jit_bump_slot_start(s, np.int32(1))}
    recycle = {}
    for name, op in ops.items():
        def run_op(op=op):
            holder["state"] = op(holder["state"])
            jax.block_until_ready(holder["state"])

        recycle[f"jax_{name}"] = timed(run_op, n, sync)
    state = holder.pop("state")
    ring_k, ring_v = state.k, state.v  # for the attention timings below
    del state

    # ---------------------------------------------------------------- torch step and recycle ops
    module.streaming_init(B)
    ts = module.state
    ts.k.normal_()
    ts.v.normal_()
    ts.offset.fill_(config.capacity)
    step_ms["torch_eager"] = timed(lambda: module.step(x_t, active_t), max(3, n // 3), sync)
    print("torch_eager", step_ms["torch_eager"], flush=True)
    rows_t = torch.from_numpy(rows).to(device)
    zero = torch.zeros_like(ts.offset)

    def torch_reset_slot_offsets_only():
        ts.start_offset[1] = ts.offset[1]

    def torch_reset_rows_offsets_only():
        ts.offset.copy_(torch.where(rows_t, zero, ts.offset))
        ts.start_offset.copy_(torch.where(rows_t, zero, ts.start_offset))

    for name, fn in {"reset_slot_clearing": lambda: module.reset_slot(1),
                     "reset_slot_offsets_only": torch_reset_slot_offsets_only,
                     "reset_rows_clearing_2_rows": lambda: module.reset_rows(rows_t),
                     "reset_rows_offsets_only": torch_reset_rows_offsets_only,
                     "bump_slot_start": lambda: module.bump_slot_start(1)}.items():
        recycle[f"torch_{name}"] = timed(fn, n, sync)
    rec["step_ms"], rec["recycle_ms"] = step_ms, recycle
    print("recycle", recycle, flush=True)

    # ---------------------------------------------------------------- one layer's attention alone
    H, D, C = config.num_heads, config.head_dim, config.capacity
    qj = jax.random.normal(jax.random.key(5), (B, H, 1, D), jdtype)
    layer = min(3, config.num_layers - 1)
    kj, vj = ring_k[layer], ring_v[layer]
    tables = jax_impl.step_tables(config, jnp.full((B,), C, jnp.int32), jnp.zeros((B,), jnp.int32),
                                  jnp.ones((B,), bool), 1)
    mask = jax.device_put(tables.mask, jdev)
    attention = {}
    for name, fn in {"xla_now": _masked_attention, "xla_values_zeroed": masked_attention_values_zeroed}.items():
        f = jax.jit(fn)
        attention[name] = timed(lambda f=f: jax.block_until_ready(f(qj, kj, vj, mask)), n, sync)
    qt = torch.randn(B, H, 1, D, device=device, dtype=tdtype)
    mask_t = torch.from_numpy(np.array(tables.mask)).to(device)
    k_t, v_t = ts.k[layer], ts.v[layer]
    attention["torch_sdpa_now"] = timed(lambda: F.scaled_dot_product_attention(qt, k_t, v_t, mask_t), n, sync)
    attention["torch_sdpa_values_zeroed"] = timed(lambda: sdpa_values_zeroed(qt, k_t, v_t, mask_t), n, sync)
    rec["attention_ms"] = attention
    ring_bytes = 2 * ts.k.numel() * ts.k.element_size()
    rec["ring_bytes_k_plus_v"] = ring_bytes
    rec["row_ring_bytes_k_plus_v"] = ring_bytes // B
    print("attention", attention, flush=True)

    text = json.dumps(rec, indent=1)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    return rec


if __name__ == "__main__":
    main()
