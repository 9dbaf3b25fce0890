"""Host-side timing of jitted JAX steps, shared by the benchmark scripts (no torch needed)."""

from __future__ import annotations

import statistics
import time

import jax

from jax_impl.wait import until_ready


def host_ms(fn, n: int) -> float:
    """Median ms of fn() measured on the host (fn waits for its own result)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def interleaved_medians_us(calls: dict, steps: int, warmup: int = 0) -> dict:
    """name -> median us of calls[name](), the calls interleaved one by one for `steps` rounds
    (after `warmup` untimed rounds), so the machine's drift hits each alike."""
    for _ in range(warmup):
        for f in calls.values():
            f()
    times: dict = {k: [] for k in calls}
    for _ in range(steps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append(1e6 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def time_step(step, params, state, x, active, steps: int, wait=until_ready):
    """(sync_ms, pipelined_ms, state) of a donated step `step(params, state, x, active)`.

    Synchronized: each step's outputs and state are ready before the next is launched (median),
    waited for by `wait` (`jax_impl.until_ready`, the GPU's stream order; until the fifteenth
    session `jax.block_until_ready`, PjRt's ready futures: a step 0.25-0.56 ms longer on an H200);
    pipelined: `steps` launches back to back, then one wait (mean). Three warm-up steps first.
    """
    holder = {"state": state}

    def one():
        out, holder["state"] = step(params, holder["state"], x, active)
        wait((out, holder["state"]))

    for _ in range(3):
        one()
    sync = host_ms(one, steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, holder["state"] = step(params, holder["state"], x, active)
    jax.block_until_ready(holder["state"])
    return sync, 1e3 * (time.perf_counter() - t0) / steps, holder["state"]
