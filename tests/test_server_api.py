"""The OpenAI-compatible and native HTTP API of a real `kiln serve` (default model), through the official
`openai` client and httpx: shapes, greedy results, streaming, logprobs, sampling controls, prefix caching."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

pytestmark = pytest.mark.server

FRANCE = "What is the capital of France?"
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


def info(server) -> dict:
    r = httpx.get(f"{server.url}/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def generate(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def complete(client, model, prompt=PROMPT, max_tokens=8, **kw):
    extra = {k: kw.pop(k) for k in ("ignore_eos", "top_k", "min_p") if k in kw}
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, extra_body=extra or None, **kw
    )


# ---------------------------------------------------------------------------------------------- models, chat
def test_models_lists_the_served_model(server, client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].object == "model"
    assert model == info(server)["server_args"]["model_path"]  # no --served-model-name: the path
    assert client.models.retrieve(model).id == model


@pytest.fixture(scope="module")
def france_chat(client, model):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": FRANCE}],
        max_tokens=48,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )


def test_chat_greedy_knows_paris(france_chat):
    choice = france_chat.choices[0]
    assert france_chat.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # ended by EOS within 48 tokens (used by the ignore_eos test)
    assert france_chat.usage.completion_tokens == len(choice.logprobs.content)
    assert (
        france_chat.usage.total_tokens
        == france_chat.usage.prompt_tokens + france_chat.usage.completion_tokens
    )


def test_chat_logprobs_shape_and_greedy_max(france_chat):
    content = france_chat.choices[0].logprobs.content
    assert content
    # the last entry may be the EOS token that ended the answer (counted in completion_tokens, not in the text)
    assert "".join(e.token for e in content).startswith(france_chat.choices[0].message.content)
    for entry in content:
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert entry.logprob <= 0.0
        assert 1 <= len(entry.top_logprobs) <= 3
        for top in entry.top_logprobs:
            # a token that is part of a character gives its own bytes (its text alone is U+FFFD)
            assert bytes(top.bytes).decode("utf-8", "replace") == top.token and top.logprob <= 0.0
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(max(tops), abs=1e-5)


def test_chat_stream_matches_and_reports_usage(client, model, france_chat):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": FRANCE}],
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == france_chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == france_chat.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == france_chat.usage.prompt_tokens


def test_continue_final_message_continues_the_assistant_prefill(server, client, model, default_model):
    """The last assistant message is continued, as the chat template renders it left open; the answer is the
    continuation only, the same as a completion of that rendered prompt."""
    from kiln.text.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": FRANCE}, {"role": "assistant", "content": PROMPT}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, extra_body={"continue_final_message": True}, **GREEDY
    )
    text = chat.choices[0].message.content
    assert text and PROMPT not in text
    rendered = load_tokenizer(default_model).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True
    )["input_ids"]
    assert chat.usage.prompt_tokens == len(rendered)
    assert complete(client, model, prompt=rendered, max_tokens=8, **GREEDY).choices[0].text == text


def test_ignore_eos_runs_past_eos(client, model, france_chat):
    n = france_chat.usage.completion_tokens + 3
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": FRANCE}],
        max_tokens=n,
        extra_body=NO_EOS,
        **GREEDY,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == n
    assert r.choices[0].message.content.startswith(france_chat.choices[0].message.content)


# ---------------------------------------------------------------------------------------------- completions
def test_completion_stream_equals_non_stream_with_usage(client, model):
    full = complete(client, model, max_tokens=10, ignore_eos=True, **GREEDY)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = list(
        complete(
            client,
            model,
            max_tokens=10,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert len([c for c in chunks if c.choices]) >= 2  # really streamed, not one block
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_gives_length_and_exact_count(client, model):
    r = complete(client, model, prompt="Once upon a time", max_tokens=5, ignore_eos=True, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_completion_logprobs_shape_and_greedy_max(client, model):
    r = complete(client, model, max_tokens=6, logprobs=3, ignore_eos=True, **GREEDY)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == text
    for i in range(1, 6):
        assert lp.text_offset[i] - lp.text_offset[i - 1] == len(lp.tokens[i - 1])
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and all(v <= 0.0 for v in top.values())
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert top[tok] == pytest.approx(chosen, abs=1e-5)


def test_completion_stream_logprobs_cover_every_token(client, model):
    """A token whose text is held back (it could start the stop string) still gets its logprob streamed."""
    ref = complete(client, model, max_tokens=10, ignore_eos=True, **GREEDY).choices[0].text
    assert "." in ref  # " Paris." - the "." is held back by the stop string ".QQ"
    chunks = list(
        complete(
            client,
            model,
            max_tokens=10,
            ignore_eos=True,
            logprobs=1,
            stop=[".QQ"],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    assert len(tokens) == chunks[-1].usage.completion_tokens == 10
    assert "".join(tokens) == ref


def test_completion_stream_logprobs_join_into_the_non_stream_ones(client, model):
    """Each chunk's text_offset counts from the start of the choice's text, so the chunks' logprobs joined are
    the non-streamed response's, also where a possible stop string holds a token's text back."""
    kw = dict(prompt="1, 2, 3,", max_tokens=12, logprobs=1, stop=["7, 8"], **GREEDY)
    full = complete(client, model, **kw).choices[0]
    chunks = [c.choices[0] for c in complete(client, model, stream=True, **kw) if c.choices]
    assert any(c.text == "" and c.logprobs.tokens for c in chunks)  # a token whose text was held back
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.logprobs.tokens] == full.logprobs.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == full.logprobs.text_offset
    # the prompt's KV is cached by then: prefilled apart, its logits may differ in the last bits
    streamed = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(full.logprobs.token_logprobs, abs=1e-3)


def test_n_samples_count_the_prompt_once(client, model):
    one = complete(client, model, prompt="Once upon a time", max_tokens=1, **GREEDY)
    r = complete(
        client, model, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, ignore_eos=True
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 24
    assert all(c.finish_reason == "length" for c in r.choices)
    assert len({c.text for c in r.choices}) > 1  # independent samples


SEEDED = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)


def test_seeded_n_samples_differ_and_reproduce(client, model):
    """Sample j of a seeded request draws with seed + j: n different samples, the same n again, and sample 0
    is what n=1 with the seed gives."""
    first = [c.text for c in complete(client, model, n=3, **SEEDED).choices]
    assert len(set(first)) > 1
    assert [c.text for c in complete(client, model, n=3, **SEEDED).choices] == first
    assert complete(client, model, n=1, **SEEDED).choices[0].text == first[0]


def test_seeded_n_samples_differ_on_generate(server):
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "sampling_seed": 5, "ignore_eos": True}
    bodies = generate(server, {"text": "Once upon a time", "sampling_params": params})
    assert len(bodies) == 3 and len({b["text"] for b in bodies}) > 1


def test_a_rid_given_twice_in_one_batch_is_a_400_not_a_hang(server):
    body = {
        "text": ["Hello", "Paris is"],
        "rid": ["twice", "twice"],
        "sampling_params": {"max_new_tokens": 2},
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    assert "'twice' is given to more than one generation" in r.json()["error"]["message"]


def test_a_clients_rid_aborts_all_its_samples(server):
    """n > 1 runs as rid-0, rid-1, ...: aborting the rid the client gave stops them all (as SGLang does)."""
    rid = f"many-{uuid.uuid4().hex[:8]}"
    params = {"max_new_tokens": 2000, "n": 2, "ignore_eos": True, "temperature": 0.5}
    body = {"text": "Story:", "rid": rid, "sampling_params": params, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        seen: set[int] = set()
        for line in lines:  # both samples running: each has streamed a chunk
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["index"])
            if len(seen) == 2:
                break
        assert httpx.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=30).status_code == 200
        finals = {}
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["meta_info"]["finish_reason"]:
                    finals[chunk["index"]] = chunk["meta_info"]
    assert {i: m["finish_reason"]["type"] for i, m in finals.items()} == {0: "abort", 1: "abort"}, finals
    assert all(m["completion_tokens"] < 2000 for m in finals.values())


def test_seed_reproducible_and_different_seeds_differ(client, model):
    def run(seed: int) -> str:
        r = complete(
            client,
            model,
            prompt="Once upon a time",
            max_tokens=32,
            temperature=1.0,
            seed=seed,
            ignore_eos=True,
        )
        assert r.usage.completion_tokens == 32
        return r.choices[0].text

    # one after the other: each alone in its batch, so equal outputs come from the seed alone
    a, b, c = run(1234), run(1234), run(98765)
    assert a == b
    assert a != c


@pytest.fixture(scope="module")
def reference(client, model) -> str:
    text = complete(client, model, max_tokens=16, ignore_eos=True, **GREEDY).choices[0].text
    assert len(text) > 12
    return text


def test_stop_string_not_in_output(client, model, reference):
    mid = len(reference) // 2
    stop = reference[mid : mid + 3]
    expected = reference[: reference.find(stop)]
    kw = dict(max_tokens=16, ignore_eos=True, stop=["NEVER-SEEN", stop], **GREEDY)
    r = complete(client, model, **kw)
    assert r.choices[0].text == expected and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("matched_stop") == stop
    chunks = [c for c in complete(client, model, stream=True, **kw) if c.choices]
    assert all(stop not in c.choices[0].text for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------- native /generate
def test_generate_text_and_input_ids(server, default_model):
    from kiln.text.tokenizer import load_tokenizer

    ids = load_tokenizer(default_model).encode(PROMPT)
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    by_text = generate(server, {"text": PROMPT, "sampling_params": params})
    by_ids = generate(server, {"input_ids": ids, "sampling_params": params})
    for body in (by_text, by_ids):
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == 4 == len(body["output_ids"])
        assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < len(ids)
        assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert by_text["text"] == by_ids["text"] and by_text["output_ids"] == by_ids["output_ids"]
    out = by_text["output_ids"]
    k = next(i for i, t in enumerate(out) if t not in out[:i] and i > 0)
    stopped = generate(server, {"input_ids": ids, "sampling_params": {**params, "stop_token_ids": [out[k]]}})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[k]}
    assert stopped["meta_info"]["completion_tokens"] == k + 1


def test_generate_stop_string_matched(server, reference):
    stop = reference[len(reference) // 2 :][:3]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    body = generate(server, {"text": PROMPT, "sampling_params": params})
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert body["text"] == reference[: reference.find(stop)]


# ---------------------------------------------------------------------------------------------- prefix cache
def long_prompt() -> str:
    tag = uuid.uuid4().hex[:8]
    return f"[{tag}] " + " ".join(f"Item {i} is a red box with a small round lid." for i in range(16))


def test_same_long_prompt_twice_hits_the_cache(server, client, model):
    prompt = long_prompt()
    first = complete(client, model, prompt=prompt, max_tokens=2, **GREEDY)
    n = first.usage.prompt_tokens
    assert n > 150
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = complete(client, model, prompt=prompt, max_tokens=2, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0.9 * n < cached < n
    assert second.choices[0].text == first.choices[0].text
    native = generate(server, {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert native["meta_info"]["prompt_tokens"] == n
    assert 0.9 * n < native["meta_info"]["cached_tokens"] < n


def test_flush_cache_empties_the_radix_tree(server, client, model):
    prompt = long_prompt()
    complete(client, model, prompt=prompt, max_tokens=1, **GREEDY)
    assert info(server)["integrity"]["cached"] > 0
    r = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    integrity = info(server)["integrity"]
    assert integrity["ok"] and integrity["cached"] == 0 and integrity["in_use"] == 0
    assert integrity["free"] == integrity["total"]
    again = complete(client, model, prompt=prompt, max_tokens=1, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------------------------------------- server info
def test_server_info_has_args_memory_and_integrity(server):
    data = info(server)
    args = data["server_args"]
    assert args["max_total_tokens"] == 16384 and args["chunked_prefill_size"] == 512
    assert args["max_running_requests"] == 32 and args["host"] == "127.0.0.1"
    assert args["port"] == int(server.url.rsplit(":", 1)[1])
    assert data["max_total_num_tokens"] == 16384 and data["max_running_requests"] == 32
    assert data["context_len"] > 0 and data["vocab_size"] == 49152
    lines = {line["name"]: line["bytes"] for line in data["ledger"]["lines"]}
    assert lines["weights"] > 100e6 and lines["kv pool"] > 0
    assert data["measured"]["kv_pool"] == pytest.approx(lines["kv pool"], rel=0.05)
    assert data["measured"]["weights"] == pytest.approx(lines["weights"], rel=0.05)
    integrity = data["integrity"]
    assert integrity["ok"] is True and integrity["total"] == 16384
    assert integrity["free"] + integrity["cached"] + integrity["in_use"] == integrity["total"]
    assert data["num_running_reqs"] == 0 and data["num_waiting_reqs"] == 0
    assert data["startup"]["phase"] == "ready"
