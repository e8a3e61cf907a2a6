"""Log format: `[YYYY-mm-dd HH:MM:SS] message`, the same in every process."""

from __future__ import annotations

import logging


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", force=True
    )
