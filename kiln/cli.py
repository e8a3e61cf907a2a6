"""`kiln serve | plan | bench | generate` — one entry point."""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from kiln.config import ServerArgs


def _refuse(command: str, message: str) -> NoReturn:
    """argparse's way: the message on stderr and exit code 2, before anything starts."""
    print(f"kiln {command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _serve(ns: argparse.Namespace) -> int:
    try:
        args = ServerArgs.from_cli(ns)
    except ValueError as e:
        _refuse("serve", str(e))
    if args.dp_size > 1 or ns.router_flags:
        return _serve_replicas(args, ns.router_flags)
    from kiln.server.launch import serve

    return serve(args)


def _serve_replicas(args: ServerArgs, router_flags: list[str]) -> int:
    """`--dp-size N`: N replicas behind SGLang's router (kiln/server/replicas.py)."""
    import kiln.server.replicas as replicas

    if args.dp_size == 1:
        _refuse("serve", f"{router_flags[0]}: --router-* flags configure the router of --dp-size > 1")
    if args.nnodes > 1 or args.dist_init_addr:
        _refuse(
            "serve",
            f"--dp-size {args.dp_size} starts its replicas on this node, each with its own rank group: "
            "without --nnodes and --dist-init-addr (for replicas on several nodes, put `python -m "
            "sglang_router.launch_router --worker-urls ...` in front of servers started on each)",
        )
    missing = replicas.router_missing(args.dp_size)
    if missing:
        _refuse("serve", missing)
    try:
        flags = replicas.router_cli_flags(router_flags)
    except replicas.RouterFlagError as e:
        _refuse("serve", str(e))
    return replicas.serve_replicas(args, flags)


def _generate(ns: argparse.Namespace) -> int:
    from kiln.core.logs import configure_logging
    from kiln.engine import Engine

    configure_logging(ns.log_level)
    args = {k: v for k, v in vars(ServerArgs.from_cli(ns)).items()}
    eng = Engine(**args)
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
    if ns.chat:
        from kiln.text.tokenizer import apply_chat_template

        ids = apply_chat_template(eng.tokenizer, [{"role": "user", "content": ns.prompt}])
        out = eng.generate(input_ids=ids, sampling_params=params)
    else:
        out = eng.generate(ns.prompt, params)
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    ServerArgs.add_cli_args(p)
    p.set_defaults(func=_serve)
    g = sub.add_parser("generate", help="generate once with the in-process engine")
    ServerArgs.add_cli_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.set_defaults(func=_generate)
    import kiln.plan as plan
    import kiln.wait as wait
    from kiln.bench import cli as bench_cli

    plan.register(sub)
    wait.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    # `kiln serve` passes `--router-*` flags on to SGLang's router (--dp-size); any other unknown one is
    # refused
    ns.router_flags = []
    if unknown:
        import kiln.server.replicas as replicas

        try:
            if ns.command != "serve":
                raise replicas.RouterFlagError(f"unrecognized arguments: {' '.join(unknown)}")
            ns.router_flags = replicas.split_router_flags(unknown)
        except replicas.RouterFlagError as e:
            parser.error(str(e))
    code = ns.func(ns)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
