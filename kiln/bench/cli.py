"""`kiln bench serve | offline | one-batch`. Flag names follow SGLang's bench_serving where it has them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kiln.core.argtypes import (
    bounded,
    fraction,
    json_object,
    key_value,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    server_url,
)

# A check over several parsed flags: the problem in words, or None.
CrossCheck = Callable[[argparse.Namespace], str | None]


class CheckedParser(argparse.ArgumentParser):
    """A parser that also refuses flags that are each valid but not together (a minimum above its maximum),
    with argparse's own error (usage, one line, exit 2), however the subcommand is reached (`kiln bench` or
    `python -m kiln.bench.cli`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cross_checks: list[CrossCheck] = []

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, rest = super().parse_known_args(args, namespace)
        for check in self.cross_checks:
            if problem := check(ns):
                self.error(problem)
        return ns, rest


def _ordered(low: str, high: str) -> CrossCheck:
    """Refuses --min-X above --max-X (random.randint would fail on the empty range, after argument parsing)."""

    def check(ns: argparse.Namespace) -> str | None:
        lo, hi = getattr(ns, low), getattr(ns, high)
        flag_lo, flag_hi = "--" + low.replace("_", "-"), "--" + high.replace("_", "-")
        return f"{flag_lo} ({lo}) must not exceed {flag_hi} ({hi})" if lo > hi else None

    return check


def _dataset_path_given(ns: argparse.Namespace) -> str | None:
    if ns.dataset_name in ("sharegpt", "jsonl") and not ns.dataset_path:
        return f"--dataset-name {ns.dataset_name} needs --dataset-path FILE"
    return None


def _serve(args: argparse.Namespace) -> int:
    import httpx

    from kiln.bench.serve import ServerUnusable, run_serve

    try:
        record = run_serve(args)
    except (ServerUnusable, httpx.HTTPError) as e:
        print(f"kiln bench serve: error: {e}", file=sys.stderr)
        return 1
    return 0 if record["completed"] > 0 else 1


def _offline(args: argparse.Namespace) -> int:
    from kiln.bench.offline import run_offline

    run_offline(args)
    return 0


def _one_batch(args: argparse.Namespace) -> int:
    from kiln.bench.offline import run_one_batch

    run_one_batch(args)
    return 0


def _add_serve_dataset(a: Any) -> None:
    """The workload flags of `kiln bench serve` (SGLang's names and defaults where it has them)."""
    a(
        "--dataset-name",
        default="random",
        choices=["random", "sharegpt", "shared-prefix", "multi-turn", "jsonl"],
    )
    a(
        "--dataset-path",
        default=None,
        help='sharegpt: a ShareGPT JSON file (a list of {"conversations": [...]}); '
        'jsonl: one {"prompt": str, "output_len": int} per line',
    )
    a("--num-prompts", type=positive_int, default=1000, help="requests (multi-turn: conversations)")
    # SGLang's sharegpt sampling refuses fewer than 4 output tokens
    a("--sharegpt-output-len", type=bounded(int, 4), default=None, help="sharegpt: output tokens per request")
    a(
        "--sharegpt-context-len",
        type=positive_int,
        default=None,
        help="sharegpt: drop requests longer than this",
    )
    a("--random-input-len", type=positive_int, default=1024)
    a("--random-output-len", type=positive_int, default=1024)
    a(
        "--random-range-ratio",
        type=fraction,
        default=0.0,
        help="lengths uniform in [len * ratio, len]; 1.0 fixes them",
    )
    a("--num-turns", type=positive_int, default=3, help="multi-turn: user turns per conversation")
    a("--gsp-num-groups", type=positive_int, default=64)
    a("--gsp-prompts-per-group", type=positive_int, default=16)
    a("--gsp-system-prompt-len", type=positive_int, default=2048)
    a("--gsp-question-len", type=positive_int, default=128)
    a("--gsp-output-len", type=positive_int, default=256)
    a(
        "--apply-chat-template",
        action="store_true",
        help="render single-turn prompts through the tokenizer's chat template (openai-chat: the server does)",
    )


