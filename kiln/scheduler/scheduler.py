"""The scheduler: continuous batching over the paged KV cache. Each step either prefills (admitted requests,
long prompts in chunks, on top of their cached prefix) or decodes one token for every running request;
when the pool runs dry during decode, requests are retracted to the queue and finish later."""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import asdict

import torch

import kiln.distributed as distributed
from kiln.memory.hiradix_cache import HiRadixCache
from kiln.memory.host_pool import HostKVPool
from kiln.memory.prefix_cache import NoPrefixCache, PrefixCache
from kiln.memory.radix_cache import RadixCache
from kiln.memory.state_checkpoints import HybridRadixCache
from kiln.memory.storage_tier import FileStorageTier
from kiln.runner.model_runner import ModelRunner
from kiln.sampling_params import InvalidParam
from kiln.scheduler.adapters import AdapterPins
from kiln.scheduler.io import AbortReq, GenerateReq, ReqOutput, RequestCounters, SchedulerStats
from kiln.scheduler.kv import KVManager
from kiln.scheduler.output import OutputProcessor
from kiln.scheduler.overlap import ForwardThread, InFlight, OverlapSchedule
from kiln.scheduler.prefill import PrefillAdder
from kiln.scheduler.req import Req, ReqState
from kiln.scheduler.spec_step import SpecDecoder
from kiln.scheduler.step import StepKind
from kiln.scheduler.step_cycle import StepCycle
from kiln.scheduler.validate import Limits, validate_pool, validate_request
from kiln.structured.backend import make_backend
from kiln.structured.cache import GrammarCache
from kiln.structured.spec import spec_of
from kiln.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("kiln")

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
IN_BATCH_PREFIX_TOKENS = 32  # SGLang's IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
DEADLINE_MESSAGE = "request timed out (--request-timeout)"


def make_prefix_cache(
    runner: ModelRunner,
    page_size: int,
    disabled: bool,
    host_tier_tokens: int,
    write_policy: str,
    storage: FileStorageTier | None = None,
    track_interval: int = 256,
) -> PrefixCache:
    """The prefix cache: none, the radix tree, or (--enable-hierarchical-cache) the radix tree over the device
    pool, a host tier of host_tier_tokens and, if given, a storage tier."""
    if disabled:
        return NoPrefixCache(runner.allocator, page_size)
    states = getattr(runner, "state_pool", None)
    if states is not None:  # a hybrid model: the tree keeps state checkpoints in the pool's spare slots
        return HybridRadixCache(runner.allocator, page_size, states, runner.table.size, track_interval)
    if host_tier_tokens > 0:
        host = HostKVPool(runner.kv_pool, host_tier_tokens)
        return HiRadixCache(runner.allocator, host, write_policy, storage)
    return RadixCache(runner.allocator, page_size)


