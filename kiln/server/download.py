"""The `downloading` startup phase: the weights of a Hugging Face model id fetched into its snapshot directory by
the front process before the engine starts (kiln.loader.hub), with the HTTP server already answering, so that
/status, the --startup-events file, `kiln wait` and the log show the bytes done and total and the rate."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from kiln.config import ServerArgs
from kiln.core.units import human
from kiln.loader.hub import DownloadCancelled, DownloadProgress, download_weights, progress_text
from kiln.server.startup import StartupState

logger = logging.getLogger("kiln")
# the most often the log repeats a download's progress: a 100 GB download stays a few lines
LOG_EVERY_S = 10.0


async def download_phase(args: ServerArgs, startup: StartupState, cancel: threading.Event) -> str | None:
    """Download the weights of args.hub_model_id in the startup's first phase, then enter launching (the
    engine's); why it failed, or None (done, or stopped by `cancel`: the server is stopping)."""
    model = args.hub_model_id
    startup.step(model=model)
    t0 = time.monotonic()
    logged: float | None = None  # when progress was last logged
    cached: int | None = None  # the bytes on disk at the first report: all of them when nothing is missing

    def report(progress: DownloadProgress) -> None:  # on huggingface_hub's download threads
        nonlocal logged, cached
        startup.step(**progress.status())
        now = time.monotonic()
        cached = progress.done if cached is None else cached
        if progress.finished and progress.done == cached:
            size = f" ({human(progress.done)})" if progress.total else ""
            logger.info(f"The weights of {model} are in the cache{size}: {args.model_path}")
        elif progress.finished:
            logger.info(f"Downloaded {progress_text(progress.status())} in {now - t0:.1f} s")
        elif progress.done != progress.total and (logged is None or now - logged >= LOG_EVERY_S):
            where = "" if logged else f" into {args.model_path}"
            logger.info(f"Downloading {progress_text(progress.status())}{where}")
            logged = now

    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(
            None, download_weights, model, args.model_path, args.download_dir, report, cancel
        )
    except DownloadCancelled:
        return None
    except ValueError as e:
        return str(e)
    startup.enter("launching")
    return None
