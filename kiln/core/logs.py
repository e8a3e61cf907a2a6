"""Log format: `[YYYY-mm-dd HH:MM:SS] message`, the same in every process. A tensor-parallel rank tags its lines
as SGLang does, `[YYYY-mm-dd HH:MM:SS TP1] message`, so the ranks' interleaved lines can be told apart."""

from __future__ import annotations

import logging


def rank_tag(tp_rank: int, tp_size: int) -> str:
    """The tag of a rank's log lines: SGLang's ` TP<rank>`, and nothing with one rank."""
    return f" TP{tp_rank}" if tp_size > 1 else ""


def configure_logging(level: str = "info", tag: str = "") -> None:
    logging.basicConfig(
        level=level.upper(), format=f"[%(asctime)s{tag}] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", force=True
    )
    # huggingface_hub's HTTP client logs each request at info: a model id's download would be dozens of lines
    for client in ("httpx", "httpx2"):
        logging.getLogger(client).setLevel(logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING)
