"""The request -> token-slot table: one row per running request, one column per token position."""

from __future__ import annotations

import torch

from kiln.core.transfer import to_device


class ReqToTokenPool:
    """A fixed table ``req_to_token[size, max_context_len]`` (int64, so it indexes the KV pool directly)."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = int(size)
        self.max_context_len = int(max_context_len)
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (self.size, self.max_context_len), dtype=torch.int64, device=self.device
        )
        self.reset()

    def reset(self) -> None:
        """Mark every row free (row contents are left as they are)."""
        self._free = list(range(self.size - 1, -1, -1))  # pop() hands out the lowest index first
        self._in_use = [False] * self.size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free row index, or None when the table is full."""
        if not self._free:
            return None
        idx = self._free.pop()
        self._in_use[idx] = True
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.size or not self._in_use[idx]:
            raise ValueError(f"request slot {idx} is not in use")
        self._in_use[idx] = False
        self._free.append(idx)

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the table's device, without waiting for it (kiln.core.transfer): the overlap schedule
        builds the next step while the stream runs this one."""
        return to_device(t, self.device)

    def write(self, rows: list[int], columns: list[int], slots: torch.Tensor) -> None:
        """req_to_token[rows[i], columns[i]] = slots[i], without waiting for the device (on_device)."""
        index = self.on_device(torch.tensor([rows, columns], dtype=torch.int64))
        self.req_to_token[index[0], index[1]] = slots

    def decode_table(
        self, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode batch's [B, L] slots (row i: the first seq_lens[i] slots of table row rows[i], padded with slot
        0) and its [B, 1, 1, L] validity mask, None where every row is L long; both on the table's device, built
        without waiting for it (rows and seq_lens are host tensors)."""
        width = int(seq_lens.max())
        kv_table = self.req_to_token[self.on_device(rows), :width]
        if int(seq_lens.min()) == width:
            return kv_table, None
        valid = torch.arange(width, device=self.device) < self.on_device(seq_lens).unsqueeze(1)
        kv_table = kv_table.masked_fill(~valid, 0)
        return kv_table, valid.view(len(seq_lens), 1, 1, width)

    def branch_table(
        self, rows: torch.Tensor, seq_lens: torch.Tensor, tails: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """decode_table's, each row followed by slots of its own that are in no table row (`tails`, [B, n]: a
        draft tree branch's path): row i the first seq_lens[i] slots of table row rows[i], then tails[i]; the
        validity mask as decode_table's."""
        kv_table, mask = self.decode_table(rows, seq_lens + tails.shape[1])
        columns = (seq_lens.unsqueeze(1) + torch.arange(tails.shape[1])).to(kv_table.device)
        return kv_table.scatter(1, columns, tails.to(kv_table.device)), mask
