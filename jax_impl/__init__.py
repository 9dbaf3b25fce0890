"""JAX path: the streaming stacks of Moshi / PersonaPlex as pure functions over a pytree state.

    from personaplex_config import PRESETS
    import jax_impl as jx
    cfg = PRESETS["temporal-small"]
    params = jx.init_params(cfg, jax.random.key(0))          # or params_from_checkpoint / _stacked
    state = jx.init_state(cfg, batch_size=4)
    step = jx.make_step(cfg)                                 # jitted, state donated
    (out, logits), state = step(params, state, x, active)
"""

from .layers import MimiLayer, MimiStack, TemporalLayer, TemporalStack, stack_module
from .parity import max_abs, max_rel, ulp_distance
from .ring import StepTables, apply_rope, build_step_tables, ring_positions, rope_tables, step_tables
from .stacks import (
                     Streamer,
                     check_step_inputs,
                     jit_bump_slot_start,
                     jit_reset_rows,
                     jit_reset_slot,
                     jit_reset_streaming,
                     make_step,
                     step_fn,
)
from .state import (
                     INT32_MAX,
                     StreamState,
                     bump_slot_start,
                     check_headroom,
                     index_dtype,
                     init_state,
                     reset_rows,
                     reset_slot,
                     reset_streaming,
)
from .weights import (
                     ParamsError,
                     check_params,
                     export_checkpoint,
                     init_params,
                     load_safetensors,
                     params_from_checkpoint,
                     params_from_stacked,
                     save_safetensors,
                     stacked_weights,
)

__all__ = [
    "INT32_MAX", "MimiLayer", "MimiStack", "ParamsError", "StepTables", "StreamState", "Streamer",
    "TemporalLayer", "TemporalStack", "apply_rope", "build_step_tables", "bump_slot_start", "check_headroom",
    "check_params", "check_step_inputs", "export_checkpoint", "index_dtype", "init_params", "init_state",
    "jit_bump_slot_start", "jit_reset_rows", "jit_reset_slot", "jit_reset_streaming", "load_safetensors",
    "make_step", "max_abs", "max_rel", "params_from_checkpoint", "params_from_stacked", "reset_rows",
    "reset_slot", "reset_streaming", "ring_positions", "rope_tables", "save_safetensors", "stack_module",
    "stacked_weights", "step_fn", "step_tables", "ulp_distance",
]
