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

Most of the suite's time is XLA compiling programs of interpreted kernels for the CPU. XLA's CPU
compiler runs with its classic fusion emitters (`--xla_cpu_use_fusion_emitters=false`, added to
XLA_FLAGS unless the caller set it): the default emitters compile each fusion through MLIR on a
thread pool and took twice the CPU time of the classic ones on one core (the twin speech frame:
17-19 s against 8-9 s; 13 s against 8 s each with the other worker compiling beside it). Both
emitters are XLA's ordinary CPU code generation: the same LLVM pipeline, the same FMA contraction
(what `twin_math`'s guards are for: with a guard removed the same twin tests fail under both), the
same bits on the programs compared (the suite's, and XLA's transcendentals). The flag is set only with
a jaxlib before 0.11: XLA ends the process on a flag it does not know, and jaxlib 0.11.2's XLA has
none by this name (under pytest's output capture the run then exits with status 1 and prints nothing).

Where JAX has no accelerator plugin (every compile is XLA:CPU's), LLVM also skips its IR optimizations
and selects instructions through SelectionDAG (`--xla_backend_optimization_level=0
--xla_backend_extra_options=-fast-isel=false`): the compile-heavy tests take 38% less CPU time (one
core); the compiled programs run slower, which the suite barely sees. What the twin tests lean on is
kept: XLA leaves FMA contraction to instruction selection, which fuses a multiply into its add at
any level, except through FastISel, which -O0 alone would use (no FMA at all: a twin product left
unguarded went unnoticed there). With SelectionDAG, removing a guard fails
the same twin tests as at LLVM's default -O2, and the programs compared give the same bits at both
(a*b+c, exp(x)*y+z, norms, loops, scans, reductions, transcendentals). On a GPU machine (a JAX
plugin installed) none of this is set: the level would apply to the GPU's kernels too.

Python's cyclic garbage collector runs less often (a young collection every 10,000 allocations, not
700): tracing, lowering and the Triton interpreter make millions of short-lived objects, and the
default thresholds spent 6-8% of a test's time in the collector (~4% of the suite's time); the
peak memory is the same.

Under TRITON_INTERPRET=1, the interpreter's scan of triton.language for its builtins runs once: the
interpreter patches the builtins of `tl`, `tl.core`, `tl.tensor`, ... at every launch and again at
every call of a @triton.jit function inside a kernel, each time listing every member of the package
(`inspect.getmembers`) to find the builtins among them: ~15% of the interpreter's time. The names
of a package's builtins are listed when it is first patched (nothing patched it before) and each
patch reads those names' current members, builtin or not as the interpreter's own scan would find
them: the same patches, the same bits (the twin speech frame's torch side: 17% faster, identical).
"""

import atexit
import gc
import importlib.metadata
import importlib.util
import inspect
import os
import shutil
import sys
import tempfile

import pytest
import torch

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # set: a worker of the run that made it (or the caller's)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="personaplex-jax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def _add_xla_flags(*flags: str) -> None:
    """Append the flags to XLA_FLAGS, all or none: none when the caller set one of them."""
    current = os.environ.get("XLA_FLAGS", "")
    if not any(flag.split("=")[0] in current for flag in flags):
        os.environ["XLA_FLAGS"] = " ".join((current, *flags)).strip()


if tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _add_xla_flags("--xla_cpu_use_fusion_emitters=false")
if importlib.util.find_spec("jax_plugins") is None and not importlib.metadata.entry_points(group="jax_plugins"):
    _add_xla_flags("--xla_backend_optimization_level=0", "--xla_backend_extra_options=-fast-isel=false")
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


def _scan_triton_builtins_once() -> None:
    """Replace the interpreter's `_patch_builtin` by one that lists a package's builtins once (module docstring)."""
    import triton.language as tl
    from triton.runtime import interpreter

    names: dict[object, list[str]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name in names[pkg]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


# `_patch_builtin` is private to the interpreter: replaced only in the pinned Triton whose code was read.
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.metadata.version("triton") == "3.9.0":
    _scan_triton_builtins_once()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
