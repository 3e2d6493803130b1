"""Per-slot token rows: adapters that retrain a few token embeddings or add tokens to the vocabulary.

PEFT's trainable tokens (``trainable_token_indices``) replace chosen rows of the input embedding and, when
the head is tied to it or named too, of the output head; a fine-tune that resized the vocabulary saves new
rows (through trainable tokens on the new ids, or a full ``modules_to_save`` copy, of which lorakit keeps
only the rows that differ from the base). ``TokenRows`` holds such rows for every slot: ``ids1[s, k]`` is
a token id + 1 (0: empty) and ``rows[s, k]`` its row, padded to a row count that grows like the LoRA
rank. Only requests on slot s see slot s's rows:

- input embedding: a token whose id slot s replaces gets that row (times the layer's embed_scale);
- output head: the logit of each id slot s replaces is ``h @ row``; ids past the base vocabulary
  (``added`` extra columns, the most any loaded adapter needs) are -inf on every row whose adapter does
  not define them, so no other request can sample them.

Memory is rows x hidden size per slot, never a copy of the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from lorakit.ops import round_up


class TokenRows(nn.Module):
    """Replacement rows of a token-indexed weight (an input embedding or an output head), per slot."""

    def __init__(self, num_slots: int, vocab: int, dim: int, dtype: torch.dtype, device: torch.device,
                 multiple: int = 16):
        super().__init__()
        self.vocab, self.dim, self.multiple = vocab, dim, multiple
        self.k_max = 0   # rows per slot (padded)
        self.added = 0   # ids past the base vocabulary that some adapter defined (head: extra logit columns)
        self.register_buffer("ids1", torch.zeros(num_slots, 0, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("rows", torch.zeros(num_slots, 0, dim, dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def num_slots(self) -> int:
        return self.rows.shape[0]

    def needs_growth(self, k: int, added: int) -> bool:
        return k > self.k_max or added > self.added

    def grow(self, k: int, added: int) -> None:
        """Room for k rows per slot and ``added`` ids past the vocabulary; loaded slots keep their rows."""
        if k > self.k_max:
            k_new = round_up(k, self.multiple)
            ids1 = torch.zeros(self.num_slots, k_new, dtype=torch.int32, device=self.rows.device)
            rows = torch.zeros(self.num_slots, k_new, self.dim, dtype=self.dtype, device=self.rows.device)
            ids1[:, : self.k_max].copy_(self.ids1)
            rows[:, : self.k_max].copy_(self.rows)
            self.ids1, self.rows, self.k_max = ids1, rows, k_new
        self.added = max(self.added, added)

    def slot_tensors(self, slot: int) -> tuple[torch.Tensor, ...]:
        return self.ids1[slot], self.rows[slot]

    def _match(self, tokens: torch.Tensor, slots: torch.Tensor):
        """For each token: whether its slot replaces it, and the row index k that does."""
        own = self.ids1[slots.clamp(min=0).long()]                      # [T, K]
        match = (own == (tokens[:, None] + 1)) & (slots[:, None] >= 0)
        return match.any(-1), match.int().argmax(-1)

    def embed(self, y: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
        """y [T, dim] with the replaced tokens' rows (times ``scale``)."""
        hit, k = self._match(tokens, slots)
        rows = self.rows[slots.clamp(min=0).long(), k].to(y.dtype)
        if scale != 1.0:
            rows = rows * scale
        return torch.where(hit[:, None], rows, y)

    def logits(self, y: torch.Tensor, h: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """y [T, vocab] base logits, h [T, dim] hidden states -> [T, vocab + added] logits of each token's
        adapter: its rows' logits in place, ids past the vocabulary -inf unless its adapter defines them."""
        T = y.shape[0]
        own = self.ids1[slots.clamp(min=0).long()].long()              # [T, K]
        valid = (own > 0) & (slots[:, None] >= 0)
        rows = self.rows[slots.clamp(min=0).long()]                     # [T, K, dim]
        values = torch.bmm(rows, h.to(rows.dtype)[:, :, None])[:, :, 0].to(y.dtype)
        trash = self.vocab + self.added                                 # one spare column takes the invalid
        out = torch.cat([y, y.new_full((T, self.added + 1), float("-inf"))], dim=1)
        out.scatter_(1, torch.where(valid, own - 1, trash), values)
        return out[:, :trash]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, dim={self.dim}, slots={self.num_slots}, k_max={self.k_max}, added={self.added}"