class Scheduler(StepCycle, OverlapSchedule):
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        *,
        max_total_num_tokens: int,
        max_running_requests: int,
        context_len: int,
        chunked_prefill_size: int | None,
        max_prefill_tokens: int,
        page_size: int = 1,
        disable_radix_cache: bool = False,
        schedule_policy: str = "fcfs",
        schedule_conservativeness: float = 1.0,
        random_seed: int | None = None,
        stream_interval: int = 1,
        decode_log_interval: int = 40,
        host_tier_tokens: int = 0,
        hicache_write_policy: str = "write_through",
        kv_storage: FileStorageTier | None = None,
        grammar_backend: str = "llguidance",
        spec: SpecDecoder | None = None,
        mamba_track_interval: int = 256,
        overlap: bool = False,
    ):
        """overlap: run plain decode steps one ahead on a forward thread (kiln.scheduler.overlap)."""
        self.runner = runner
        self.tokenizer = tokenizer
        allocator = runner.allocator
        cache = make_prefix_cache(
            runner,
            page_size,
            disable_radix_cache,
            host_tier_tokens,
            hicache_write_policy,
            kv_storage,
            mamba_track_interval,
        )
        self.kv = KVManager(allocator, runner.table, cache, radix_enabled=not disable_radix_cache)
        cfg = runner.model_config
        self.limits = Limits(cfg.vocab_size, context_len, max_total_num_tokens)
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = (
            chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        )
        self.max_prefill_tokens = max_prefill_tokens
        self.policy = schedule_policy
        self.init_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * schedule_conservativeness)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio = self.init_ratio
        self.seed_rng = random.Random(random_seed)
        eos = set(cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.out = OutputProcessor(eos, context_len, stream_interval)
        backend = make_backend(
            grammar_backend, tokenizer, [getattr(tokenizer, "eos_token_id", None), *sorted(eos)]
        )
        self.grammars = GrammarCache(backend) if backend is not None else None
        self.grammar_queue: list[Req] = []  # constrained requests whose matcher is compiling
        self.decode_log_interval = decode_log_interval
        self.spec = spec  # speculative decoding: decode steps verify the drafter's chains or trees
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.outbox: list[ReqOutput] = []
        self.last_was_prefill = False
        self.counters = RequestCounters()
        self.integrity_violations = 0
        self._decode_tokens_since_log = 0
        self._decode_log_t0 = time.perf_counter()
        self._comm_logged = 0.0  # distributed.comm_seconds() at the last decode log
        # LoRA: each request's adapter slot, from admission to its end (a fake runner in tests has no .lora)
        self.lora_slots = AdapterPins(getattr(runner, "lora", None))
        self.forward_thread = ForwardThread(self._forward_and_sample) if overlap else None
        self.in_flight: InFlight | None = None  # the decode step launched and not yet processed (overlap)

    # ------------------------------------------------------------------ requests in
    def add_request(self, msg: GenerateReq) -> None:
        p = msg.params
        try:
            validate_request(msg.input_ids, p, self.limits)
            validate_pool(msg.pool, p, self.limits)
        except InvalidParam as e:
            self.outbox.append(self.out.error_output(msg.rid, len(msg.input_ids), f"{e.param}: {e}"))
            return
        gen = None
        if not p.is_greedy:
            gen = torch.Generator().manual_seed(
                p.seed if p.seed is not None else self.seed_rng.getrandbits(63)
            )
        detok = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens, p.no_stop_trim)
        req = Req(msg.rid, list(msg.input_ids), p, detok, gen, msg.stream, msg.deadline, msg.log_metrics)
        req.pool = msg.pool
        if msg.lora_path is not None:
            problem = self.lora_slots.name_problem(msg.lora_path)
            if problem:
                self.outbox.append(
                    self.out.error_output(msg.rid, len(msg.input_ids), f"lora_path: {problem}")
                )
                return
            req.lora_name, req.lora_uid = msg.lora_path, self.lora_slots.uid_of(msg.lora_path)
        spec = spec_of(p)
        if spec is not None and self.grammars is None:
            message = f"{spec.kind}: constrained decoding is off on this server (--grammar-backend none)"
            self.outbox.append(self.out.error_output(msg.rid, len(msg.input_ids), message))
            return
        self.reqs[req.rid] = req
        if spec is not None and self.grammars is not None:
            req.grammar = self.grammars.submit(spec)
            req.state = ReqState.WAITING_FOR_GRAMMAR
            self.grammar_queue.append(req)
        else:
            self.waiting.append(req)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue; a refused one fails alone. With several
        tensor-parallel ranks each waits for its compile, so that every rank admits the same requests."""
        if not self.grammar_queue:
            return
        if distributed.tp_size() > 1:
            wait_futures([r.grammar for r in self.grammar_queue if r.grammar is not None])
        elif not (self.waiting or self.running or self.chunked or self.in_flight):  # sleep on the compiles
            wait_futures(
                [r.grammar for r in self.grammar_queue if r.grammar is not None], 0.01, FIRST_COMPLETED
            )
        for req in [r for r in self.grammar_queue if r.grammar is None or r.grammar.done()]:
            self.grammar_queue.remove(req)
            future, req.grammar = req.grammar, None
            error = future.exception() if future is not None else None
            if error is not None:
                self._finish_abort(req, str(error), error=str(error))
                continue
            req.matcher = future.result() if future is not None else None
            req.state = ReqState.WAITING
            self.waiting.append(req)

    def abort(self, msg: AbortReq) -> None:
        self.drain()
        # a client's rid names all its generations: n > 1 runs them as rid-0, rid-1, ... (SGLang aborts every
        # rid the given one begins; the suffix keeps "r1" from aborting "r10")
        targets = [
            req
            for rid, req in self.reqs.items()
            if msg.abort_all or rid == msg.rid or (msg.rid is not None and rid.startswith(f"{msg.rid}-"))
        ]
        for req in targets:
            self._finish_abort(req, msg.message)

    def _finish_abort(self, req: Req, message: str, error: str | None = None) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.grammar_queue:
            self.grammar_queue.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.kv.release(req)
        req.finish_reason = {"type": "abort", "message": message}
        req.error = error
        if error:
            self.counters.failed += 1
        else:
            self.counters.aborted += 1
        self._emit(req)

    # ------------------------------------------------------------------ the loop
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.grammar_queue or self.in_flight)

    def step(self) -> list[ReqOutput]:
        """One scheduling iteration; returns the outputs it produced. With several tensor-parallel ranks, rank 0's
        loop turns expired deadlines into aborts every rank receives (expired_aborts) instead."""
        if distributed.tp_size() == 1:
            self._expire_deadlines()
        self.kv.cache.poll()
        self._admit_compiled()
        if self._chains():
            self._overlap_decode()
            return self.take_outputs()
        self.drain()
        plan = self.schedule()
        self.last_was_prefill = plan is not None and plan.kind == StepKind.PREFILL
        self.run_plan(plan)
        return self.take_outputs()

    def take_outputs(self) -> list[ReqOutput]:
        """The outputs produced since the last step or take, handed over once."""
        out, self.outbox = self.outbox, []
        if self.spec is not None:
            self.spec.annotate(out)
        return out

    def _expire_deadlines(self) -> None:
        if self.in_flight is not None and self.expired_aborts():
            self.drain()  # which may end some of them first
        for msg in self.expired_aborts():
            self._finish_abort(self.reqs[msg.rid], msg.message)

    def expired_aborts(self) -> list[AbortReq]:
        """The requests past their deadline (--request-timeout), as the aborts that end them."""
        now = time.time()
        return [
            AbortReq(r.rid, message=DEADLINE_MESSAGE)
            for r in self.reqs.values()
            if r.deadline is not None and now > r.deadline
        ]

    def _build_prefill(self) -> list[Req]:
        if not self.waiting and self.chunked is None:
            return []
        adder = PrefillAdder(
            self.kv,
            self.running,
            self.new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            self.max_running_requests,
        )
        if self.chunked is not None:
            if not adder.add(self.chunked):
                return []
        if self.policy == "lpm" and len(self.waiting) <= 128:
            self.waiting = deque(sorted(self.waiting, key=lambda r: -self.kv.match(r)))
        deferred: list[Req] = []
        while self.waiting and adder.budget.chunked is None:
            req = self.waiting[0]
            if self._shares_uncached_prefix(req, adder.budget.reqs):
                deferred.append(self.waiting.popleft())  # next batch, when that prefix is cached
                continue
            pinned = self.lora_slots.pin(req)
            if pinned is None:  # its adapter was unloaded while it waited
                self._finish_abort(
                    req, "its LoRA adapter was unloaded", error=f"lora_path: {req.lora_name!r} unloaded"
                )
                continue
            if not pinned:  # every adapter slot is pinned by other adapters' running requests
                break
            if not adder.add(req):
                self.lora_slots.unpin_waiting(req)
                break
            self.waiting.popleft()
        self.waiting.extendleft(reversed(deferred))
        self.chunked = adder.budget.chunked
        for req in adder.budget.reqs:
            req.state = ReqState.PREFILLING
        return adder.budget.reqs

    def _shares_uncached_prefix(self, req: Req, batch: list[Req]) -> bool:
        """In-batch prefix caching: True when a request already in this batch computes the next
        IN_BATCH_PREFIX_TOKENS tokens req would compute (same prefix, not yet cached), so req waits one batch
        and then reads them from the radix cache instead of computing them a second time."""
        if not batch or req.table_idx is not None or not self.kv.radix_enabled:
            return False
        cached = self.kv.match(req)
        window = req.fill_ids[cached : cached + IN_BATCH_PREFIX_TOKENS]
        if len(window) < IN_BATCH_PREFIX_TOKENS:
            return False
        return any(
            o.fill_ids[cached : cached + IN_BATCH_PREFIX_TOKENS] == window
            and o.fill_ids[:cached] == req.fill_ids[:cached]
            for o in batch
        )

    def _decoded(self, produced: int, graphed: bool) -> None:
        """A decode step's bookkeeping: the step count, the new-token ratio's decay, the decode log line (graphed:
        whether the step replayed a captured graph)."""
        self.counters.decode_steps += 1
        self.new_token_ratio = max(
            self.min_ratio,
            self.new_token_ratio - (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS,
        )
        self._log_decode(produced, graphed)

    def _retract(self) -> None:
        """Free the KV of the requests with the least progress until one more decode step fits."""
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        retracted = []
        if (
            self.chunked is not None
        ):  # a half-prefilled prompt yields first: its chunks stay in the radix cache
            req, self.chunked = self.chunked, None
            self.kv.release(req)
            req.num_retractions += 1
            retracted.append(req)
        while not self.kv.decode_fits(len(self.running)) and len(self.running) > 1:
            victim = order.pop(0)
            self.running.remove(victim)
            self.kv.release(victim)
            if self.spec is not None:
                self.spec.release(victim.rid)
            victim.num_retractions += 1
            retracted.append(victim)
        for r in reversed(retracted):
            r.state = ReqState.PREEMPTED
            self.waiting.appendleft(r)
        if retracted:
            self.counters.retracted += len(retracted)
            old = self.new_token_ratio
            decoded = sum(len(r.output_ids) for r in self.running)
            budget = sum(r.params.max_new_tokens for r in self.running)
            self.new_token_ratio = min(1.0, (decoded + 20 * len(self.running)) / (budget + 1))
            logger.info(
                f"KV cache pool is full. Retract requests. #retracted_reqs: {len(retracted)}, "
                f"#new_token_ratio: {old:.4f} -> {self.new_token_ratio:.4f}"
            )
        if not self.kv.decode_fits(len(self.running)):
            last = self.running[0]
            self._finish_abort(
                last, "Out of memory even after retracting all other requests in the decode batch."
            )

    # ------------------------------------------------------------------ introspection
    def _log_prefill(self, reqs: list[Req], new_tokens: int, cached: int) -> None:
        if (
            distributed.tp_rank() != 0
        ):  # every rank runs the same batches: rank 0 speaks for them, as in SGLang
            return
        logger.info(
            f"Prefill batch, #new-seq: {len(reqs)}, #new-token: {new_tokens}, #cached-token: {cached}, "
            f"token usage: {self.running_token_usage():.2f}, #running-req: {len(self.running)}, #queue-req: {len(self.waiting)}, "
            f"input throughput (token/s): {new_tokens / max(self.runner.last_forward_seconds, 1e-9):.2f}"
        )

    def _log_decode(self, batch: int, graphed: bool) -> None:
        self._decode_tokens_since_log += batch
        if self.counters.decode_steps % self.decode_log_interval or distributed.tp_rank() != 0:
            return
        now = time.perf_counter()
        elapsed = max(now - self._decode_log_t0, 1e-9)
        tput = self._decode_tokens_since_log / elapsed
        self._decode_tokens_since_log, self._decode_log_t0 = 0, now
        logger.info(
            f"Decode batch, #running-req: {len(self.running)}, #token: {self.used_tokens()}, "
            f"token usage: {self.running_token_usage():.2f}, cuda graph: {graphed}, gen throughput (token/s): {tput:.2f}, "
            f"{self._spec_log()}#queue-req: {len(self.waiting)}{self._comm_share(elapsed)}"
        )

    def _spec_log(self) -> str:
        """SGLang's accept figures in the decode line, with speculative decoding on."""
        if self.spec is None:
            return ""
        return f"accept len: {self.spec.accept_length():.2f}, accept rate: {self.spec.accept_rate():.2f}, "

    def _comm_share(self, elapsed: float) -> str:
        """With several ranks: the share of the time since the last decode log that rank 0 spent in collectives."""
        if distributed.tp_size() == 1:
            return ""
        spent = distributed.comm_seconds()
        share, self._comm_logged = (spent - self._comm_logged) / elapsed, spent
        return f", comm share: {share:.3f}"

    def used_tokens(self) -> int:
        return self.kv.allocator.size - self.kv.free_tokens()

    def token_usage(self) -> float:
        return self.used_tokens() / max(1, self.kv.allocator.size)

    def running_token_usage(self) -> float:
        """SGLang's "token usage" of its log lines: the pool less what is free or evictable, as a fraction."""
        return (self.used_tokens() - self.kv.evictable_tokens()) / max(1, self.kv.allocator.size)

    def live_reqs(self) -> list[Req]:
        live = list(self.running)
        if self.chunked is not None:
            live.append(self.chunked)
        return live

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the gauges and counters, for /metrics and the server info."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            token_usage=self.token_usage(),
            used_tokens=self.used_tokens(),
            cache_tokens=self.kv.cache_tokens(),
            evictable_tokens=self.kv.evictable_tokens(),
            pool_tokens=self.kv.allocator.size,
            integrity_violations=self.integrity_violations,
            **asdict(self.counters),
            **self._grammar_stats(),
            **self.kv.tier_stats(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        return {
            "spec_verify_ct": self.spec.totals.verify_ct,
            "spec_accepted_drafts": self.spec.totals.accepted_drafts,
            "spec_accept_length": self.spec.accept_length(),
            "spec_accept_rate": self.spec.accept_rate(),
        }

    def _grammar_stats(self) -> dict:
        if self.grammars is None:
            return {}
        counters = self.grammars.counters
        return {
            "grammar_cache_hits": counters.hits,
            "grammar_cache_misses": counters.misses,
            "grammar_compile_buckets": counters.buckets(),
            "grammar_compile_seconds_sum": counters.compile_seconds_sum,
        }

    def check_integrity(self) -> dict:
        self.drain()
        report = self.kv.integrity(self.live_reqs())
        misplaced = self.misplaced_states()
        if misplaced:
            report = {**report, "ok": False, "misplaced_states": misplaced}
        if not report["ok"]:
            self.integrity_violations += 1
            logger.error(f"KV pool integrity violated: {report}")
        return report

    def misplaced_states(self) -> list[str]:
        """Each live request whose state is not the one of the queue it is in ("rid: state in queue")."""
        queues = [
            ("grammar queue", self.grammar_queue, {ReqState.WAITING_FOR_GRAMMAR}),
            ("waiting", self.waiting, {ReqState.WAITING, ReqState.PREEMPTED}),
            ("running", self.running, {ReqState.RUNNING}),
            ("chunked", [self.chunked] if self.chunked is not None else [], {ReqState.PREFILLING}),
        ]
        return [
            f"{r.rid}: {r.state.value} in {name}"
            for name, reqs, allowed in queues
            for r in reqs
            if r.state not in allowed
        ]

    def lora_control(self, kind: str, args: dict) -> tuple[bool, dict]:
        """Load or unload a LoRA adapter between steps: a running request keeps the slot it pinned."""
        return self.lora_slots.control(kind, args, list(self.reqs.values()))

    def flush_cache(self) -> bool:
        if self.waiting or self.running or self.chunked or self.grammar_queue:
            return False
        self.drain()  # the extra rows of requests that already ended
        self.kv.flush()
        return True
