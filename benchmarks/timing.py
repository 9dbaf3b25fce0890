"""Timing shared by the benchmark scripts: host timing of jitted JAX steps and calls (`host_ms`,
`interleaved_medians_us`, `time_step`, `time_call`), CUDA-event timing, CUDA graphs, kernel profiles and the
copy ceiling (`cuda_time`, `torch_graph`, `graph_per_call_ms`, `kernel_profile`, `copy_bandwidth`),
and what every result file records of its run (`run_meta`). The CUDA helpers need a GPU when called."""

from __future__ import annotations

import datetime
import statistics
import time

import jax
import torch
from torch.profiler import ProfilerActivity, profile

from jax_impl.wait import until_ready
from kernels_pallas.backend import gpu_backend


def run_meta(device: str | None = None, **extra) -> dict:
    """What every result file records of its run: the device (`device`, else the CUDA device's name,
    else "cpu"), the date, the jax and torch versions and the Pallas backend of the JAX twins
    (`kernels_pallas.backend`), then `extra`."""
    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "torch": torch.__version__, "pallas_backend": gpu_backend(), **extra}


def cuda_time(fn, n: int) -> float:
    """Median ms of fn() measured with CUDA events, one event pair per call."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 20 after 3 warm-ups).

    Timed around plain copies, not a graph replay: a memcpy node in a CUDA graph runs on a copy
    engine at about 2.8 TB/s on an H200.
    """
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = cuda_time(lambda: b.copy_(a), 20)
    return 2 * a.numel() / (ms * 1e-3)


def torch_graph(fn):
    """Capture fn() in a CUDA graph (after 3 warm-up calls on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_per_call_ms(launch, calls: int, reps: int = 10) -> float:
    """ms per launch(i) call: a CUDA graph of launch(0), ..., launch(calls - 1), median of `reps`
    replays (each replay timed by a CUDA event pair), so no host launch cost is counted."""
    replay = torch_graph(lambda: [launch(i) for i in range(calls)])
    replay()
    return cuda_time(replay, reps) / calls


def kernel_profile(fn, top: int = 14) -> tuple[int, list]:
    """(CUDA kernels one fn() call launches, memcpy/memset excluded; the `top` kernel names by GPU
    time: [name, us, calls]); torch.profiler (CUPTI) sees JAX's kernels too. fn is called once, so it
    may donate its state; warm it up (compile) before."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", "[memory]")):
            us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
            t, n = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (t + us, n + 1)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return sum(n for _, n in by_name.values()), [[name[:80], round(t, 1), n] for name, (t, n) in ranked]


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


def time_step(step, params, state, x, active, steps: int, wait=until_ready, warmup: int = 3):
    """(sync_ms, pipelined_ms, state) of a donated step `step(params, state, x, active)`.

    Synchronized: each step's output is ready before the next is launched (median), waited for by
    `wait` (`jax_impl.until_ready`, the GPU's stream order; `jax.block_until_ready` waits for PjRt's
    ready futures instead: a step 0.25-0.56 ms longer on an H200, RESULTS.md, "scale_bench"). The
    wait takes the output alone: the arrays one jitted call returns are made ready by one completion
    event, so the state is ready with it, and each array more costs the host a DLPack export (~10 us
    an array on an H200, RESULTS.md, "frame_bench");
    pipelined: `steps` launches back to back, then one wait (mean). `warmup` synchronized steps first.
    """
    one, holder = synchronized_step(step, params, state, x, active, wait)
    for _ in range(warmup):
        one()
    sync = host_ms(one, steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, holder["state"] = step(params, holder["state"], x, active)
    jax.block_until_ready(holder["state"])
    return sync, 1e3 * (time.perf_counter() - t0) / steps, holder["state"]


def synchronized_step(step, params, state, x, active, wait=until_ready):
    """(one, holder): one() runs the donated `step(params, state, x, active)` once and waits on its
    output (`time_step`'s synchronized step); holder["state"] is the state after the last call."""
    holder = {"state": state}

    def one():
        out, holder["state"] = step(params, holder["state"], x, active)
        wait(out)

    return one, holder


def time_call(call, steps: int, warmup: int = 3, wait=until_ready) -> tuple[float, float]:
    """(sync_ms, pipelined_ms) of `call()`, a JAX computation without carried state (e.g. a depformer
    frame on fixed inputs): synchronized as `time_step` (each call's outputs waited for by `wait`
    before the next call, median), pipelined: `steps` calls back to back, then one wait for all their
    outputs (mean). `warmup` synchronized calls first."""
    for _ in range(warmup):
        wait(call())
    sync = host_ms(lambda: wait(call()), steps)
    t0 = time.perf_counter()
    outs = [call() for _ in range(steps)]
    jax.block_until_ready(outs)
    return sync, 1e3 * (time.perf_counter() - t0) / steps
