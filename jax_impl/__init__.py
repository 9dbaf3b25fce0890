"""JAX path: the streaming stacks of Moshi / PersonaPlex as pure functions over a pytree state.

    import jax_impl as jx
    cfg = jx.PRESETS["temporal-small"]
    params = jx.init_params(cfg, jax.random.key(0))          # or params_from_checkpoint / _stacked
    state = jx.init_state(cfg, batch_size=4)
    step = jx.make_step(cfg)                                 # jitted, state donated
    (out, logits), state = step(params, state, x, active)

Modules, along the data path: `config` (the framework-neutral configs) and `checkpoint` (the Moshi
checkpoint layout and its IO, framework-neutral) -> `tables` (the per-step RoPE / ring tables) ->
`state` (the ring state and the recycle ops) -> `ops` (one layer's operations) -> `layers` (the
layers, the layer driver) -> `model` (the Flax stacks) -> `step` (the jitted step, `Streamer`);
`twin_layers` (the twin layer programs, shared with torch, framework-neutral) and `kernel_choice`
(the one `kernels` vocabulary, framework-neutral); `weights` (parameters in and out) and `parity`
(bit / ULP distances) beside them; `snapshot` (the stream snapshot format, shared with torch,
framework-neutral) and `stream_io` (a `StreamState` to a snapshot / file and back); `wait`
(`until_ready`: a synchronized loop's wait on the GPU's stream order); `lora` (LoRA adapters of the
temporal stack's reference layer, for fine-tuning); `sharding` (the
multi-device steps: `sessions`, `tensor_parallel`, `placement`).
Names are imported on first use: the torch path reads `jax_impl.config`, `jax_impl.checkpoint`,
`jax_impl.snapshot`, `jax_impl.kernel_choice` and `jax_impl.twin_layers` without importing jax.
"""

from kernels_pallas.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["MimiConfig", "PRESETS", "StackConfig", "TemporalConfig", "with_options"], "config"),
    **dict.fromkeys(["CheckpointError", "check_checkpoint", "infer_config", "weight_specs"], "checkpoint"),
    **dict.fromkeys(["CODEC_PRESETS", "CodecConfig", "with_codec_options"], "codec_config"),
    **dict.fromkeys(["StepTables", "step_tables"], "tables"),
    **dict.fromkeys(["StreamState", "bump_slot_start", "check_headroom", "init_state", "reset_rows",
                     "reset_slot", "reset_streaming"], "state"),
    **dict.fromkeys(["MimiStack", "TemporalStack", "init_params", "stack_module"], "model"),
    **dict.fromkeys(["Streamer", "jit_bump_slot_start", "jit_reset_rows", "jit_reset_slot",
                     "jit_reset_streaming", "make_step", "step_fn"], "step"),
    **dict.fromkeys(["check_params", "export_checkpoint", "load_safetensors",
                     "params_from_checkpoint", "params_from_stacked", "save_safetensors"], "weights"),
    **dict.fromkeys(["SnapshotError", "check_snapshot_layout"], "snapshot"),
    **dict.fromkeys(["read_stream", "state_from_snapshot", "state_snapshot", "write_stream"], "stream_io"),
    **dict.fromkeys(["LORA_TARGETS", "LoRA", "check_lora", "init_lora", "with_lora"], "lora"),
    "until_ready": "wait",
    **dict.fromkeys(["DEPFORMER_PRESETS", "DepformerConfig"], "depformer_config"),
    **dict.fromkeys(["check_depformer_params", "depformer_frame", "make_depformer_step"], "depformer"),
    **dict.fromkeys(["FRAME_PRESETS", "FrameConfig", "FrameOutput"], "frame_config"),
    **dict.fromkeys(["FrameState", "check_frame_params", "init_frame_state", "make_frame_step"], "frame"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [*_EXPORTS]  # noqa: PLE0604 (the names of the lazy export table)
