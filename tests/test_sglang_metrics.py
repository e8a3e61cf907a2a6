"""SGLang's metric names on Kiln's /metrics: every query of SGLang's Grafana dashboard (tests/data, its source
named there) finds its series, with SGLang's labels, on the shared `kiln serve`; the `sglang:` names exported
are the documented ones; the recent figures (gen_throughput, cache_hit_rate) follow SGLang's meaning."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.scheduler.io import SchedulerStats
from kiln.server.metrics import FRONT_LABELS, SCHEDULER_LABELS, Metrics, RecentRates

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = json.loads((ROOT / "tests" / "data" / "sglang_dashboard_queries.json").read_text())
DOC = ROOT / "docs" / "metrics.md"
NAME = re.compile(r"sglang:[a-zA-Z0-9_:]+")
SELECTOR = re.compile(r"(sglang:[a-zA-Z0-9_:]+)\{([^}]*)\}")
# labels a Prometheus server attaches to every scraped series itself (the target's address and job)
TARGET_LABELS = {"instance", "job"}


def dashboard_exprs() -> list[str]:
    return [expr for panel in DASHBOARD["panels"] for expr in panel["exprs"]]


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it is exported with."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


def sglang_stats(**counters: int) -> SchedulerStats:
    return SchedulerStats(**counters)


# ------------------------------------------------------------------------------------------ without a server
@pytest.mark.unit
def test_dashboard_copy_is_complete():
    """The copy holds every panel's queries: the figures the issue names are all among them."""
    names = {n for expr in dashboard_exprs() for n in NAME.findall(expr)}
    for wanted in ("gen_throughput", "cache_hit_rate", "num_running_reqs", "num_queue_reqs"):
        assert f"sglang:{wanted}" in names
    assert {v["name"] for v in DASHBOARD["variables"]} == {"instance", "model_name"}
    assert len(dashboard_exprs()) == 14


@pytest.mark.unit
def test_gen_throughput_is_recent_and_decays_when_idle():
    rates = RecentRates(window=5.0)
    for t, generated in [(100.0, 0), (101.0, 50), (102.0, 100)]:
        rates.add(sglang_stats(generation_tokens=generated), t)
    assert rates.gen_throughput(102.0) == pytest.approx(50.0)
    for t in (103.0, 104.0, 105.0, 106.0, 107.0, 108.0):  # heartbeats with nothing generated
        rates.add(sglang_stats(generation_tokens=100), t)
    assert rates.gen_throughput(108.0) == 0.0
    assert len(rates.samples) <= 7


@pytest.mark.unit
def test_cache_hit_rate_is_recent_and_held_between_prompts():
    rates = RecentRates(window=5.0)
    rates.add(sglang_stats(prompt_tokens=1000, cached_tokens=0), 10.0)
    rates.add(sglang_stats(prompt_tokens=2000, cached_tokens=0), 11.0)
    assert rates.hit_rate == 0.0
    # long after: a fully cached prompt of 100 tokens; the lifetime rate would be 100 / 2100
    rates.add(sglang_stats(prompt_tokens=2000, cached_tokens=0), 30.0)
    rates.add(sglang_stats(prompt_tokens=2100, cached_tokens=100), 31.0)
    assert rates.hit_rate == pytest.approx(1.0)
    for t in (32.0, 33.0, 40.0):  # decode-only reports: no new prompt, the last rate stays
        rates.add(sglang_stats(prompt_tokens=2100, cached_tokens=100, generation_tokens=int(t)), t)
    assert rates.hit_rate == pytest.approx(1.0)


@pytest.mark.unit
def test_close_reports_do_not_grow_the_window():
    rates = RecentRates(window=5.0)
    for i in range(1000):  # one report per millisecond for a second
        rates.add(sglang_stats(generation_tokens=i), 50.0 + i / 1000)
    assert len(rates.samples) <= 25
    assert rates.gen_throughput(50.999) == pytest.approx(1000.0, rel=0.01)


@pytest.mark.unit
def test_sglang_token_usage_leaves_out_what_the_prefix_cache_could_give_back():
    """SGLang's num_used_tokens is the pool less what is free or evictable: an idle server whose prefix cache
    holds 88 tokens reads 0 (SGLang's dashboards would otherwise show a full pool once the cache fills it), while
    kiln:num_used_tokens keeps counting the cache."""
    m = Metrics(None, "served-name")
    for evictable, running in [(88, 0), (48, 40)]:
        m.update_engine(
            SchedulerStats(
                used_tokens=88,
                cache_tokens=88,
                evictable_tokens=evictable,
                pool_tokens=1000,
                token_usage=0.088,
            )
        )
        got = first_values(m.render().decode())
        assert got["sglang:num_used_tokens"] == running and got["kiln:num_used_tokens"] == 88
        assert got["sglang:token_usage"] == pytest.approx(running / 1000)
        assert got["kiln:token_usage"] == pytest.approx(0.088)


