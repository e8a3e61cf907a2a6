"""Hugging Face model ids (--model-path ORG/NAME) fetched through huggingface_hub from a local stand-in for the Hub
(tests/hub_server.py): a plan reads the config and tokenizer alone, serve downloads the weights in its
`downloading` phase (resumable, only the checkpoint's files) and restarts offline from the cache, and a bad id
or an unreachable hub is one line naming the id."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from hub_server import LocalHub

from kiln import plan
from kiln.config import ServerArgs
from kiln.core.units import human
from kiln.loader import hub as kiln_hub
from kiln.wait import describe

pytestmark = pytest.mark.unit

MODEL_ID = "kiln-test/tiny-hub"
GATED_ID = "kiln-test/gated"
BIN_ONLY_ID = "kiln-test/bin-only"
TOKEN = "hf_kiln_test_token"
# files of other formats beside the checkpoint, which no download may fetch
OTHERS = {
    "consolidated.safetensors": b"not the checkpoint",
    "pytorch_model.bin": b"x",
    "original/params.json": b"{}",
}


def _repo(hub: LocalHub, tiny_llama: str) -> None:
    """The tiny Llama with an index naming its one shard (so the other .safetensors is no part of it)."""
    from safetensors import safe_open

    with safe_open(str(Path(tiny_llama) / "model.safetensors"), "pt") as f:
        index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    extra = {**OTHERS, kiln_hub.INDEX_FILE: json.dumps(index).encode()}
    hub.add(MODEL_ID, Path(tiny_llama), extra)
    hub.add(GATED_ID, Path(tiny_llama), token=TOKEN)


@pytest.fixture(scope="module")
def hub(tiny_llama, tmp_path_factory):
    local = LocalHub()
    _repo(local, tiny_llama)
    bin_only = tmp_path_factory.mktemp("bin-only")
    (bin_only / "config.json").write_text((Path(tiny_llama) / "config.json").read_text())
    (bin_only / "pytorch_model.bin").write_bytes(b"weights")
    local.add(BIN_ONLY_ID, bin_only)
    local.start()
    yield local
    local.stop()


@pytest.fixture
def online(hub, tmp_path, monkeypatch) -> Path:
    """huggingface_hub in this process pointed at the local hub (it reads HF_ENDPOINT once, at import), with no
    token; returns a fresh --download-dir."""
    from huggingface_hub import constants

    _point(monkeypatch, hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.requests.clear()
    return tmp_path / "download"


def _point(monkeypatch, url: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )


def _plan(capsys, model: str, *flags: str) -> tuple[int, str, str]:
    # a described GPU: its memory is no probe's, so that two plans are the same figures
    code = plan.main(["--model-path", model, "--device-name", "H100", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_of_a_model_id_fetches_no_weights(hub, online, tiny_llama, capsys):
    code, out, err = _plan(capsys, MODEL_ID, "--download-dir", str(online), "--json")
    assert code == 0, err
    by_id, local = json.loads(out), json.loads(_plan(capsys, tiny_llama, "--json")[1])
    # the same plan as the model's own directory; the id's start downloads its weights first
    by_id_start, local_start = by_id.pop("startup_prediction"), local.pop("startup_prediction")
    assert by_id == local
    assert by_id_start.pop("downloading") > 0 and by_id_start.pop("total") > local_start.pop("total")
    assert by_id_start == local_start
    assert _plan(capsys, MODEL_ID, "--download-dir", str(online))[1].startswith(
        f"Kiln memory plan for {MODEL_ID}:"
    )
    fetched = {r.path.rsplit("/", 1)[1] for r in hub.file_requests()}
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not [name for name in fetched if name.endswith((".safetensors", ".bin"))], fetched
    assert not [r for r in hub.requests if "original" in r.path]


def _predicted(out: str) -> dict[str, str]:
    """kiln plan's startup prediction, {phase: its basis}, in its order."""
    lines = out.split("Startup prediction (", 1)[1].splitlines()[1:]
    return {m[1]: m[2] for line in lines if (m := re.fullmatch(r"  (\w+) +[\d.]+ s(?:  (.*))?", line))}


