"""`kiln serve`: start the engine process, bring up HTTP, warm up, report ready. A dead or stalled engine takes
the server down with a non-zero exit and its reason; SIGTERM drains in-flight requests, then exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
import threading
import time

import torch
import uvicorn

from kiln.config import ServerArgs
from kiln.config_compat import foreign_flag_messages
from kiln.core.logs import configure_logging
from kiln.loader.generation_config import sampling_defaults
from kiln.scheduler.io import (
    EngineReady,
    ServerInfo,
    StartupFailed,
)
from kiln.scheduler.validate import Limits
from kiln.server.app import ServerState, create_app
from kiln.server.connections import guarded_protocol
from kiln.server.download import download_phase
from kiln.server.embeddings import PoolingServing
from kiln.server.engine_client import EngineClient, RequestLog
from kiln.server.lora_routes import LoraNames
from kiln.server.openai_api import OpenAIServing
from kiln.server.ranks import RankProcesses, serve_ranks
from kiln.server.startup import StartupState
from kiln.text.tokenizer import load_tokenizer

logger = logging.getLogger("kiln")
WARMUP_PROMPT = "The capital city of France is"
WARMUP_NEW_TOKENS = 8
DIE_GRACE_SECONDS = 3.0
# a phase may run this many times its prediction before the watchdog ends it (at the default --watchdog-timeout)
WATCHDOG_MULTIPLE = 3.0
WATCHDOG_DEFAULT_S = ServerArgs.watchdog_timeout


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT made Kiln's: during startup the first stops it (nothing to drain); once ready
    the first drains, the second aborts what is still running and exits, and only a third is uvicorn's own forced
    exit. uvicorn's handler would also raise the signal again at exit (exit code 143 or 130, and tracebacks where
    it cancels streams), which a clean stop asked for by its operator should not show."""

    def __init__(self, config: uvicorn.Config, launcher: Launcher):
        super().__init__(config)
        self.launcher = launcher
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals = 0

    def handle_exit(self, sig, frame) -> None:
        launcher, self.signals = self.launcher, self.signals + 1
        if self.loop is None or self.signals > 2:
            return super().handle_exit(sig, frame)
        if not launcher.state.startup.ready:
            if not launcher.state.shutting_down and not launcher.state.startup.failed:
                logger.info(f"Shutting down during startup (phase {launcher.state.startup.phase})")
            launcher.state.shutting_down = True
            self.should_exit = True
        elif launcher.state.shutting_down:
            self.loop.call_soon_threadsafe(launcher.cut_drain)
        else:
            launcher.state.shutting_down = True
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(launcher.drain()))


