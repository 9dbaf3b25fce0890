"""PyTorch side: the reference streaming stacks (and, later, the DLPack bridge to JAX)."""

from .ring import StepTables, build_step_tables, ring_positions
from .stacks import MimiTransformer, TemporalStreaming
from .streaming import StreamState

__all__ = ["MimiTransformer", "StepTables", "StreamState", "TemporalStreaming", "build_step_tables",
           "ring_positions"]
