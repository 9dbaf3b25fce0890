"""Ring stress: positions, masks and ring contents of the torch stacks against a plain-Python
model of the ring, under random activity and random recycle operations.

The model does not reuse the `delta` formula: it labels slot c with the largest position
p <= ref such that p % C == c, found by counting down (ref as in tables.py: E for
"personaplex", offset + T - 1 for "moshi"), and keeps, slot by slot, the key vector that
was really written there. The test then also checks the meaning of the labels: every slot
an active query may see holds exactly the position its label claims.

Mutation check: turning `delta <= 0` into `delta < 0` in tables.py makes every case fail
(slot `end` gets labelled ref - C instead of ref).
"""

import random

import pytest
import torch
import torch.nn.functional as F

from torch_bridge import MimiTransformer
from torch_bridge.crosscheck import layer_tables
from torch_bridge.layers import apply_rope
from torch_bridge.tables import rope_tables

STEPS = 1000  # a case: each recycle op 14 to 58 times, ~2100 row-steps past a wrap (checked below)


def model_label(ref: int, c: int, capacity: int) -> int:
    """Largest p <= ref with p % capacity == c (may be negative)."""
    p = ref
    while p % capacity != c:
        p -= 1
    return p


class PlainRing:
    """One row per session: slot contents (the key vector and its true position), offsets."""

    def __init__(self, batch_size, capacity, num_heads, head_dim):
        self.C = capacity
        self.offset = [0] * batch_size
        self.start = [0] * batch_size
        self.key = torch.zeros(batch_size, num_heads, capacity, head_dim)  # [B, H, C, D]: 0 where never written
        self.true_pos = [[None] * capacity for _ in range(batch_size)]

    def clear(self, b):
        """reset_slot / reset_rows zero the row's ring (session isolation)."""
        self.key[b] = 0
        self.true_pos[b] = [None] * self.C

    def step(self, keys, active, T, convention):
        """keys[b][t]: the vector written for position offset[b] + t. Returns labels [B][C]."""
        labels = []
        for b, row_active in enumerate(active):
            if row_active:
                for t in range(T):
                    p = self.offset[b] + t
                    if p < self.start[b]:  # recycled away before it was written: not written
                        continue
                    self.key[b, :, p % self.C] = keys[b][t]
                    self.true_pos[b][p % self.C] = p
            end = self.offset[b] + T * row_active
            ref = end if convention == "personaplex" else self.offset[b] + T - 1
            row = []
            for c in range(self.C):
                p = model_label(ref, c, self.C)
                row.append(-1 if c >= end or p < self.start[b] else p)
            labels.append(row)
            self.offset[b] = end
        return labels


def expected_keys(stack, x, offset):
    """Layer-0 keys of this step, [B, H, T, D]: layer norm, in_proj, its k part, RoPE."""
    c = stack.config
    B, T, _ = x.shape
    w = stack.weights()
    h = F.layer_norm(x, (c.dim,), w["norm1_weight"][0], w["norm1_bias"][0], c.norm_eps)
    qkv = F.linear(h, w["in_proj"][0]).view(B, T, 3, c.num_heads, c.head_dim)  # full matmul, as the layer
    k = qkv[:, :, 1].transpose(1, 2)
    cos, sin = rope_tables(offset, T, c.head_dim, c.max_period)
    return apply_rope(k, cos, sin)


@pytest.mark.parametrize("convention", ["personaplex", "moshi"])
@pytest.mark.parametrize("T,capacity", [(1, 5), (2, 7), (5, 7), (5, 12)])
def test_ring_against_plain_model(T, capacity, convention):
    rng = random.Random(1000 * T + capacity)
    torch.manual_seed(capacity)
    B = 3
    stack = MimiTransformer(num_layers=1, dim=8, num_heads=2, context=capacity, ffn=8,
                            ring_convention=convention)
    stack.streaming_init(B)
    model = PlainRing(B, capacity, 2, 4)
    straddled = wrapped = 0
    ops = {"reset_slot": 0, "bump_slot_start": 0, "reset_rows": 0}
    for _ in range(STEPS):
        op = rng.random()
        b = rng.randrange(B)
        if op < 0.03:
            stack.reset_slot(b)
            model.start[b] = model.offset[b]
            model.clear(b)
            ops["reset_slot"] += 1
        elif op < 0.08 and model.start[b] < model.offset[b]:
            stack.bump_slot_start(b)
            model.start[b] += 1
            ops["bump_slot_start"] += 1
        elif op < 0.10:
            mask = [rng.random() < 0.5 for _ in range(B)]
            stack.reset_rows(torch.tensor(mask))
            ops["reset_rows"] += 1
            for r in range(B):
                if mask[r]:
                    model.offset[r] = model.start[r] = 0
                    model.clear(r)
        active = [rng.random() < 0.75 for _ in range(B)]
        for r in range(B):
            if active[r]:
                straddled += model.offset[r] % capacity + T > capacity
                wrapped += model.offset[r] >= capacity
        x = torch.randn(B, T, 8)
        keys = expected_keys(stack, x, stack.state.offset.clone())
        with layer_tables(stack) as seen:
            stack.step(x, torch.tensor(active))
        labels = model.step([[keys[r, :, t] for t in range(T)] for r in range(B)], active, T, convention)

        (tables,) = seen
        assert tables.positions.tolist() == labels
        assert stack.state.offset.tolist() == model.offset
        assert stack.state.start_offset.tolist() == model.start
        # the ring (layer 0, [B, H, C, D]) holds the keys written, slot by slot, and 0 where none was
        assert torch.equal(stack.state.k[0], model.key)
        for r, slot in tables.mask[:, 0].any(1).nonzero().tolist():  # every slot a query may see
            if active[r]:  # ... holds the position its label claims
                assert model.true_pos[r][slot] == labels[r][slot]
    assert straddled > 0 or T == 1, "some write chunk must straddle the ring end"
    assert wrapped > 0 and min(ops.values()) >= 5, ops