class Launcher:
    def __init__(self, args: ServerArgs):
        self.args = args.with_defaults()
        first = "downloading" if self.args.hub_model_id else "launching"  # a model id: its weights first
        self.state = ServerState(self.args, StartupState(self.args.startup_events, first))
        self.state.lora = LoraNames.of(self.args)
        self.state.model_name = self.args.served_model_name or self.args.model_path
        # read once, here: every request and /model_info see the same values (a local path: with_defaults)
        self.state.sampling_defaults = sampling_defaults(self.args.sampling_defaults, self.args.model_path)
        if self.state.sampling_defaults:
            logger.info(f"Sampling defaults from generation_config.json: {self.state.sampling_defaults}")
        self.ipc_dir = tempfile.mkdtemp(prefix="kiln-")  # the sockets' folder, removed as run() returns
        self.engine_addr = f"ipc://{self.ipc_dir}/engine"
        self.front_addr = f"ipc://{self.ipc_dir}/front"
        self.exit_code = 0
        self.server: _Server | None = None
        self.drain_deadline = 0.0
        self.ranks = RankProcesses(self.args)
        self.stop_download = threading.Event()  # the server is stopping: a download in progress stops too
        # while _engine_startup reads the ranks' reports it also judges their deaths: watch_engine, judging them
        # too, would race it for the queue and could name the phase before the dead rank's last report
        self.following_startup = False
        self.prediction = _predict(self.args)
        if self.prediction is not None:
            self.state.startup.predicted = self.prediction[1]

    @property
    def proc(self) -> mp.process.BaseProcess | None:
        """Rank 0's process (the only one with one rank)."""
        return self.ranks.procs.get(0)

    def start_engine(self, listener: socket.socket | None = None) -> None:
        """The engine's ranks: before serving (`listener` given, closed in a forked rank) they may be forked; a
        model id's start them after its download, beside uvicorn's threads and connections, so spawned."""
        forkable, fds = listener is not None, ((listener.fileno(),) if listener is not None else ())
        self.status_q = self.ranks.start(self.engine_addr, self.front_addr, forkable, fds)

    async def _engine_startup(self) -> ServerInfo | None:
        """Follows the ranks' phases until rank 0 is ready; a rank silent past --watchdog-timeout fails startup."""
        self.following_startup = True
        try:
            return await self._follow_startup()
        finally:
            self.following_startup = False

    async def _follow_startup(self) -> ServerInfo | None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg = await loop.run_in_executor(None, self.status_q.get, True, 0.5)
            except queue.Empty:
                if self.ranks.dead():
                    self.engine_exited()
                    return None
                if self._startup_stalled():
                    return None
                continue
            match msg:
                case StartupFailed(reason=reason, rank=rank):
                    if await loop.run_in_executor(None, self.ranks.crashed_peer, rank):
                        self.engine_exited()  # its collective failed because that peer died: blame the peer
                    else:
                        self.die(self.ranks.name(rank) + reason, hint=_hint(reason))
                    return None
                case EngineReady(info=info):
                    return info
                case _:
                    self.ranks.note(msg, self.state.startup)

    def _startup_stalled(self) -> bool:
        rank, phase, silent = self.ranks.most_silent()
        limit, why = self.phase_limit(phase)
        if silent <= limit:
            return False
        predicted = (self.state.startup.predicted or {}).get(phase)
        expected = f"predicted {predicted:.0f} s, " if predicted is not None else ""
        self.die(
            f"{self.ranks.name(rank)}phase {phase} made no progress for {silent:.0f} s ({expected}elapsed "
            f"{self.state.startup.phase_elapsed():.0f} s; limit {limit:.0f} s: {why})",
            hint="see the engine log above for where it stopped",
        )
        return True

    def phase_limit(self, phase: str) -> tuple[float, str]:
        """How long a phase may go without a report, and why. A --watchdog-timeout given is taken as given (as
        SGLang does); at its default, WATCHDOG_MULTIPLE x the phase's prediction where that is longer, so a
        first kernel build or a cold compile of many shapes is not cut short on a slow host."""
        given = self.args.watchdog_timeout
        # spawning the engine and importing torch is slow on a busy machine: launching gets its own allowance
        floor = given if phase != "launching" else max(given, 120)
        predicted = (self.state.startup.predicted or {}).get(phase)
        if given != WATCHDOG_DEFAULT_S or predicted is None or WATCHDOG_MULTIPLE * predicted <= floor:
            return floor, "--watchdog-timeout"
        return WATCHDOG_MULTIPLE * predicted, f"{WATCHDOG_MULTIPLE:.0f}x the prediction"

    async def bring_up(self) -> None:
        try:
            await self._bring_up()
        except Exception as e:  # noqa: BLE001 - a failed startup must be reported, never swallowed
            logger.exception("startup failed")
            self.die(f"startup failed: {e!r}")

    async def _bring_up(self) -> None:
        loop = asyncio.get_running_loop()
        tokenizer_future = loop.run_in_executor(
            None, load_tokenizer, self.args.model_path, self.args.tokenizer_path, self.args.chat_template
        )
        if self.args.hub_model_id:  # the weights first, the engine after: it loads them
            failure = await download_phase(self.args, self.state.startup, self.stop_download)
            if failure or self.stop_download.is_set():
                tokenizer_future.add_done_callback(lambda f: f.cancelled() or f.exception())
                if failure:
                    self.die(failure)
                return
            self.start_engine()
        info = await self._engine_startup()
        if info is None:  # the engine's refusal said why; the tokenizer's own error would only repeat it
            tokenizer_future.add_done_callback(lambda f: f.cancelled() or f.exception())
            return
        self.state.info = info
        self.state.startup.ledger = info.ledger
        self.state.startup.graphs = info.graphs
        self.state.startup.draft_graphs = info.draft_graphs
        tokenizer = await tokenizer_future
        client = EngineClient(self.engine_addr, self.front_addr)
        if self.args.log_requests:
            client.request_log = RequestLog(tokenizer.decode, self.args.log_requests_level)
        if not self.args.disable_metrics:
            from kiln.server.metrics import Metrics

            self.state.metrics = client.metrics = Metrics(info, self.state.model_name)
        client.start()
        self.state.client = client
        limits = Limits(info.vocab_size, info.context_len, info.max_total_num_tokens)
        max_in_flight = (
            info.max_running_requests + self.args.max_queued_requests
            if self.args.max_queued_requests is not None
            else None
        )
        self.state.serving = OpenAIServing(
            client,
            tokenizer,
            limits,
            self.state.model_name,
            self.args.request_timeout,
            max_in_flight,
            grammar_backend=self.args.grammar_backend,
            tool_call_parser=self.args.tool_call_parser,
            reasoning_parser=self.args.reasoning_parser,
            sampling_defaults=self.state.sampling_defaults,
        )
        self.state.serving.lora = self.state.lora
        self.state.pooling = PoolingServing(self.state.serving, info)
        self.state.startup.enter("warming_up")
        if not self.args.skip_server_warmup and not await self._warm_up(client, tokenizer):
            return
        await self._report_memory(client)
        self.state.startup.enter("ready")
        self._record_timings()
        logger.info("The server is fired up and ready to roll!")

    def _record_timings(self) -> None:
        """What each phase took, into this host's history, for the next start's prediction."""
        if self.prediction is None or self.args.node_rank:
            return
        from kiln.server.startup_prediction import record

        startup = self.state.startup
        try:
            record(self.args, self.prediction[0], dict(startup.timings), startup.kernels, dict(startup.loads))
        except Exception as e:  # noqa: BLE001 - a history that cannot be written costs the next estimate only
            logger.debug(f"startup history not recorded: {e!r}")

    async def _warm_up(self, client: EngineClient, tokenizer) -> bool:
        from kiln.sampling_params import SamplingParams

        ids, pooling = tokenizer.encode(WARMUP_PROMPT), self.state.info.pooling
        need, pool = len(ids) + WARMUP_NEW_TOKENS, self.state.info.max_total_num_tokens
        if need > pool:  # the operator's to fix, not a client's: say so with the numbers
            self.die(
                f"the KV pool holds {pool} tokens, fewer than the warm-up request needs ({len(ids)} prompt + "
                f"{WARMUP_NEW_TOKENS} new = {need}): start with --max-total-tokens {need} or more (or "
                "--skip-server-warmup, and no request longer than the pool)"
            )
            return False
        try:
            result = await asyncio.wait_for(
                client.collect(  # no client's request: the metrics start at the first one
                    ids,
                    # an embedding server's warm-up embeds its prompt: it generates nothing
                    SamplingParams(max_new_tokens=0 if pooling else WARMUP_NEW_TOKENS, temperature=0),
                    observe=False,
                    pool=pooling,
                ),
                timeout=self.args.watchdog_timeout,
            )
        except Exception as e:  # noqa: BLE001 - any failure here is a failed startup
            # a rank whose loop stopped turning holds the others in a collective: blame it, not the request
            timed_out = isinstance(e, TimeoutError)
            stalled = self.ranks.stalled_rank(self.args.watchdog_timeout / 2) if timed_out else None
            if stalled is not None:
                rank, silent = stalled
                self.die(
                    f"{self.ranks.name(rank)}the engine loop made no progress in phase serving for {silent:.0f} s "
                    "(--watchdog-timeout), so the warm-up request timed out"
                )
            else:
                self.die(f"warm-up request failed: {e!r}")
            return False
        if result.output.error:
            self.die(f"warm-up request failed: {result.output.error}")
            return False
        return True

    async def _report_memory(self, client: EngineClient) -> None:
        from kiln.memory.measure import format_check

        info = (await client.engine_state()).info
        self.state.info = info
        self.state.startup.memory_check = info.memory_check
        for rank, check in enumerate(info.memory_check_per_rank or [info.memory_check]):
            tag = f"rank {rank} " if info.tp_size > 1 else ""
            logger.info(f"Memory check {tag}(ledger vs measured): {format_check(check)}")

    async def watch_engine(self) -> None:
        """After startup: every rank must stay alive, rank 0 answer within --watchdog-timeout while it has work, and
        with several ranks each rank's loop turn (a rank that stops turning holds every other in a collective)."""
        while True:
            await asyncio.sleep(0.5)
            if self.following_startup:
                continue
            if self.ranks.dead() and not self.state.shutting_down:
                self.engine_exited()
                return
            stalled = self.ranks.stalled_rank(self.args.watchdog_timeout)
            if stalled is not None and not self.state.shutting_down:
                rank, silent = stalled
                self.state.stalled = (
                    f"{self.ranks.name(rank)}the engine loop has not turned for {silent:.0f} s"
                )
                self.die(
                    f"{self.ranks.name(rank)}the engine loop made no progress in phase serving for {silent:.0f} s "
                    "(--watchdog-timeout)"
                )
                return
            client = self.state.client
            if client is not None:
                silent = time.time() - client.last_output_time
                stalled = silent > self.args.watchdog_timeout
                self.state.stalled = (
                    f"the engine loop has not answered for {silent:.0f} s" if stalled else None
                )

    async def drain(self) -> None:
        """SIGTERM: refuse new requests (503), let in-flight ones finish up to --shutdown-timeout, abort the rest."""
        client = self.state.client
        logger.info(
            f"Shutting down: draining {client.num_active if client else 0} in-flight requests "
            f"(up to {self.args.shutdown_timeout:.0f} s)"
        )
        self.drain_deadline = time.time() + self.args.shutdown_timeout
        while client is not None and client.num_active and time.time() < self.drain_deadline:
            await asyncio.sleep(0.1)
        if client is not None and client.num_active:
            logger.info(f"Aborting {client.num_active} requests still running")
            client.abort(abort_all=True, message="the server is shutting down")
            end = time.time() + 5
            while client.num_active and time.time() < end:
                await asyncio.sleep(0.05)
        self.server.should_exit = True

    def cut_drain(self) -> None:
        """A second SIGTERM/SIGINT while draining: what is still running is aborted now."""
        if time.time() < self.drain_deadline:
            logger.info("Second signal: the drain ends now")
            self.drain_deadline = 0.0

    def engine_exited(self) -> None:
        while True:  # phases the ranks reported just before one died
            try:
                msg = self.status_q.get_nowait()
            except (queue.Empty, OSError, EOFError):
                break
            self.ranks.note(msg, self.state.startup)
        rank, code = self.ranks.first_dead()
        phase = self.ranks.phase_of(rank, self.state.startup.phase)
        process = "the engine process" if self.args.tp_size == 1 else f"rank {rank}'s engine process"
        self.die(f"{process} exited with code {code} during {phase}" + self.ranks.reason_of(rank))

    def die(self, reason: str, hint: str = "") -> None:
        if self.state.startup.failed:
            return
        logger.error(f"Kiln failed: {reason}" + (f" ({hint})" if hint else ""))
        self.state.startup.fail(reason, hint)
        if self.state.client is not None:
            self.state.client.fail_all(reason)
        self.exit_code = 1
        if self.server is not None:  # keep /status answering briefly so `kiln wait` can read the reason
            if self.server.loop is not None:
                self.server.loop.call_later(DIE_GRACE_SECONDS, setattr, self.server, "should_exit", True)
            else:
                self.server.should_exit = True

    def stop_engine(self) -> None:
        """Every rank's process ended and reaped before the front exits, so none outlives it."""
        self.ranks.stop()

    def run(self) -> int:
        try:
            return self._run()
        finally:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _run(self) -> int:
        try:  # before the engine starts: a port in use is one line, not a refusal a minute into loading
            listener = _listen(self.args.host, self.args.port)
        except OSError as e:
            taken = e.errno == errno.EADDRINUSE
            hint = (
                "another server holds it: stop that one, or choose another --port"
                if taken
                else "check --host"
            )
            logger.error(
                f"Kiln failed: cannot listen on {self.args.host}:{self.args.port}: {e.strerror or e} ({hint})"
            )
            return 1
        if not self.args.hub_model_id:  # else once its weights are downloaded (_bring_up)
            self.start_engine(listener)
        app = create_app(self.state)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.server.loop = asyncio.get_running_loop()
            tasks = [asyncio.create_task(self.bring_up()), asyncio.create_task(self.watch_engine())]
            yield
            self.state.shutting_down = True
            self.stop_download.set()  # before asyncio waits for its executor threads, one of them downloading
            for t in tasks:
                t.cancel()

        app.router.lifespan_context = lifespan
        config = uvicorn.Config(
            app,
            host=self.args.host,
            port=self.args.port,
            log_level=_uvicorn_level(self.args.log_level_http or self.args.log_level),
            timeout_graceful_shutdown=5,
            http=guarded_protocol(self.args),
            timeout_keep_alive=self.args.timeout_keep_alive,
        )
        if self.args.uvicorn_access_log_exclude_prefixes:
            logging.getLogger("uvicorn.access").addFilter(
                _AccessLogExclude(self.args.uvicorn_access_log_exclude_prefixes)
            )
        self.server = _Server(config, self)
        logger.info(f"Kiln serving {self.state.model_name} on http://{self.args.host}:{self.args.port}")
        try:
            self.server.run(sockets=[listener])
        finally:
            self.state.shutting_down = True
            self.stop_engine()
        if not self.server.started and self.exit_code == 0:
            self.exit_code = 1
        return self.exit_code


