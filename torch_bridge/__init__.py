"""PyTorch side: the reference stacks, the DLPack bridge to JAX, the JAX-backed drop-ins.

    from torch_bridge import TemporalStreaming, MimiTransformer        # the torch path (reference)
    from torch_bridge import MimiCodec                                 # the Mimi codec around them (reference)
    from torch_bridge import to_jax, to_torch                          # zero-copy DLPack handoff
    from torch_bridge import JaxTemporalStreaming, JaxMimiTransformer, from_torch   # stepped by JAX
    from torch_bridge.crosscheck import crosscheck                      # the two paths side by side

Modules, the concepts of `jax_impl` under the same names: `tables` (`TorchStepTables`) -> `state`
(`TorchStreamState`) -> `layers` -> `model` (the stacks); `weights` and `stream_io` beside them. Names are imported on first use: the
torch path alone does not import jax.
"""

from kernels_pallas.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["MimiTransformer", "TemporalStreaming"], "model"),
    "read_torch_stream": "stream_io",
    "TorchStreamState": "state",
    "TorchStepTables": "tables",
    "MimiCodec": "codec",
    **dict.fromkeys(["BridgeCopyWarning", "to_jax", "to_torch"], "dlpack"),
    **dict.fromkeys(["JaxMimiTransformer", "JaxTemporalStreaming", "from_torch"], "jax_steppers"),
    **dict.fromkeys(["ArgmaxRecord", "CrosscheckReport", "TensorRecord"], "report"),
    "Depformer": "depformer",
    "JaxDepformer": "jax_depformer",
    "LMFrame": "frame",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [*_EXPORTS]  # noqa: PLE0604 (the names of the lazy export table)