def test_plan_of_a_model_id_predicts_its_download_until_it_is_cached(
    hub, online, tiny_llama, capsys, monkeypatch
):
    from kiln.server import startup_prediction as sp
    from kiln.server.launch import Launcher

    size = (Path(tiny_llama) / "model.safetensors").stat().st_size
    code, out, err = _plan(capsys, MODEL_ID, "--download-dir", str(online))
    assert code == 0, err
    # the checkpoint's one shard, sized from the repo's listing: not the other formats beside it, not 0 B
    first = _predicted(out)
    assert list(first)[:2] == ["downloading", "launching"], out
    assert first["downloading"] == f"{human(size)} to fetch"
    assert first["loading_weights"] == f"{human(size)} once fetched"
    assert not [r for r in hub.file_requests() if r.path.endswith(".safetensors")]  # still no weight fetched

    args = ServerArgs(model_path=MODEL_ID, download_dir=str(online), device="cpu").with_defaults()
    facts = sp.facts_for(args, "cpu", ())
    assert facts.weight_bytes == facts.download_bytes == size
    # serve's /status: the prediction begins with the download, and the seconds to ready count it
    monkeypatch.setitem(sp.DEFAULTS, "download_s_per_gib", 100 * (1 << 30) / size)  # 100 s for this one
    monkeypatch.setattr(sp, "contention_at_launch", lambda cpus=None: 1.0)
    monkeypatch.setenv("KILN_STARTUP_HISTORY", str(online.parent / "history.json"))  # no rate learned yet
    launcher = Launcher(args)
    try:
        status = launcher.state.startup.to_dict()
    finally:
        os.rmdir(launcher.ipc_dir)
    assert status["phase"] == "downloading" and status["predicted_s"]["downloading"] == 100.0
    assert status["eta_s"] == pytest.approx(status["predicted_s"]["total"], abs=1.0)

    kiln_hub.download_weights(MODEL_ID, args.model_path, str(online))
    code, out, err = _plan(capsys, MODEL_ID, "--download-dir", str(online))
    assert code == 0, err
    again = _predicted(out)
    assert list(again)[0] == "launching" and "downloading" not in again, out
    # now there is a file to probe
    assert again["loading_weights"].startswith(f"{human(size)} on disk, read at ")
    assert sp.facts_for(args, "cpu", ()).weight_bytes == size

    # a cache without the repo's listing (an older huggingface_hub's): the weights on disk, as for a local path
    monkeypatch.setattr(kiln_hub, "_cached_listing", lambda *a: None)
    unlisted = sp.facts_for(args, "cpu", ())
    assert (unlisted.weight_bytes, unlisted.download_bytes) == (size, 0)


def test_the_weights_download_takes_the_checkpoint_alone_and_resumes(hub, online, tiny_llama, monkeypatch):
    snapshot = Path(kiln_hub.fetch_metadata(MODEL_ID, None, str(online)))
    monkeypatch.setattr(kiln_hub, "REPORT_EVERY_S", 0.0)
    size = (Path(tiny_llama) / "model.safetensors").stat().st_size
    stop, seen = threading.Event(), []

    def stop_after_a_chunk(progress: kiln_hub.DownloadProgress) -> None:
        seen.append(progress)
        if progress.done:  # a chunk counted, then written: the next one stops the download
            stop.set()

    with pytest.raises(kiln_hub.DownloadCancelled):
        kiln_hub.download_weights(MODEL_ID, str(snapshot), str(online), stop_after_a_chunk, stop)
    assert seen[0].total == size and not (snapshot / "model.safetensors").exists()
    [partial] = list(online.rglob("*.incomplete"))
    kept = partial.stat().st_size
    assert kept > 0
    hub.requests.clear()
    done = []
    kiln_hub.download_weights(MODEL_ID, str(snapshot), str(online), done.append)
    assert done[-1].finished and done[-1].done == done[-1].total == size
    [get] = [r for r in hub.file_requests("model.safetensors") if r.method == "GET"]
    assert get.range == f"bytes={kept}-"  # continued where the stopped download ended
    assert (snapshot / "model.safetensors").read_bytes() == (
        Path(tiny_llama) / "model.safetensors"
    ).read_bytes()
    assert not [r for r in hub.file_requests() if r.path.endswith(tuple(OTHERS))], hub.file_requests()
    assert not (snapshot / "consolidated.safetensors").exists() and not (snapshot / "original").exists()


def test_a_repo_without_safetensors_is_refused_by_name(hub, online):
    snapshot = kiln_hub.fetch_metadata(BIN_ONLY_ID, None, str(online))
    with pytest.raises(ValueError, match=f"{BIN_ONLY_ID}: the repo holds no safetensors.*pytorch_model.bin"):
        kiln_hub.download_weights(BIN_ONLY_ID, snapshot, str(online))


@pytest.mark.parametrize(
    "model, flags, says",
    [
        ("kiln-test/absent", [], "kiln-test/absent: no such repo on http://127.0.0.1"),
        (MODEL_ID, ["--revision", "v9"], f"{MODEL_ID}@v9: the repo has no such revision"),
        (GATED_ID, [], f"{GATED_ID}: is a gated repo: .* set HF_TOKEN"),
    ],
)
def test_a_model_id_the_hub_refuses_is_one_line_naming_it(online, capsys, model, flags, says):
    t0 = time.monotonic()
    code, out, err = _plan(capsys, model, "--download-dir", str(online), *flags)
    assert code == 2 and not out and time.monotonic() - t0 < 30
    assert err.startswith(f"kiln plan: error: --model-path {model}") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert re.search(says, err), err


