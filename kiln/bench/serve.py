"""`kiln bench serve`: stream a workload to any OpenAI-compatible (or Kiln-native) server and measure it."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kiln.bench.metrics import RequestRecord, compute_metrics, format_result
from kiln.bench.workloads import Conversation, count_tokens, render_messages, render_text

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions", "kiln": "/generate"}
BACKEND_ALIASES = {
    "sglang": "kiln",
    "sglang-native": "kiln",
    "sglang-oai": "openai",
    "vllm": "openai",
    "sglang-oai-chat": "openai-chat",
    "vllm-chat": "openai-chat",
}
# Arguments copied into every JSON record (when the parsed args carry them).
RECORD_ARGS = (
    "backend", "base_url", "model", "dataset_name", "dataset_path", "num_prompts", "max_concurrency", "seed",
    "ignore_eos", "random_input_len", "random_output_len", "random_range_ratio", "gsp_num_groups",
    "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len", "num_turns",
    "tokenizer", "sharegpt_output_len", "apply_chat_template", "flush_cache",
)  # fmt: skip


@dataclass
class RequestInput:
    """What one request sends: a completion prompt or chat messages."""

    prompt: str | list[dict[str, str]]
    prompt_len: int
    output_len: int


def build_body(backend: str, model: str, inp: RequestInput, ignore_eos: bool, extra: dict) -> dict:
    """The JSON body of a streaming request for `backend`."""
    if backend == "kiln":
        params: dict[str, Any] = {"max_new_tokens": inp.output_len, "temperature": 0.0}
        if ignore_eos:
            params["ignore_eos"] = True
        return {"text": inp.prompt, "sampling_params": params, "stream": True, **extra}
    key = "messages" if backend == "openai-chat" else "prompt"
    body = {
        "model": model,
        key: inp.prompt,
        "max_tokens": inp.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **extra}


def _delta(obj: dict, backend: str) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, backend: str, rec: RequestRecord, tok
) -> None:
    deltas: list[str] = []
    usage: dict = {}
    cache_n = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            now = time.perf_counter()
            if obj.get("error"):
                rec.error = str(obj["error"])[:300]
                return
            if backend == "kiln":
                usage = obj.get("meta_info") or usage
                done = int(usage.get("completion_tokens", len(obj.get("output_ids") or [])))
                if done > rec.output_tokens:
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(done - rec.output_tokens)
                    rec.output_tokens = done
                rec.text = obj.get("text", rec.text)
                continue
            usage = obj.get("usage") or usage
            cache_n = (obj.get("timings") or {}).get("cache_n", cache_n)
            if text := _delta(obj, backend):
                rec.chunk_times.append(now)
                deltas.append(text)
    rec.end = time.perf_counter()
    if backend != "kiln":
        rec.text = "".join(deltas)
        rec.output_tokens = int(usage.get("completion_tokens") or count_tokens(tok, rec.text))
        if len(deltas) == rec.output_tokens:
            rec.chunk_tokens = [1] * len(deltas)
        else:  # chunks carrying several tokens (or none): split by the tokenizer
            rec.chunk_tokens = [max(1, count_tokens(tok, d)) for d in deltas]
    details = usage.get("prompt_tokens_details") or {}
    cached = usage.get("cached_tokens", details.get("cached_tokens", cache_n))
    rec.cached_tokens = None if cached is None else int(cached)
    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
    rec.success = bool(rec.chunk_times)
    if not rec.success:
        rec.error = "the response carried no tokens"


async def send_request(
    client: httpx.AsyncClient, base_url: str, backend: str, body: dict, inp: RequestInput, tok, timeout: float
) -> RequestRecord:
    """Send one streaming request; never raises (errors land in the record)."""
    rec = RequestRecord(start=time.perf_counter(), prompt_tokens=inp.prompt_len)
    try:
        await asyncio.wait_for(
            _stream(client, base_url + ENDPOINTS[backend], body, backend, rec, tok), timeout
        )
    except asyncio.TimeoutError:
        rec.error = f"request timed out after {timeout:.0f} s (--request-timeout)"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError, TypeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    if rec.error:
        rec.success, rec.end = False, time.perf_counter()
    return rec


def request_input(
    backend: str, conv: Conversation, history: list[tuple[str, str]], i: int, tok
) -> RequestInput:
    """Turn `i` of `conv` with the answers so far; multi-turn prompts resend the whole conversation."""
    turn = conv.turns[i]
    if backend == "openai-chat":
        msgs = render_messages(history, turn.prompt)
        return RequestInput(msgs, chat_len(tok, msgs), turn.output_len)
    if len(conv.turns) == 1:
        return RequestInput(turn.prompt, turn.prompt_len, turn.output_len)
    text = render_text(history, turn.prompt)
    return RequestInput(text, count_tokens(tok, text), turn.output_len)


def chat_len(tok, msgs: list[dict[str, str]]) -> int:
    """Prompt tokens after the chat template (content tokens when the tokenizer has no template)."""
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return len(ids)
    return sum(count_tokens(tok, m["content"]) for m in msgs)


async def resolve_model(client: httpx.AsyncClient, base_url: str, model: str | None) -> str:
    """--model, else the first id the server lists at /v1/models, else "default"."""
    if model:
        return model
    try:
        resp = await client.get(base_url + "/v1/models", timeout=10)
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError):
        return "default"


class ServerUnusable(RuntimeError):
    """The server cannot be benchmarked (it does not answer, or refuses the warm-up): a one-line error, exit 1."""


async def flush_cache(client: httpx.AsyncClient, base_url: str) -> None:
    """POST /flush_cache, so that the run does not start on prompts the warm-up left in the prefix cache."""
    resp = await client.post(base_url + "/flush_cache", timeout=60)
    if resp.status_code != 200:
        raise ServerUnusable(f"POST {base_url}/flush_cache answered {resp.status_code}: {resp.text[:300]}")


def server_tokenizer(base_url: str) -> str | None:
    """The served model's tokenizer path from the server's /model_info (SGLang's route and field names; older
    SGLang servers answer only /get_model_info), or None when the server does not say."""
    for route in ("/model_info", "/get_model_info"):
        try:
            resp = httpx.get(base_url + route, timeout=10, trust_env=False)
            if resp.status_code == 200:
                info = resp.json()
                return info.get("tokenizer_path") or info.get("model_path") or None
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    return None


def server_accept_length(base_url: str) -> float | None:
    """The server's mean speculative accept length, where it reports one (SGLang's /server_info
    internal_states[0].avg_spec_accept_length, as SGLang's bench_serving reads it); None otherwise."""
    try:
        info = httpx.get(f"{base_url}/server_info", timeout=10).json()
        value = info["internal_states"][0].get("avg_spec_accept_length")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def default_output_file(args: Any) -> str:
    """SGLang's default name for the JSONL record file."""
    day = datetime.datetime.now().strftime("%m%d")
    if args.dataset_name.startswith("random"):
        return (
            f"{args.backend}_{day}_{args.num_prompts}_{args.random_input_len}_{args.random_output_len}.jsonl"
        )
    return f"{args.backend}_{day}_{args.num_prompts}_{args.dataset_name}.jsonl"


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each conversation begins: Poisson arrivals (all at 0 for inf)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        if math.isfinite(request_rate) and request_rate > 0:
            t += rng.expovariate(request_rate)
    return out