@pytest.mark.unit
def test_labels_and_is_streaming():
    m = Metrics(None, "served-name")
    m.observe_output(0.0, 1.0, None, 1.0, 1, None)  # a streamed request's first token...
    m.observe_output(0.0, 1.0, 1.0, 1.5, 1, {"type": "length"})  # ... and its last
    m.observe_output(0.0, 2.0, None, 2.0, 8, {"type": "stop"})  # a request answered in one output
    got = samples(m.render().decode())
    ttft = got["sglang:time_to_first_token_seconds_count"]
    assert sorted(labels["is_streaming"] for labels in ttft) == ["false", "true"]
    assert sorted(labels["is_streaming"] for labels in got["sglang:num_requests_total"]) == ["false", "true"]
    for labels in got["sglang:num_running_reqs"] + got["sglang:gen_throughput"]:
        assert set(labels) == set(SCHEDULER_LABELS) and labels["model_name"] == "served-name"
        assert labels["engine_type"] == "unified" and labels["tp_rank"] == "0"
    assert set(got["sglang:inter_token_latency_seconds_count"][0]) == set(FRONT_LABELS)


# ------------------------------------------------------------------------------------------ the shared server
def documented_sglang() -> set[str]:
    return set(re.findall(r"^\| `(sglang:[a-z0-9_:]+)`", DOC.read_text(), re.M))


def first_values(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values.setdefault(s.name, s.value)
    return values


@pytest.fixture(scope="module")
def scraped(server) -> str:
    """/metrics right after one streamed and one unstreamed request (so the histograms have series), once the
    engine has reported their tokens."""
    before = first_values(httpx.get(f"{server.url}/metrics", timeout=30).text)["kiln:generation_tokens_total"]
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    native = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/generate", json=native, timeout=120)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        if first_values(text)["kiln:generation_tokens_total"] >= before + 12 or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_every_dashboard_query_finds_its_series(scraped):
    got = samples(scraped)
    for expr in dashboard_exprs():
        for name in NAME.findall(expr):
            assert got.get(name), f"{name} (in {expr!r}) is not on /metrics"
        for name, selector in SELECTOR.findall(expr):
            for label in re.findall(r"([a-zA-Z_]+)\s*=~?", selector):
                assert all(label in labels for labels in got[name]), (name, label)


def test_template_variables_have_the_served_values(scraped, server):
    served = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    assert served
    got = samples(scraped)
    for variable in DASHBOARD["variables"]:
        label = re.fullmatch(r"label_values\((\w+)\)", variable["query"]).group(1)
        if label in TARGET_LABELS:
            continue
        values = {
            labels.get(label) for name, sets in got.items() if name.startswith("sglang:") for labels in sets
        }
        assert values == {served}, (label, values)


def test_sglang_names_are_the_documented_ones(scraped):
    documented = documented_sglang()
    assert len(documented) >= 15, documented
    families = {f.name: f.type for f in text_string_to_metric_families(scraped)}
    exported = {n + "_total" if t == "counter" else n for n, t in families.items() if n.startswith("sglang:")}
    exported = {n for n in exported if not n.endswith("_created")}  # the client's creation timestamps
    assert documented - exported == set(), f"documented but not exported: {sorted(documented - exported)}"
    assert exported - documented == set(), f"exported but not documented: {sorted(exported - documented)}"


def test_sglang_figures_agree_with_kilns(scraped):
    values = first_values(scraped)
    for kiln, sglang in [("kiln:prompt_tokens_total", "sglang:prompt_tokens_total"),
                         ("kiln:generation_tokens_total", "sglang:generation_tokens_total"),
                         ("kiln:cached_tokens_total", "sglang:cached_tokens_total"),
                         ("kiln:max_total_num_tokens", "sglang:max_total_num_tokens"),
                         ("kiln:context_len", "sglang:context_len")]:  # fmt: skip
        assert values[kiln] == values[sglang], (kiln, sglang)
    assert values["sglang:max_total_num_tokens"] > 0
    assert values["sglang:gen_throughput"] > 0  # scraped within a window of the two requests' tokens
    assert 0 <= values["sglang:cache_hit_rate"] <= 1