def test_a_gated_repo_opens_to_hf_token(online, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, _, err = _plan(capsys, GATED_ID, "--download-dir", str(online))
    assert code == 0, err


def test_no_hub_and_no_copy_name_the_id(online, capsys, monkeypatch):
    from huggingface_hub import constants

    _point(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    t0 = time.monotonic()
    code, _, err = _plan(capsys, MODEL_ID, "--download-dir", str(online))
    assert code == 2 and time.monotonic() - t0 < 30
    assert f"--model-path {MODEL_ID}: cannot reach the Hub at http://127.0.0.1:9" in err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, _, err = _plan(capsys, MODEL_ID, "--download-dir", str(online))
    assert code == 2 and f"--model-path {MODEL_ID}: not in the hub cache {online}" in err
    assert "HF_HUB_OFFLINE=1" in err


def test_kiln_wait_shows_a_download():
    progress = {"model": MODEL_ID, "bytes_done": 3 << 20, "bytes_total": 12 << 20, "bytes_per_s": 1 << 20}
    assert (
        describe("downloading", progress) == f"downloading ({MODEL_ID}: 3.0 MiB of 12.0 MiB (25%), 1.0 MiB/s)"
    )


# ------------------------------------------------------------------------------------------------ kiln serve


def _watch(srv: ServerProcess, done: Callable[[dict], bool], timeout: float = 300.0) -> list[dict]:
    """/status as the server starts, polled until `done` says so of one (or startup fails)."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline and srv.proc.poll() is None:
        try:
            seen.append(httpx.get(f"{srv.url}/status", timeout=5).json())
        except httpx.HTTPError:
            pass
        if seen and (done(seen[-1]) or seen[-1]["phase"] == "failed"):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"not there: {seen[-1:]}\n{srv.log_text()[-3000:]}")


@pytest.mark.server
def test_serve_downloads_a_model_id_resumes_and_restarts_offline(tiny_llama, tmp_path):
    import kiln

    local = LocalHub()
    _repo(local, tiny_llama)
    local.start()
    env = {"HF_ENDPOINT": local.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "NO_PROXY": "127.0.0.1"}
    flags = ["--download-dir", str(tmp_path / "dl"), "--max-total-tokens", "4k", "--disable-cuda-graph"]
    prompt = {"text": "The capital of France", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    size = (Path(tiny_llama) / "model.safetensors").stat().st_size
    try:
        # an id the hub does not know: one line naming it, in seconds, before any server is up
        t0 = time.time()
        absent = ServerProcess(["--model-path", "kiln-test/absent", *flags], tmp_path / "absent.log", env)
        assert absent.proc.wait(60) == 1 and time.time() - t0 < 30
        log = absent.log_text()
        absent.stop()
        assert "Kiln failed: --model-path kiln-test/absent: no such repo" in log and "Traceback" not in log

        # a download killed halfway ...
        local.bytes_per_s = 8e6  # ~3 s for the checkpoint: a download /status can watch
        killed = ServerProcess(["--model-path", MODEL_ID, *flags], tmp_path / "killed.log", env)
        try:
            _watch(killed, lambda s: bool(s["progress"].get("bytes_done")))
            time.sleep(0.3)  # the counted chunk written
            os.killpg(killed.proc.pid, signal.SIGKILL)
        finally:
            killed.stop()

        # ... continues where it stopped when the server starts again, /status showing its bytes
        local.requests.clear()
        events = tmp_path / "events.jsonl"
        argv = ["--model-path", MODEL_ID, *flags, "--startup-events", str(events)]
        srv = ServerProcess(argv, tmp_path / "serve.log", env)
        try:
            statuses = _watch(srv, lambda s: s["phase"] == "ready")
            assert statuses[-1]["phase"] == "ready", statuses[-1]
            downloading = [s["progress"] for s in statuses if "bytes_done" in s["progress"]]
            assert downloading and all(
                p["bytes_total"] == size and p["model"] == MODEL_ID for p in downloading
            )
            [get] = [r for r in local.file_requests("model.safetensors") if r.method == "GET"]
            assert get.range and get.range != "bytes=0-", get  # resumed
            records = [json.loads(line) for line in events.read_text().splitlines()]
            phases = [r["phase"] for r in records if r["event"] == "phase"]
            assert phases[:2] == ["downloading", "launching"] and "loading_weights" in phases, phases
            last = [r for r in records if r["event"] == "progress" and r["phase"] == "downloading"][-1]
            assert last["bytes_done"] == last["bytes_total"] == size
            assert f"Downloaded {MODEL_ID}: " in srv.log_text()
            served = httpx.post(f"{srv.url}/generate", json=prompt, timeout=120).json()["output_ids"]
        finally:
            srv.stop()
        assert not [r for r in local.file_requests() if r.path.endswith(tuple(OTHERS))]
    finally:
        local.stop()

    # with the hub gone, offline, from the cache
    offline = ServerProcess(argv[:-2], tmp_path / "offline.log", {**env, "HF_HUB_OFFLINE": "1"})
    try:
        offline.wait_ready()
        assert httpx.post(f"{offline.url}/generate", json=prompt, timeout=120).json()["output_ids"] == served
    finally:
        offline.stop()

    # the tokens the model's own directory gives
    engine = kiln.Engine(model_path=tiny_llama, device="cpu", max_total_tokens=4096, disable_cuda_graph=True)
    try:
        assert engine.generate(prompt["text"], prompt["sampling_params"])["output_ids"] == served
    finally:
        engine.shutdown()
