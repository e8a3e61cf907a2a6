"""The names of layer kinds that the models, the layers and the memory ledger share."""

from __future__ import annotations

LINEAR_ATTENTION = "linear_attention"
