"""Mimi's split residual vector quantizer, inference only, op for op as moshi's `quantization/`.

Two residual quantizers read the same latent: the semantic one (`semantic_codebooks` books, moshi's
`rvq_first`) and the acoustic one (the rest, `rvq_rest`), each with its own 1x1 input projection
(dimension -> codebook_dim) and output projection (back). Encode: per book, the nearest entry
(`torch.cdist` then `argmin`, as moshi) of the residual, which then loses that entry. Decode: the
entries summed per quantizer, projected, the two projections added.

Shapes: emb [B, dimension, T] -> codes int64 [B, num_codebooks, T] and back.
`codebooks` [num_codebooks, codebook_size, codebook_dim]: the entries,
embedding_sum / max(cluster_usage, CODEBOOK_EPS) (moshi's `EuclideanCodebook.embedding`).
`projections`: (input_proj, output_proj) per quantizer, [codebook_dim, dimension, 1] / [dimension, codebook_dim, 1].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from jax_impl.codec_config import CODEBOOK_EPS


def codebook_entries(embedding_sum: torch.Tensor, cluster_usage: torch.Tensor) -> torch.Tensor:
    """The entries [size, dim] of one codebook from its two checkpoint buffers (moshi's expression)."""
    return embedding_sum / cluster_usage.clamp(min=CODEBOOK_EPS)[:, None]


def _zero(device) -> torch.Tensor:
    return torch.zeros([1], device=device)[0]  # moshi's `zero_scalar`: the sum's first term


def _groups(codebooks: torch.Tensor, semantic: int) -> tuple[torch.Tensor, torch.Tensor]:
    return codebooks[:semantic], codebooks[semantic:]


def encode(emb: torch.Tensor, codebooks: torch.Tensor, projections: Sequence[tuple[torch.Tensor, torch.Tensor]],
           semantic: int) -> torch.Tensor:
    """emb [B, dimension, T] -> codes int64 [B, num_codebooks, T]."""
    codes = []
    for books, (input_proj, _) in zip(_groups(codebooks, semantic), projections, strict=True):
        if not len(books):
            continue
        residual = F.conv1d(emb, input_proj)
        for entries in books:
            x = residual.permute(0, 2, 1)  # b d n -> b n d
            flat = x.reshape(-1, x.shape[-1])
            idx = torch.cdist(flat[None], entries[None], p=2)[0].argmin(dim=-1).reshape(x.shape[:-1])
            residual = residual - F.embedding(idx, entries).permute(0, 2, 1)
            codes.append(idx)
    return torch.stack(codes).transpose(0, 1)


def decode(codes: torch.Tensor, codebooks: torch.Tensor, projections: Sequence[tuple[torch.Tensor, torch.Tensor]],
           semantic: int) -> torch.Tensor:
    """codes int64 [B, num_codebooks, T] -> the quantized latent [B, dimension, T]."""
    out = None
    for first, books, (_, output_proj) in zip((0, semantic), _groups(codebooks, semantic), projections, strict=True):
        if not len(books):
            continue
        quantized = _zero(codes.device)
        for i, entries in enumerate(books):
            quantized = quantized + F.embedding(codes[:, first + i], entries).permute(0, 2, 1)
        part = F.conv1d(quantized, output_proj)
        out = part if out is None else out.add_(part)
    return out


def encode_twin(emb: torch.Tensor, codebooks: torch.Tensor, projections: Sequence[tuple[torch.Tensor, torch.Tensor]],
                semantic: int) -> torch.Tensor:
    """`encode` on the twin kernels (`kernels_triton.twin_conv`; the JAX codec's kernels="twin" bits):
    the projection a twin conv1d, each book's code the twin `nearest`, the residual minus the entry.
    emb [B, dimension, 1] -> codes int64 [B, num_codebooks, 1]."""
    from kernels_triton import twin_conv

    codes = []
    for books, (input_proj, _) in zip(_groups(codebooks, semantic), projections, strict=True):
        if not len(books):
            continue
        residual = twin_conv.conv1d(emb, input_proj)[..., 0]  # [B, codebook_dim]
        for entries in books:
            idx = twin_conv.nearest(residual, entries).long()
            residual = residual - entries[idx]
            codes.append(idx)
    return torch.stack(codes, dim=1)[..., None]


def decode_twin(codes: torch.Tensor, codebooks: torch.Tensor, projections: Sequence[tuple[torch.Tensor, torch.Tensor]],
                semantic: int) -> torch.Tensor:
    """`decode` on the twin kernels: per quantizer the entries summed in book order from +0, its output
    projection a twin conv1d; the semantic part plus the acoustic part. codes [B, num_codebooks, 1] ->
    [B, dimension, 1]."""
    from kernels_triton import twin_conv

    out = None
    for first, books, (_, output_proj) in zip((0, semantic), _groups(codebooks, semantic), projections, strict=True):
        if not len(books):
            continue
        quantized = _zero(codes.device)
        for i, entries in enumerate(books):
            quantized = quantized + entries[codes[:, first + i, 0]]
        part = twin_conv.conv1d(quantized[..., None], output_proj)
        out = part if out is None else out + part
    return out
