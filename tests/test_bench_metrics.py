"""Serving-benchmark metrics on hand-computed timelines, and `kiln bench serve` against a fake server."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.bench.metrics import RequestRecord, compute_metrics, format_result, peak_output_throughput

pytestmark = pytest.mark.unit


def _rec(start, chunks, end, out, prompt=10, cached=None, success=True, error=""):
    return RequestRecord(
        start=start,
        end=end,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[k for _, k in chunks],
        prompt_tokens=prompt,
        output_tokens=out,
        cached_tokens=cached,
        success=success,
        error=error,
    )


# A: sent at 0, tokens at 0.5 (1), 0.7 (1), 1.1 (2 in one chunk), done at 1.2.
# B: sent at 1.0, tokens at 1.2 (1), 1.5 (1), done at 1.5.
A = _rec(0.0, [(0.5, 1), (0.7, 1), (1.1, 2)], 1.2, 4, prompt=10, cached=5)
B = _rec(1.0, [(1.2, 1), (1.5, 1)], 1.5, 2, prompt=20, cached=0)
FAILED = _rec(0.0, [(0.1, 1)], 9.0, 50, prompt=1000, cached=1000, success=False, error="HTTP 500")


def test_per_request_ttft_tpot_itl():
    assert A.ttft == pytest.approx(0.5)
    assert A.latency == pytest.approx(1.2)
    assert A.tpot == pytest.approx((1.2 - 0.5) / 3)
    # the 2-token chunk contributes two gaps of 0.4 / 2
    assert A.itls() == pytest.approx([0.2, 0.2, 0.2])
    assert B.tpot == pytest.approx(0.3)
    assert B.itls() == pytest.approx([0.3])
    assert _rec(0.0, [(0.3, 1)], 0.3, 1).tpot is None


def test_aggregate_figures():
    m = compute_metrics([A, B], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_throughput"] == pytest.approx(15.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_throughput"] == pytest.approx(18.0)
    assert m["concurrency"] == pytest.approx((1.2 + 0.5) / 2.0)
    assert m["max_concurrent_requests"] == 2
    # tokens at 0.7, 1.1 (x2), 1.2, 1.5 all fall in (0.5, 1.5]
    assert m["max_output_tokens_per_s"] == pytest.approx(5.0)
    assert m["prefix_cache_hit_rate"] == pytest.approx(5 / 30)
    assert m["total_cached_tokens"] == 5


def test_latency_statistics():
    m = compute_metrics([A, B], duration=2.0)
    # TTFT 500, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(350.0)
    assert m["median_ttft_ms"] == pytest.approx(350.0)
    assert m["std_ttft_ms"] == pytest.approx(150.0)
    assert m["p90_ttft_ms"] == pytest.approx(470.0)
    assert m["p99_ttft_ms"] == pytest.approx(497.0)
    # TPOT 233.33, 300 ms
    assert m["mean_tpot_ms"] == pytest.approx((700 / 3 + 300) / 2)
    # ITL 200, 200, 200, 300 ms: p90 interpolates at rank 2.7 -> 200 + 0.7 * 100
    assert m["mean_itl_ms"] == pytest.approx(225.0)
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["p90_itl_ms"] == pytest.approx(270.0)
    assert m["max_itl_ms"] == pytest.approx(300.0)
    # E2E 1200, 500 ms
    assert m["mean_e2e_latency_ms"] == pytest.approx(850.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(500 + 0.99 * 700)


def test_failed_requests_are_excluded():
    with_failed = compute_metrics([A, FAILED, B], duration=2.0)
    without = compute_metrics([A, B], duration=2.0)
    assert with_failed["failed"] == 1 and with_failed["errors"] == ["HTTP 500"]
    for key, value in without.items():
        if key not in ("failed", "errors"):
            assert with_failed[key] == value, key


def test_no_success_and_no_cache_report():
    m = compute_metrics([FAILED], duration=1.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0
    assert m["mean_ttft_ms"] is None and m["prefix_cache_hit_rate"] is None
    m = compute_metrics([_rec(0.0, [(0.1, 1), (0.2, 1)], 0.2, 2)], duration=1.0)
    assert m["prefix_cache_hit_rate"] is None and m["total_cached_tokens"] is None
    assert "n/a" in format_result(m)


def test_peak_output_window_is_one_second():
    assert peak_output_throughput([_rec(0.0, [(0.0, 1), (1.0, 1)], 1.0, 2)]) == 1.0
    assert peak_output_throughput([_rec(0.0, [(0.0, 1), (0.999, 3)], 1.0, 4)]) == 4.0
    assert peak_output_throughput([_rec(0.0, [(0.0, 2)], 0.1, 2), _rec(0.0, [(0.5, 3)], 0.6, 3)]) == 5.0


def test_result_block():
    text = format_result(compute_metrics([A, B], 2.0), backend="openai", max_concurrency=4)
    assert text.startswith("=" * 12 + " Serving Benchmark Result " + "=" * 12)
    assert "Successful requests:                     2" in text
    assert "Peak output token throughput (tok/s):    5.00" in text
    assert "Mean TTFT (ms):                          350.00" in text
    assert "Prefix cache hit rate:                   16.67%" in text


# ----------------------------------------------------------------------------- fake server


def _tokenizer_dir(path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kiln.bench.workloads import prose

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator([prose(rng, 50) for _ in range(100)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(str(path))
    return str(path)


def _fake_app(log: list):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake-model"}]}

    async def handle(req: Request, chat: bool):
        body = await req.json()
        prompt = json.dumps(body["messages"]) if chat else body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse({"error": "boom"}, status_code=500)
        if "SLOW" in prompt:
            await asyncio.sleep(3)
        usage = {
            "prompt_tokens": len(prompt.split()) + 7,
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        log.append({"body": body, "usage": usage})

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                piece = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
                yield f"data: {json.dumps({'choices': [{'index': 0, **piece}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        n = body["sampling_params"]["max_new_tokens"]
        log.append({"body": body})

        async def events():
            done = 0
            while done < n:
                await asyncio.sleep(0.002)
                done = min(n, done + 2)
                meta = {"prompt_tokens": 11, "completion_tokens": done, "cached_tokens": 4}
                chunk = {"text": "".join(f" w{i}" for i in range(done)), "output_ids": list(range(done))}
                yield f"data: {json.dumps({**chunk, 'meta_info': meta})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    log: list = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_fake_app(log), host="127.0.0.1", port=port, log_level="warning")
    config.timeout_graceful_shutdown = 1
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}", log
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _serve(url, tok_dir, out, *extra):
    from kiln.bench.cli import main

    argv = ["serve", "--base-url", url, "--tokenizer", tok_dir, "--output-json", str(out), "--disable-tqdm"]
    argv += ["--request-timeout", "10", "--total-timeout", "60", "--seed", "3", *extra]
    return main(argv)


STATS = ("mean", "median", "std", "p90", "p99")
FIELDS = [
    "date", "backend", "base_url", "model", "dataset_name", "num_prompts", "request_rate", "max_concurrency",
    "seed", "ignore_eos", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "input_throughput", "output_throughput", "total_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "concurrency", "prefix_cache_hit_rate",
] + [f"{s}_{m}_ms" for s in STATS for m in ("ttft", "tpot", "itl", "e2e_latency")]  # fmt: skip


def test_serve_against_fake_openai_server(fake_server, tok_dir, tmp_path, capsys):
    url, log = fake_server
    out = tmp_path / "runs.jsonl"
    args = ["--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "40"]
    args += [
        "--random-output-len",
        "5",
        "--random-range-ratio",
        "1.0",
        "--max-concurrency",
        "2",
        "--ignore-eos",
    ]
    for run in range(2):
        log.clear()
        assert _serve(url, tok_dir, out, *args) == 0
        lines = out.read_text().splitlines()
        assert len(lines) == run + 1  # appended, one record per run
        rec = json.loads(lines[-1])
        missing = [f for f in FIELDS if rec.get(f) is None]
        assert not missing, missing
        sent = log[1:]  # log[0] is the warm-up request
        assert len(sent) == 6 and rec["completed"] == 6 and rec["failed"] == 0
        assert rec["total_output_tokens"] == sum(e["usage"]["completion_tokens"] for e in sent) == 30
        assert rec["total_input_tokens"] == sum(e["usage"]["prompt_tokens"] for e in sent)
        assert rec["prefix_cache_hit_rate"] == pytest.approx(18 / rec["total_input_tokens"])
        assert rec["model"] == "fake-model" and rec["max_concurrent_requests"] <= 2
        body = sent[0]["body"]
        assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model" and body["max_tokens"] == 5
        assert rec["mean_tpot_ms"] > 0 and rec["mean_itl_ms"] > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_serve_counts_failures_and_timeouts(fake_server, tok_dir, tmp_path):
    url, log = fake_server
    data = tmp_path / "prompts.jsonl"
    prompts = ["hello there friend", "please FAIL now", "a SLOW one", "the last one"]
    data.write_text("".join(json.dumps({"prompt": p, "output_len": 3}) + "\n" for p in prompts))
    out = tmp_path / "r.jsonl"
    log.clear()
    argv = ["--dataset-name", "jsonl", "--dataset-path", str(data), "--request-rate", "50"]
    assert _serve(url, tok_dir, out, *argv, "--request-timeout", "0.5") == 0
    rec = json.loads(out.read_text())
    assert (rec["completed"], rec["failed"]) == (2, 2)
    assert any("HTTP 500" in e for e in rec["errors"]) and any("timed out" in e for e in rec["errors"])
    assert rec["total_output_tokens"] == 6


def test_multi_turn_resends_the_conversation(fake_server, tok_dir, tmp_path):
    url, log = fake_server
    log.clear()
    argv = [
        "--backend",
        "openai-chat",
        "--dataset-name",
        "multi-turn",
        "--num-prompts",
        "2",
        "--num-turns",
        "3",
    ]
    argv += ["--random-input-len", "12", "--random-output-len", "4", "--random-range-ratio", "1.0"]
    argv += ["--warmup-requests", "0"]
    assert _serve(url, tok_dir, tmp_path / "m.jsonl", *argv) == 0
    rec = json.loads((tmp_path / "m.jsonl").read_text())
    assert rec["completed"] == 6
    by_first = {}
    for e in log:
        by_first.setdefault(e["body"]["messages"][0]["content"], []).append(e["body"]["messages"])
    assert len(by_first) == 2
    for convo in by_first.values():
        assert [len(m) for m in convo] == [1, 3, 5]
        for prev, nxt in zip(convo, convo[1:], strict=False):
            assert nxt[: len(prev)] == prev
            assert nxt[len(prev)] == {"role": "assistant", "content": " w0 w1 w2 w3"}


def test_kiln_native_stream_with_multi_token_chunks(fake_server):
    import httpx

    from kiln.bench.serve import RequestInput, build_body, send_request

    url, log = fake_server
    inp = RequestInput("some prompt", 2, 5)
    body = build_body("kiln", "", inp, ignore_eos=True, extra={})
    assert body["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await send_request(client, url, "kiln", body, inp, tok=None, timeout=10)

    rec = asyncio.run(go())
    assert rec.success, rec.error
    assert rec.chunk_tokens == [2, 2, 1] and rec.output_tokens == 5
    assert (rec.prompt_tokens, rec.cached_tokens) == (11, 4)
    assert rec.text == " w0 w1 w2 w3 w4"
    assert len(rec.itls()) == 3 and rec.tpot is not None


def test_poisson_arrivals():
    from kiln.bench.serve import arrival_offsets

    assert arrival_offsets(4, float("inf"), 0) == [0.0] * 4
    a = arrival_offsets(2000, 10.0, 1)
    assert a == arrival_offsets(2000, 10.0, 1) and a != arrival_offsets(2000, 10.0, 2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_latency_blocks_list_percentiles_in_ascending_order():
    """SGLang's order within each block: Mean, Median, then percentiles from low to high (ITL ends with Max)."""
    text = format_result(compute_metrics([A, B], 2.0), backend="openai")
    blocks: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("-"):
            title = line.strip("-")
            blocks[title] = []
        elif line.startswith(("Mean", "Median", "P9", "Max")) and "(ms)" in line:
            blocks[title].append(line.split(" (ms)")[0])
    assert blocks["Inter-token Latency"] == [
        "Mean ITL",
        "Median ITL",
        "P90 ITL",
        "P95 ITL",
        "P99 ITL",
        "Max ITL",
    ]
    for short, title in (("E2E Latency", "End-to-End Latency"), ("TTFT", "Time to First Token")):
        assert blocks[title] == [f"Mean {short}", f"Median {short}", f"P90 {short}", f"P99 {short}"]
    for rows in blocks.values():
        pcts = [int(r[1:3]) for r in rows if r.startswith("P")]
        assert pcts == sorted(pcts), rows
