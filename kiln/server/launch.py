"""`kiln serve`: start the engine process, bring up HTTP, warm up, report ready. A dead engine takes the
server down with a non-zero exit and its reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import tempfile
import time

import uvicorn

from kiln.config import ServerArgs
from kiln.scheduler.validate import Limits
from kiln.server.app import ServerState, create_app
from kiln.server.engine_client import EngineClient
from kiln.server.engine_proc import engine_main
from kiln.server.logs import configure_logging
from kiln.server.openai_api import OpenAIServing
from kiln.server.startup import StartupState
from kiln.server.tokenizer import load_tokenizer

logger = logging.getLogger("kiln")
WARMUP_PROMPT = "The capital city of France is"


class Launcher:
    def __init__(self, args: ServerArgs):
        self.args = args.with_defaults()
        self.state = ServerState(self.args, StartupState(self.args.startup_events))
        self.state.model_name = self.args.served_model_name or self.args.model_path
        ipc_dir = tempfile.mkdtemp(prefix="kiln-")
        self.engine_addr = f"ipc://{ipc_dir}/engine"
        self.front_addr = f"ipc://{ipc_dir}/front"
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.proc: mp.process.BaseProcess | None = None

    def start_engine(self) -> None:
        ctx = mp.get_context("spawn")
        self.status_q = ctx.Queue()
        self.proc = ctx.Process(
            target=engine_main,
            name="kiln::engine",
            args=(self.args, self.engine_addr, self.front_addr, self.status_q),
            daemon=True,
        )
        self.proc.start()

    async def bring_up(self) -> None:
        st = self.state.startup
        loop = asyncio.get_running_loop()
        tokenizer_future = loop.run_in_executor(
            None, load_tokenizer, self.args.model_path, self.args.tokenizer_path, self.args.chat_template
        )
        while True:
            try:
                msg = await loop.run_in_executor(None, self.status_q.get, True, 0.5)
            except queue.Empty:
                if not self.proc.is_alive():
                    return self.die(
                        f"the engine process exited with code {self.proc.exitcode} during startup"
                    )
                continue
            if msg[0] == "phase":
                st.enter(msg[1], **msg[2])
            elif msg[0] == "error":
                return self.die(msg[1], hint=_hint(msg[1]))
            elif msg[0] == "ready":
                info = msg[1]
                break
        self.state.info = info
        st.ledger = info.get("ledger")
        tokenizer = await tokenizer_future
        client = EngineClient(self.engine_addr, self.front_addr)
        client.start()
        self.state.client = client
        limits = Limits(info["vocab_size"], info["context_len"], info["max_total_num_tokens"])
        self.state.serving = OpenAIServing(client, tokenizer, limits, self.state.model_name)
        st.enter("warming_up")
        if not self.args.skip_server_warmup:
            from kiln.sampling_params import SamplingParams

            try:
                _, _, _, last = await asyncio.wait_for(
                    client.collect(
                        tokenizer.encode(WARMUP_PROMPT), SamplingParams(max_new_tokens=8, temperature=0)
                    ),
                    timeout=max(60.0, self.args.watchdog_timeout),
                )
            except Exception as e:  # noqa: BLE001 - any failure here is a failed startup
                return self.die(f"warm-up request failed: {e!r}")
            if last.error:
                return self.die(f"warm-up request failed: {last.error}")
        st.enter("ready")
        logger.info("The server is fired up and ready to roll!")

    async def watch_engine(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.proc is not None and not self.proc.is_alive() and not self.state.shutting_down:
                if not self.state.startup.failed:
                    self.die(f"the engine process died (exit code {self.proc.exitcode})")
                return

    def die(self, reason: str, hint: str = "") -> None:
        logger.error(f"Kiln failed: {reason}")
        self.state.startup.fail(reason, hint)
        self.exit_code = 1
        if self.server is not None:
            self.server.should_exit = True

    def stop_engine(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)

    def run(self) -> int:
        self.start_engine()
        app = create_app(self.state)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            tasks = [asyncio.create_task(self.bring_up()), asyncio.create_task(self.watch_engine())]
            yield
            self.state.shutting_down = True
            for t in tasks:
                t.cancel()

        app.router.lifespan_context = lifespan
        config = uvicorn.Config(
            app, host=self.args.host, port=self.args.port, log_level="warning", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        logger.info(f"Kiln serving {self.state.model_name} on http://{self.args.host}:{self.args.port}")
        try:
            self.server.run()
        finally:
            self.state.shutting_down = True
            self.stop_engine()
        if self.server.started is False and self.exit_code == 0:
            self.exit_code = 1
        return self.exit_code


def _hint(reason: str) -> str:
    return "run `kiln plan` with the same arguments to see the memory ledger" if "fit" in reason else ""


def serve(args: ServerArgs) -> int:
    configure_logging(args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.time()
    code = Launcher(args).run()
    logger.info(f"Kiln stopped after {time.time() - t0:.1f} s with exit code {code}")
    return code
