"""`kiln serve | plan | bench | generate` — one entry point."""

from __future__ import annotations

import argparse
import json
import sys

from kiln.config import ServerArgs


def _serve(ns: argparse.Namespace) -> int:
    from kiln.server.launch import serve

    return serve(ServerArgs.from_cli(ns))


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
    ns = build_parser().parse_args(argv)
    code = ns.func(ns)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
