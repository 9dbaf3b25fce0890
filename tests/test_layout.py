"""The repository's layout claims (README, "Layout"), checked.

- `import kernels_triton` (and each `kernels_triton.twin_*`) and `import torch_bridge` with its torch
  reference path leave jax unimported: the twin contract they read (`kernels_pallas.contract`) and
  the configs (`jax_impl.config`, `jax_impl.checkpoint`) import no framework.
- `kernels_pallas.contract` imports neither jax nor torch.
- no module of `kernels_pallas` / `kernels_triton` imports `jax_impl` (read from the sources' imports).
- each public function of `kernels_pallas.twin_X` (its `__all__`) has a twin of the same name and
  parameters in `kernels_triton.twin_X`, and each kernel has its plain reference (`*_native`) beside
  it on both sides.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TWINS = ("twin_attention", "twin_grad", "twin_linear", "twin_norm", "twin_rope")
# The one parameter one backend has and the other cannot: Pallas picks interpretation per call
# (`interpret`); Triton decides it when a kernel is decorated (TRITON_INTERPRET).
BACKEND_ONLY = {"interpret"}


def imported_after(statement: str) -> set[str]:
    """The top-level packages in sys.modules after `statement`, in a fresh interpreter."""
    code = f"import sys; {statement}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    return set(out.stdout.split())


# Importing a submodule imports its package first: the statements that import kernels_triton's and
# torch_bridge's modules also check `import kernels_triton` and `import torch_bridge` (each statement
# is a fresh interpreter, a second or two).
@pytest.mark.parametrize("statement", [
    "import " + ", ".join(f"kernels_triton.{m}" for m in (*TWINS, "twin_math", "rotary_mrope")),
    ("import torch_bridge.model, torch_bridge.layers, torch_bridge.tables, torch_bridge.state, torch_bridge.weights, "
     "torch_bridge.stream_io, torch_bridge.report, torch_bridge.depformer, torch_bridge.twin_depformer, "
     "torch_bridge.sampling, torch_bridge.frame"),
    "from torch_bridge import TemporalStreaming, MimiTransformer; TemporalStreaming; MimiTransformer",
    "import jax_impl.config, jax_impl.checkpoint, jax_impl.snapshot",
])
def test_the_torch_side_does_not_import_jax(statement):
    assert "jax" not in imported_after(statement)


def test_the_contract_imports_no_framework():
    contract = [f"kernels_pallas.contract.{p.stem}" for p in sorted((ROOT / "kernels_pallas/contract").glob("*.py"))]
    loaded = imported_after("import " + ", ".join(contract))
    assert not loaded & {"jax", "jaxlib", "torch", "triton", "numpy"}, loaded


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


@pytest.mark.parametrize("package", ["kernels_pallas", "kernels_triton"])
def test_no_kernel_module_imports_the_model_package(package):
    sources = sorted((ROOT / package).rglob("*.py"))
    assert sources
    for path in sources:
        bad = {m for m in _imports(path) if m.split(".")[0] in ("jax_impl", "torch_bridge")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_triton_package_reads_no_pallas_module_but_the_contract():
    for path in sorted((ROOT / "kernels_triton").glob("*.py")):
        pallas = {m for m in _imports(path) if m.split(".")[0] == "kernels_pallas"}
        assert all(m == "kernels_pallas.contract" or m.startswith("kernels_pallas.contract.") for m in pallas), (
            f"{path.relative_to(ROOT)} imports {sorted(pallas)}")


def _parameters(fn) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()
            if p.name not in BACKEND_ONLY and p.kind is not p.VAR_KEYWORD]


@pytest.mark.parametrize("name", TWINS)
def test_each_twin_has_the_same_functions_and_a_reference_beside_it(name):
    pallas = importlib.import_module(f"kernels_pallas.{name}")
    triton = importlib.import_module(f"kernels_triton.{name}")
    assert sorted(pallas.__all__) == sorted(triton.__all__), name
    kernels = [f for f in pallas.__all__ if not f.endswith("_native")]
    assert kernels
    for fn in kernels:
        for side in (pallas, triton):
            assert f"{fn}_native" in side.__all__, f"{side.__name__}.{fn} has no plain reference {fn}_native"
        assert _parameters(getattr(pallas, fn)) == _parameters(getattr(triton, fn)), f"{name}.{fn}"
        for side in (pallas, triton):  # a reference takes its kernel's arguments (it ignores the speed-only ones)
            kernel, ref = _parameters(getattr(side, fn)), _parameters(getattr(side, f"{fn}_native"))
            positional = [p for p in kernel if p[1] is not inspect.Parameter.KEYWORD_ONLY]
            assert [p for p in ref if p[1] is not inspect.Parameter.KEYWORD_ONLY] == positional, f"{side.__name__}.{fn}"
            assert set(ref) <= set(kernel), f"{side.__name__}.{fn}_native takes {sorted(set(ref) - set(kernel))}"