async def benchmark(args: Any, convs: list[Conversation], tok) -> tuple[list[RequestRecord], float]:
    """Run the workload; returns every request's record and the benchmark duration."""
    from tqdm.asyncio import tqdm

    backend = BACKEND_ALIASES.get(args.backend, args.backend)
    base_url = args.base_url.rstrip("/")
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    timeout = httpx.Timeout(args.request_timeout, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await resolve_model(client, base_url, args.model) if backend != "kiln" else args.model
        args.model = model

        async def one(inp: RequestInput) -> RequestRecord:
            body = build_body(backend, model, inp, args.ignore_eos, extra)
            return await send_request(client, base_url, backend, body, inp, tok, args.request_timeout)

        for _ in range(args.warmup_requests):
            inp = request_input(backend, convs[0], [], 0, tok)
            rec = await one(RequestInput(inp.prompt, inp.prompt_len, min(inp.output_len, 16)))
            if not rec.success:
                raise ServerUnusable(f"warm-up request to {base_url}{ENDPOINTS[backend]} failed: {rec.error}")
        if getattr(args, "flush_cache", False):
            await flush_cache(client, base_url)

        n_requests = sum(len(c.turns) for c in convs)
        sem = asyncio.Semaphore(args.max_concurrency or n_requests or 1)
        records: list[RequestRecord] = []
        bar = tqdm(total=n_requests, disable=args.disable_tqdm)
        start = time.perf_counter()

        async def run_conversation(conv: Conversation, offset: float) -> None:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - start)))
            history: list[tuple[str, str]] = []
            for i in range(len(conv.turns)):
                inp = request_input(backend, conv, history, i, tok)
                async with sem:
                    rec = await one(inp)
                records.append(rec)
                bar.update(1)
                if not rec.success:
                    return
                history.append((conv.turns[i].prompt, rec.text))

        offsets = arrival_offsets(len(convs), args.request_rate, args.seed)
        tasks = [asyncio.create_task(run_conversation(c, o)) for c, o in zip(convs, offsets, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=args.total_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
        bar.close()
    missing = n_requests - len(records)
    why = (
        f"not finished within --total-timeout {args.total_timeout:.0f} s (or its conversation failed earlier)"
    )
    records += [RequestRecord(start=start, end=start, error=why) for _ in range(missing)]
    return records, duration


def run_serve(args: Any) -> dict:
    """`kiln bench serve`: build the workload, run it, print the result block, append the JSON record."""
    from kiln.bench.workloads import build_workload, load_tokenizer

    if not args.base_url:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    if args.tokenizer is None:
        args.tokenizer = server_tokenizer(args.base_url)
        where = "named by the server's /model_info" if args.tokenizer else "(no /model_info answer)"
        print(f"tokenizer: {args.tokenizer or 'the default model'} {where}")
    tok = load_tokenizer(args.tokenizer)
    convs = build_workload(args, tok)
    if not convs:
        raise ValueError("the workload is empty")
    records, duration = asyncio.run(benchmark(args, convs, tok))
    metrics = compute_metrics(records, duration)
    metrics["accept_length"] = server_accept_length(args.base_url)
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    print(format_result(metrics, args.backend, args.request_rate, args.max_concurrency))
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "request_rate": rate}
    record.update({k: getattr(args, k, None) for k in RECORD_ARGS})
    record["num_requests"] = len(records)
    record.update(metrics)
    args.output_file = getattr(args, "output_file", None) or default_output_file(args)
    with open(args.output_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return record
