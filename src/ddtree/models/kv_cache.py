"""A static KV cache: one preallocated pair of tensors per model, indexed by request slot.

Layout ``[layers, slots + 1, kv_heads, max_len, head_dim]``: a request owns one slot for its lifetime and its
token at cache index ``i`` lives at ``[:, slot, :, i]``; reading a batch's slots up to ``S`` gives the
``[R, kv_heads, S, head_dim]`` tensor SDPA wants without a transpose. The extra last slot is scratch: padding
rows of a batch (CUDA-graph buckets, finished requests) point there, so their writes never touch a live request.
Nothing here grows after :meth:`KVCache.allocate`, which is what lets the forward passes be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.errors import ConfigError


@dataclass
class KVCache:
    k: Tensor  # [layers, slots + 1, kv_heads, max_len, head_dim]
    v: Tensor  # [layers, slots + 1, kv_heads, max_len, head_dim]

    @classmethod
    def allocate(cls, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> KVCache:
        """Zero-filled cache for ``slots`` live requests (plus the scratch slot) of up to ``max_len`` tokens."""
        for name, value in (("layers", layers), ("slots", slots), ("kv_heads", kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"KV cache {name} must be a positive integer, got {value!r}")
        shape = (layers, slots + 1, kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        """Live slots (the scratch slot not counted)."""
        return self.k.shape[1] - 1

    @property
    def scratch_slot(self) -> int:
        """Index of the slot padding rows write to."""
        return self.k.shape[1] - 1

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def write(self, layer: int, slots: Tensor, write_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new K/V: slots [R], write_pos [R, T], k/v [R, KV, T, D] -> cache[layer, slot, :, pos]."""
        rows = slots[:, None].expand_as(write_pos)
        self.k[layer][rows, :, write_pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, write_pos] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, layer: int, slots: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """Positions ``0 .. length - 1`` of the given slots [R] -> k, v [R, KV, length, D]."""
        return self.k[layer, slots, :, :length], self.v[layer, slots, :, :length]
