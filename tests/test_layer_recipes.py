"""Each layer recipe written once, and one `kernels` vocabulary on every entry point.

- the twin layer programs (`jax_impl.twin_layers`) import no framework, and the torch step and the
  JAX step make the same twin kernel calls in the same order through them;
- `kernels` names mean the same everywhere (`jax_impl.kernel_choice`); a name an entry point
  does not run is refused with the accepted ones listed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl import layers as jlayers
from jax_impl import sharding as sh
from jax_impl.kernel_choice import JAX_KERNELS, TORCH_KERNELS
from jax_impl.twin_layers import TwinKernels
from torch_bridge import JaxMimiTransformer, MimiTransformer, TemporalStreaming
from torch_bridge.crosscheck import crosscheck

MCFG = jx.PRESETS["mimi-small"]


def test_shared_modules_import_no_framework():
    code = textwrap.dedent("""
        import sys
        import jax_impl.kernel_choice, jax_impl.twin_layers
        print(sorted(m for m in ("jax", "torch", "triton") if m in sys.modules))
        import torch_bridge
        from torch_bridge import TemporalStreaming, TorchStreamState, TorchStepTables, read_torch_stream
        print("jax" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=dict(os.environ),
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "False"], r.stdout


def recording(kernels: TwinKernels, calls: list) -> TwinKernels:
    """`kernels` with each call's name appended to `calls` (at trace time on the JAX side)."""

    def wrap(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    return TwinKernels(*(wrap(name, fn) for name, fn in zip(TwinKernels._fields, kernels, strict=True)))


def test_torch_and_jax_twin_steps_make_the_same_kernel_calls(monkeypatch):
    torch_calls, jax_calls = [], []
    module = MimiTransformer.from_config(MCFG, kernels="twin")
    module._twins = (recording(module._twins[0], torch_calls), module._twins[1])
    module.streaming_init(2)
    x = torch.randn(2, 2, MCFG.dim, generator=torch.Generator().manual_seed(0))
    out = module.step(x)
    recorded = recording(jlayers.PALLAS_TWINS, jax_calls)
    monkeypatch.setattr(jlayers, "PALLAS_TWINS", recorded)
    params = jx.params_from_stacked(MCFG, module.weights())
    step = jax.jit(jx.step_fn(MCFG, kernels="twin", layer_loop="python", rope_freqs=module.rope_freqs()))
    jax_out, _ = step(params, jx.init_state(MCFG, 2), jnp.asarray(x.numpy()))  # the calls: recorded as traced
    per_layer = ["linear_rope_write", "attention", "linear", "linear", "linear"]
    assert torch_calls == jax_calls == per_layer * MCFG.num_layers
    assert np.array_equal(out.numpy(), np.asarray(jax_out))


def test_one_kernels_vocabulary():
    assert set(TORCH_KERNELS) <= set(JAX_KERNELS)
    for bad in ("xla", "fast"):
        for make in (lambda k: TemporalStreaming.from_config(jx.PRESETS["temporal-small"], kernels=k),
                     lambda k: JaxMimiTransformer.from_config(MCFG, kernels=k),
                     lambda k: jx.step_fn(MCFG, kernels=k),
                     lambda k: crosscheck("mimi-encoder", steps=1, kernels=k),
                     lambda k: sh.make_tensor_parallel_step(jx.PRESETS["temporal-small"],
                                                            sh.session_mesh(jax.devices()[:1], axis=sh.MODEL),
                                                            kernels=k)):
            with pytest.raises(ValueError, match=r"kernels\): kernels must be one of \[.*'reference'"):
                make(bad)
    with pytest.raises(ValueError, match=r"MimiTransformer\(kernels\): .*\['reference', 'twin'\], got 'pallas'"):
        MimiTransformer.from_config(MCFG, kernels="pallas")
    assert JaxMimiTransformer.from_config(MCFG, kernels="reference").kernels == "reference"  # the JAX step's


def test_reference_is_what_auto_runs_on_the_cpu():
    params = jx.init_params(MCFG, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 2, MCFG.dim))
    outs = [jax.jit(jx.step_fn(MCFG, kernels=k))(params, jx.init_state(MCFG, 2), x) for k in ("reference", "auto")]
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
