"""Token-slot allocator for the paged KV pool.

Slots are grouped in pages of ``page_size`` tokens. Page 0 (slots ``0 .. page_size - 1``) is the dummy /
padding page and is never handed out, so the pool tensors have ``(num_pages + 1) * page_size`` rows.
A sequence's token ``i`` lives at ``page_of(i) * page_size + i % page_size``: tokens fill pages in order.

The free list is a tensor of page ids; allocation slices its front and freed pages are queued and
concatenated lazily, so decode steps cost a handful of tensor ops whatever the batch size.
"""

from __future__ import annotations

import torch

_INT64 = torch.int64


class TokenAllocator:
    """Hands out KV token slots (int64) page by page; page 0 is reserved."""

    def __init__(
        self, num_tokens: int, page_size: int = 1, device: str | torch.device = "cpu", debug: bool = False
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = max(int(num_tokens) // page_size, 0)
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.debug = debug
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Mark every page (1..num_pages) free."""
        self._free = torch.arange(1, self.num_pages + 1, dtype=_INT64, device=self.device)
        self._released: list[torch.Tensor] = []
        self._num_free = self.num_pages
        if self.debug:
            self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
            self._is_free[0] = False

    def available_size(self) -> int:
        """Free tokens (free pages * page_size)."""
        return self._num_free * self.page_size

    def free_page_ids(self) -> torch.Tensor:
        """All free page ids (for checks and tests; merges the pending frees)."""
        self._merge()
        return self._free.clone()

    def _merge(self) -> None:
        if self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released = []

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > self._num_free:
            return None
        if n > self._free.numel():
            self._merge()
        pages, self._free = self._free[:n], self._free[n:]
        self._num_free -= n
        if self.debug and n:
            cpu = pages.cpu()
            assert bool(self._is_free[cpu].all()), "allocator handed out a page that is not free"
            self._is_free[cpu] = False
        return pages

    # ------------------------------------------------------------------ alloc

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots (page_size 1 only); None, with nothing taken, when not enough are free."""
        assert self.page_size == 1, "alloc(n) is for page_size 1; use alloc_extend / alloc_decode"
        return self._take_pages(n)

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """Slots of whole fresh pages for ``n`` tokens (a multiple of page_size): a cached prefix moving between
        tiers, which owns its pages whole."""
        assert n % self.page_size == 0, f"{n} tokens are not whole pages of {self.page_size}"
        pages = self._take_pages(n // self.page_size)
        if pages is None or self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, dtype=_INT64, device=pages.device)
        return (pages.unsqueeze(1) * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self, prefix_lens: list[int], last_slots: list[int], extend_lens: list[int]
    ) -> torch.Tensor | None:
        """Slots for the next ``extend_lens[j]`` tokens of each sequence, concatenated.

        Sequence ``j`` already holds ``prefix_lens[j]`` tokens, the last at ``last_slots[j]`` (-1 when empty);
        its partial last page is filled first, then fresh pages. None (nothing taken) if pages run short.
        """
        ps = self.page_size
        if ps == 1:
            return self._take_pages(sum(extend_lens))
        new_pages = [-(-(p + e) // ps) - (-(-p // ps)) for p, e in zip(prefix_lens, extend_lens)]
        pages = self._take_pages(sum(new_pages))
        if pages is None:
            return None
        if self.debug:
            self._check_last_slots(prefix_lens, last_slots)
        return self._extend_slots(pages, prefix_lens, last_slots, extend_lens, new_pages)

    def _extend_slots(
        self,
        pages: torch.Tensor,
        prefix_lens: list[int],
        last_slots: list[int],
        extend_lens: list[int],
        new_pages: list[int],
    ) -> torch.Tensor:
        ps, dev = self.page_size, self.device
        total = int(sum(extend_lens))
        table = torch.tensor([extend_lens, prefix_lens, last_slots, new_pages], dtype=_INT64, device=dev)
        ext, pre, last, npg = table.unbind(0)
        seq = torch.repeat_interleave(torch.arange(len(extend_lens), device=dev), ext, output_size=total)
        ext_start = torch.cumsum(ext, 0) - ext
        offset = torch.arange(total, dtype=_INT64, device=dev) - ext_start.index_select(0, seq)
        pos = pre.index_select(0, seq) + offset  # token position within its sequence
        partial_end = ((pre + ps - 1) // ps * ps).index_select(0, seq)  # first position needing a fresh page
        slots = last.index_select(0, seq) + offset + 1
        if pages.numel():
            page_start = (torch.cumsum(npg, 0) - npg).index_select(0, seq)
            page_idx = page_start + (pos - partial_end).div(ps, rounding_mode="floor")
            page_idx.clamp_(min=0, max=pages.numel() - 1)  # clamped entries are masked out below
            fresh = pages.index_select(0, page_idx) * ps + pos % ps
            slots = torch.where(pos < partial_end, slots, fresh)
        return slots

    def alloc_decode(self, seq_lens: list[int], last_slots: list[int] | None) -> torch.Tensor | None:
        """One new slot per sequence (sequence ``j`` holds ``seq_lens[j]`` tokens, the last at ``last_slots[j]``;
        pages of one token need no last slots)."""
        ps = self.page_size
        if ps == 1:
            return self._take_pages(len(seq_lens))
        assert last_slots is not None, "pages of several tokens place each new token after its last slot"
        needs = [n % ps == 0 for n in seq_lens]
        pages = self._take_pages(sum(needs))
        if pages is None:
            return None
        if self.debug:
            self._check_last_slots(seq_lens, last_slots)
        fresh = iter((pages * ps).tolist())
        slots = [next(fresh) if need else s + 1 for need, s in zip(needs, last_slots)]
        return torch.tensor(slots, dtype=_INT64, device=self.device)

    def _check_last_slots(self, lens: list[int], last_slots: list[int]) -> None:
        ps = self.page_size
        for n, s in zip(lens, last_slots):
            if n % ps:
                assert s >= ps and s % ps == (n - 1) % ps, f"last slot {s} does not fit a sequence of {n}"

    # ------------------------------------------------------------------ free

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages of ``slots`` (unique pages when page_size > 1; only whole pages you own)."""
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=_INT64).flatten()
        if self.page_size == 1:
            pages = slots.clone()  # the caller's tensor may be a view it will overwrite
        else:
            pages = torch.unique(slots.div(self.page_size, rounding_mode="floor"))
        if self.debug:
            cpu = pages.cpu()
            assert bool((cpu >= 1).all()) and bool((cpu <= self.num_pages).all()), (
                "freeing a page out of range"
            )
            assert cpu.unique().numel() == cpu.numel(), "freeing the same slot twice in one call"
            assert not bool(self._is_free[cpu].any()), "double free of a KV page"
            self._is_free[cpu] = True
        self._released.append(pages)
        self._num_free += pages.numel()
