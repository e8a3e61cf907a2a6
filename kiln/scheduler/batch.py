"""Turn a list of requests into the tensors of one forward pass."""

from __future__ import annotations

import torch

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.scheduler.req import Req


def lora_rows(reqs: list[Req], counts: list[int]) -> torch.Tensor | None:
    """Each row's LoRA slot (-1: the base model), `counts[i]` rows for request i; None when no request has an
    adapter."""
    if all(r.lora_slot is None for r in reqs):
        return None
    slots = torch.tensor([-1 if r.lora_slot is None else r.lora_slot for r in reqs], dtype=torch.int64)
    return slots.repeat_interleave(torch.tensor(counts, dtype=torch.int64))


def build_extend(reqs: list[Req], table: ReqToTokenPool) -> ForwardBatch:
    """Each request computes tokens [kv_len, kv_len + extend_len) on top of its first kv_len."""
    ids, pos, locs, slots, logits_rows = [], [], [], [], []
    row = 0
    for r in reqs:
        start, ext = r.kv_len, r.extend_len
        ids.extend(r.fill_ids[start : start + ext])
        pos.append(torch.arange(start, start + ext))
        seq = table.req_to_token[r.table_idx, : start + ext]
        locs.append(seq[start:])
        slots.append(seq)
        row += ext
        logits_rows.append(row - 1)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.cat(pos),
        out_cache_loc=torch.cat(locs),
        logits_index=torch.tensor(logits_rows, dtype=torch.int64),
        extend_lens=[r.extend_len for r in reqs],
        prefix_lens=[r.kv_len for r in reqs],
        fill_lens=[r.seq_len for r in reqs],
        seq_slots=slots,
        state_slots=torch.tensor([r.table_idx for r in reqs], dtype=torch.int64),
        lora_slots=lora_rows(reqs, [r.extend_len for r in reqs]),
    )


def shares_prefix(reqs: list[Req]) -> bool:
    """Whether two of the requests read the same cached KV. A cached prefix starts at a sequence's first token, so
    two that share any of it share the radix tree's node under the root on their paths."""
    tops = set()
    for r in reqs:
        node = r.node
        if node is None or r.cached_len == 0:
            continue
        while node.parent is not None and node.parent.parent is not None:
            node = node.parent
        if id(node) in tops:
            return True
        tops.add(id(node))
    return False


def build_decode(reqs: list[Req], table: ReqToTokenPool, new_slots: torch.Tensor) -> ForwardBatch:
    """One token per request at position kv_len; its slot is already in the table."""
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    seq_lens = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int64)
    kv_table, mask = table.decode_table(rows, seq_lens)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.last_token for r in reqs], dtype=torch.int64),
        positions=seq_lens - 1,
        out_cache_loc=new_slots,
        logits_index=torch.arange(len(reqs)),
        kv_table=kv_table,
        kv_mask=mask,
        shared_kv=shares_prefix(reqs),
        state_slots=rows,
        lora_slots=lora_rows(reqs, [1] * len(reqs)),
    )