def _add_serve(sub: Any) -> None:
    from kiln.bench.serve import BACKEND_ALIASES, ENDPOINTS

    p = sub.add_parser("serve", help="stream a workload to a running server and report latency/throughput")
    a = p.add_argument
    a(
        "--backend",
        default="openai",
        choices=[*ENDPOINTS, *BACKEND_ALIASES],
        help="openai: /v1/completions; openai-chat: /v1/chat/completions; kiln: native /generate",
    )
    a(
        "--base-url",
        type=server_url,
        default=None,
        help="server URL, e.g. http://127.0.0.1:30000 (default: --host/--port)",
    )
    a("--host", default="127.0.0.1")
    a("--port", type=port, default=30000)
    a("--model", default=None, help="model name sent to OpenAI endpoints (default: the server's first)")
    a(
        "--tokenizer",
        default=None,
        help="HF dir or .gguf file (default: the served model's, from the server's /model_info)",
    )
    _add_serve_dataset(a)
    a(
        "--request-rate",
        type=positive_float,
        default=float("inf"),
        help="Poisson arrivals per second (inf: all at once)",
    )
    a("--max-concurrency", type=positive_int, default=None, help="most requests in flight at once")
    a("--seed", type=int, default=1)
    # EOS is ignored by default, as in SGLang's bench_serving, so that output lengths are the workload's.
    a("--ignore-eos", action="store_true", default=True, help="(the default) send ignore_eos: true")
    a("--disable-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS")
    a(
        "--extra-request-body",
        type=json_object,
        default=None,
        help="JSON object merged into every request body",
    )
    a("--warmup-requests", type=non_negative_int, default=1)
    a("--flush-cache", action="store_true", help="POST /flush_cache after the warm-up, before the run")
    a("--request-timeout", type=positive_float, default=600.0, help="seconds one request may take")
    a("--total-timeout", type=positive_float, default=3600.0, help="seconds the whole run may take")
    a(
        "--output-file",
        "--output-json",
        dest="output_file",
        default=None,
        help="append one JSON record per run to this file (default: SGLang's name, "
        "{backend}_{MMDD}_{num_prompts}_{input}_{output}.jsonl, in the current directory)",
    )
    a("--disable-tqdm", action="store_true")
    p.set_defaults(func=_serve)
    p.cross_checks.append(_dataset_path_given)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="HF dir or .gguf file (default: Kiln's default model)")
    p.add_argument(
        "--engine-arg",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="server argument for the in-process engine, repeatable (e.g. max_running_requests=64)",
    )
    p.add_argument("--output-json", default=None, help="append one JSON record per run to this file")


def _add_offline(sub: Any) -> None:
    p = sub.add_parser("offline", help="in-process engine on N random sequences: output tokens / wall time")
    _add_engine_args(p)
    p.add_argument("--num-seqs", type=positive_int, default=256)
    p.add_argument("--min-input-len", type=positive_int, default=100)
    p.add_argument("--max-input-len", type=positive_int, default=1024)
    p.add_argument("--min-output-len", type=positive_int, default=100)
    p.add_argument("--max-output-len", type=positive_int, default=1024)
    p.add_argument("--temperature", type=bounded(float, 0, 100), default=0.6)  # SamplingParams' range
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_offline)
    p.cross_checks += [
        _ordered("min_input_len", "max_input_len"),
        _ordered("min_output_len", "max_output_len"),
    ]


def _add_one_batch(sub: Any) -> None:
    p = sub.add_parser("one-batch", help="prefill latency and decode tok/s of one static batch")
    _add_engine_args(p)
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--input-len", type=positive_int, default=1024)
    p.add_argument("--output-len", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_one_batch)


def _add_subcommands(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(
        dest="bench_command",
        metavar="{serve,offline,one-batch}",
        required=True,
        parser_class=CheckedParser,
    )
    _add_serve(sub)
    _add_offline(sub)
    _add_one_batch(sub)


def register(subparsers: Any) -> None:
    """Add `bench` (with serve, offline, one-batch) to an argparse subparsers object; each sets `func`."""
    _add_subcommands(
        subparsers.add_parser("bench", help="benchmarks: serve (any server), offline, one-batch")
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m kiln.bench.cli serve ...` (the same as `kiln bench serve ...`)."""
    parser = argparse.ArgumentParser(prog="kiln bench")
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
