"""``min_tokens`` on the device: the target's logits of a row's banned ids (EOS unless ``ignore_eos``, its stop
token ids) go to -inf at every node whose output index is below the row's ``min_tokens``.

Why in the logits and not on the host: the choice at a node decides which draft nodes are accepted, so a ban that
only trimmed committed tokens would make speculation diverge from AR; masking the target's distribution before the
argmax or the draw (vLLM's MinTokensLogitsProcessor, applied per node) keeps AR, chain and tree lossless w.r.t. each
other. Log-probs stay the raw distribution's (the caller keeps the unmasked logits).
"""

from __future__ import annotations

import torch
from torch import Tensor


def mask_min_tokens(logits: Tensor, banned: Tensor, min_tokens: Tensor, out_index: Tensor) -> Tensor:
    """``logits [R, N, V]`` with ``banned [B, R]`` (ids, -1 or out-of-vocabulary = none) set to -inf where
    ``out_index [R, N] < min_tokens [R]``; a new tensor, on the device, no host sync."""
    r, _, v = logits.shape
    ids = banned.T  # [R, B]
    ids = torch.where((ids >= 0) & (ids < v), ids, v)  # none -> an extra column, dropped below
    ban = torch.zeros((r, v + 1), dtype=torch.bool, device=logits.device)
    ban.scatter_(1, ids, True)
    active = out_index < min_tokens[:, None]  # [R, N]
    return logits.masked_fill(active[:, :, None] & ban[:, None, :v], float("-inf"))
