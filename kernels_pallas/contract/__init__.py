"""The twin kernels' contract, framework-free: what `kernels_pallas.twin_*` (JAX) and
`kernels_triton.twin_*` (torch) both read, so that each package stays free of the other's framework.

    numerics   the numerics contract (its text), the polynomial constants, the lanes of a sum, the forms
    linear     the linears' tile plans (`LinearBlocks`, `MmaBlocks`), launch constants and checks
    norm       the norms' plan (`NormBlocks`), the fused and split norms (`TwinNorm`, `TwinSplit`,
               `TwinRms`) and their checks
    rope       the ring conventions and the rotate-and-write's checks
    attention  the attention's plan (`AttentionBlocks`), launch constants, counters and checks
    mrope      the MRoPE kernels' checks and tile plan

Standard library only: arrays are asked for `shape`, `ndim` and `dtype`, never computed on. The
plans are functions of the shapes (and the backend) alone: both twins choose the same tiles, and the
tiles that fix a result's bits (the lanes of a sum, the attention's blocks) depend on no batch size.
A plan's constants are read at call time, so a benchmark may set them (both twins follow).

The arguments are checked here, once for both twins, before anything runs: every array of a twin
kernel has at least one element along each axis (`numerics.check_nonempty`: no empty results; the
MRoPE kernels alone return zero tokens as they are, `mrope`), and a launch's num_warps and num_stages
are ones the compilers take (`numerics.check_launch`).
"""