def _predict(args: ServerArgs):
    """(facts, {phase: seconds}) for this start, or None where it cannot be made: a prediction never stops one."""
    from kiln.platform import detect_device
    from kiln.server.startup_prediction import predict_for

    try:
        facts, predicted = predict_for(args, args.device if args.device != "auto" else detect_device())
    except Exception as e:  # noqa: BLE001 - no ETA is better than no server
        logger.debug(f"no startup prediction: {e!r}")
        return None
    logger.info(
        "Startup prediction: "
        + ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in predicted.items() if phase != "total")
        + f"; total {predicted['total']:.0f} s"
    )
    return facts, predicted


def _uvicorn_level(level: str) -> str:
    """uvicorn knows six level names; Python's logging takes others too (warn, fatal), which map to uvicorn's."""
    level = {"warn": "warning", "fatal": "critical"}.get(level.lower(), level.lower())
    return level if level in uvicorn.config.LOG_LEVELS else "info"


class _AccessLogExclude(logging.Filter):
    """--uvicorn-access-log-exclude-prefixes: uvicorn's access record has (client, method, path, version, status)."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) >= 3 else ""
        return not (isinstance(path, str) and path.startswith(self.prefixes))


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before the engine starts. Its family follows the host as
    uvicorn's own binding does (IPv6 for an address with a colon); SO_REUSEADDR as asyncio sets it, and an IPv6
    socket serves IPv6 alone, as asyncio's does. Listening at once makes the port ours: a second server
    starting meanwhile finds it taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def _hint(reason: str) -> str:
    return "run `kiln plan` with the same arguments to see the memory ledger" if "fit" in reason else ""


def _front_refusal(args: ServerArgs) -> str | None:
    """What the engine would refuse from the flags, the model's config and the platform (kiln.scheduler.resolve's
    check: everything but the memory plan, which probes the device the engine then owns), refused before any
    process starts, in the words `kiln plan` uses, rather than a minute into loading."""
    from kiln.scheduler.resolve import check, target_platform

    try:
        check(args, target_platform(args, serving=True), serving=True)
    except ValueError as e:  # StartupRefused, and ServerArgs' own checks
        return str(e)
    return None


def serve(args: ServerArgs) -> int:
    # the front computes nothing worth a second core (the engine does), and with one thread its torch never starts
    # an OpenMP pool, which the engine processes it forks would otherwise inherit broken (kiln.server.ranks)
    torch.set_num_threads(1)
    configure_logging(args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the SGLang flags Kiln takes without implementing, each said once with what Kiln does instead
    for level, line in foreign_flag_messages(args.foreign_flags):
        logger.log(level, line)
    try:
        args = args.with_defaults()
    except ValueError as e:  # a Hugging Face model id whose config cannot be fetched: before any server is up
        logger.error(f"Kiln failed: {e}")
        return 1
    refusal = _front_refusal(args)
    if refusal:
        logger.error(f"Kiln failed: {refusal}")
        return 1
    t0 = time.time()
    code = serve_ranks(args) if args.node_rank > 0 else Launcher(args).run()
    logger.info(f"Kiln stopped after {time.time() - t0:.1f} s with exit code {code}")
    return code
