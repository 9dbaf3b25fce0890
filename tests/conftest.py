"""Suite-wide settings.

torch runs single-threaded: the suite's stacks are tiny (a step is far below a millisecond of
work), and on a small machine (2 cores) torch's OpenMP threads fight XLA's thread pool and
each other for the cores: up to ~5x slower, and timings that say nothing.

JAX's persistent compilation cache is on, in a fresh directory that the first pytest process
(the xdist controller, or the only process) makes and removes when it exits, and its workers
share through the environment (JAX_COMPILATION_CACHE_DIR, which JAX reads when imported): no
entry from another run or checkout. Many tests jit a function object of their own
(`jax.jit(jx.step_fn(cfg))`, `make_step` of a config another test steps too) whose program was
compiled already, in this process or the other worker; XLA then loads the executable instead of
compiling it again (in half the suite measured: 26 loads, ~16 s saved, about as much spent writing
entries no test reads again). The executable is the same, so is every
bit. Programs compiled in under 0.3 s are not written (the one-op programs of eager jax.numpy
calls, cached in memory anyway). An entry that cannot be read (the other worker still writing
it) is a warning and a normal compile.

XLA's CPU compiler runs with its classic fusion emitters (`--xla_cpu_use_fusion_emitters=false`,
added to XLA_FLAGS unless the caller set the flag): most of the suite's time is XLA compiling the
interpreted kernels, and the default emitters' threads take ~1.6x the CPU time of the classic ones
on these programs and twice the wall time when the other worker holds the other core (the suite's
time: -15%). Both are XLA's ordinary optimizing CPU backend: the same LLVM optimization level, the
same FMA contraction (what `twin_math`'s guards exist for: a twin product left unguarded fails the
same twin tests under both), the same bits on the programs compared; the flag is read only by the
CPU backend.

Python's cyclic garbage collector runs less often (generation 0 at 10,000 allocations, not 700):
tracing, lowering and the Triton interpreter allocate millions of short-lived objects, and the
default thresholds spent ~6% of a test's time collecting them; the peak memory does not change.
"""

import atexit
import gc
import os
import shutil
import sys
import tempfile

import pytest
import torch

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # set: a worker of the run that made it (or the caller's)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="personaplex-jax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()
gc.set_threshold(10_000, 20, 20)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
if "jax" in sys.modules:  # imported before this file (a plugin): JAX read its environment already
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
