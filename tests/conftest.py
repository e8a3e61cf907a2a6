"""Shared fixtures: locally built random-weight models, the default model, and a real `kiln serve` subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import layers
import pytest
import torch
import zygote

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread in every test process and in every engine and server they start (Kiln's --num-threads default
# reads OMP_NUM_THREADS): `make test` runs two pytest workers on two cores, and a second thread per process only
# spins against the other worker (docs/testing.md). torch read the variable at import, before it was set here.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# One compile cache for every test that does not test the cache itself (tests/test_graphs.py's second start gives
# its servers a fresh one), kept between runs as a user's is, apart from the user's own: inductor keys each entry by
# the traced graph (its code's paths included) and torch's version, so a changed model or step compiles again
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("~/.cache/kiln/test-compile").expanduser()))
# the servers the tests start keep their phase timings apart from the real history (kiln.server.startup_history)
os.environ.setdefault(
    "KILN_STARTUP_HISTORY", str(Path("~/.cache/kiln/test-startup-history.json").expanduser())
)
# Triton picks its interpreter when first imported, and importing a transformers model class imports it: without a
# GPU, Kiln's Triton kernels (tests/test_triton_attention.py) run in the interpreter, so it is chosen here first
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    layers.configure(config)
    layers.install_guards()


def pytest_addoption(parser: pytest.Parser) -> None:
    layers.add_option(parser)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    layers.select_collected(config, items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from layers.track(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from layers.track(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield from layers.track(item)


_TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
TINY = {  # an untied Llama, and a tied Qwen3 with an explicit head_dim and biases on all four projections
    "llama": dict(_TINY_SHAPE, tie_word_embeddings=False),
    "qwen3": dict(_TINY_SHAPE, head_dim=32, tie_word_embeddings=True, attention_bias=True),
}


def build_tiny_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model saved with transformers, using the default model's tokenizer (GGUF vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from kiln.loader.default_model import default_model_path
    from kiln.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        kind
    ]
    cfg = cfg_cls(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **TINY[kind]
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # larger-than-default weights so logits have clear winners; biases not left zero
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("proj.bias"):
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture
def model_dir(tmp_path: Path):
    """write(config, name) -> a model directory in tmp_path holding only that config.json (for the ledger)."""

    def write(config: dict, name: str = "m") -> str:
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        return str(directory)

    return write


def default_tokenizer_source() -> str:
    """Where the default model's tokenizer is read: KILN_TINY_LLAMA's model (build_tiny_model) holds it too, for a
    machine without the default model (a GPU machine running the GPU tests)."""
    from kiln.loader.default_model import default_model_path

    return os.environ.get("KILN_TINY_LLAMA") or default_model_path()


def hf_model_of_gguf(path: str):
    """transformers' own float32 model of a GGUF file, the reference the correctness tests compare with. Its
    conversion (reading the GGUF's metadata and dequantizing in Python) takes ~25 s, so the converted model is kept
    as safetensors under ~/.cache/kiln/test-hf (kiln.loader.kept_dirs: keyed by the file's bytes, so every clone's
    copy of the file finds it, and by transformers' and gguf's versions), and the test modules after the first load
    that instead: still transformers' reading of the same file."""
    from importlib.metadata import version

    from transformers import AutoModelForCausalLM

    from kiln.loader.kept_dirs import content_kept_dir, is_kept, keep

    root = Path("~/.cache/kiln/test-hf").expanduser()
    kept = content_kept_dir(root, path, *(f"{p} {version(p)}" for p in ("transformers", "gguf")))
    if is_kept(kept):
        return AutoModelForCausalLM.from_pretrained(kept, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()

    def save(tmp: Path) -> None:
        # the weights are dequantized float32 already; transformers only refuses to save what it read from a GGUF
        quantizer, model.hf_quantizer = getattr(model, "hf_quantizer", None), None
        try:
            model.save_pretrained(tmp)
        finally:
            model.hf_quantizer = quantizer

    keep(kept, save)
    return model


@pytest.fixture(scope="session")
def default_model() -> str:
    from kiln.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """KILN_TINY_LLAMA names a copy built earlier by build_tiny_model, for machines without the default model
    (whose tokenizer the build takes), such as a GPU machine that runs only the CUDA tests."""
    prebuilt = os.environ.get("KILN_TINY_LLAMA")
    return prebuilt or str(build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3")))


def children_left(children: list) -> list[list[str]]:
    """The command lines of those of a stopped server's `children` still running after a bounded wait: Python's
    resource tracker ends on its own once its parent has exited, a moment after the parent's exit is seen."""
    import psutil

    _, alive = psutil.wait_procs(children, timeout=10)
    left = []
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.cmdline())
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`kiln serve` in a subprocess on 127.0.0.1, stopped (and reaped) at the end: forked from the worker's
    pre-imported fork server (tests/zygote.py) with `env` added to the worker's environment, or, where `env` holds
    a variable some module reads at import (huggingface_hub's HF_*), or with KILN_TEST_FORK_SERVERS=0, its command
    line spawned."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = ["serve", "--port", str(self.port), *args]
        self.log = open(log_path, "w")
        # kiln.core.envs reads KILN_* and SGLANG_* when asked, so a fork of the pre-imported server sees them
        read_at_call = all(k.startswith(("KILN_", "SGLANG_")) for k in env or {})
        if read_at_call and os.environ.get("KILN_TEST_FORK_SERVERS", "1") == "1":
            layers.starting_a_server()
            self.proc = zygote.ForkedServer(argv, str(log_path), {**os.environ, **(env or {})})
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", *argv],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kiln serve exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"kiln serve not ready after {timeout} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log_path).read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default model served with a small pool; shared by the HTTP tests. Its GGUF blocks multiply in float32
    (--cpu-gemm exact): test_server_correctness holds its greedy output equal to transformers' on the file."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    flags = ["--max-total-tokens", "16384", "--max-running-requests", "32", "--chunked-prefill-size", "512"]
    yield from served([*flags, "--cpu-gemm", "exact"], log)


def served(args: list[str], log: Path, ready_timeout: float | None = 300.0, headers: dict | None = None):
    """A `kiln serve` for a fixture (`yield from served(...)`): ready before its tests, its pool back at baseline
    after them (nothing leaked), then stopped. `headers`: what /get_server_info needs (a server's --api-key);
    `ready_timeout` None: yielded as soon as started, for a fixture that watches the startup itself."""
    srv = ServerProcess(args, log)
    try:
        if ready_timeout is not None:
            srv.wait_ready(ready_timeout)
        yield srv
        assert_pool_at_baseline(srv.url, headers=headers)
    finally:
        srv.stop()


def assert_pool_at_baseline(url: str, timeout: float = 20.0, headers: dict | None = None) -> dict:
    """No request holds KV or a table row, and free + cached + in use == total."""
    deadline = time.time() + timeout
    while True:
        info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=10).json()
        integ = info["integrity"]
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and integ["in_use"] == 0
        if (integ["ok"] and idle) or time.time() > deadline:
            break
        time.sleep(0.25)
    assert integ["ok"], integ
    assert idle, info
    return integ
