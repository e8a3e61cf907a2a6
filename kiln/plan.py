"""`kiln plan [serve flags] [--json]`: print the memory ledger and a verdict without allocating anything.

It takes exactly `kiln serve`'s flags (ServerArgs) and computes the ledger the way serve does before it loads
anything, so the plan is serve's. Exit status: 0 fits, 1 does not fit, 2 unusable arguments — so a script can
gate a deployment on it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kiln.config import ServerArgs
from kiln.config_compat import foreign_flag_messages
from kiln.loader.model_config import read_hf_config
from kiln.memory.ledger import compute_ledger
from kiln.memory.ledger_format import format_refusal, format_table, format_verdict, ledger_json
from kiln.memory.ledger_types import Ledger, LedgerInputs
from kiln.memory.model_shapes import context_overrun
from kiln.scheduler.launch import model_refusal, storage_refusal
from kiln.speculative.settings import with_speculation

__all__ = ["add_arguments", "format_refusal", "ledger_for_args", "main", "register", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kiln serve`'s flags and plan's own --json."""
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--json", action="store_true", help="print the ledger as JSON")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="print the memory ledger and whether it fits, without allocating"
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def ledger_for_args(args: ServerArgs) -> Ledger:
    """The ledger `kiln serve` would compute for these arguments. Raises ValueError for unusable ones, as
    `kiln serve` refuses them: a --tp-size that cannot split the model, a flag a hybrid model cannot take."""
    hf_config = read_hf_config(args.model_path)
    refusal = model_refusal(args, hf_config) or storage_refusal(args, keep=False)
    if refusal is not None:
        raise ValueError(refusal)
    ledger = compute_ledger(with_speculation(LedgerInputs.from_args(args, hf_config), args))
    overrun = context_overrun(hf_config, args.context_length)
    if overrun:  # the ledger refused it unless SGLang's switch allows it: serve warns, so does the plan
        print(f"kiln plan: warning: {overrun}", file=sys.stderr)
    return ledger


def print_foreign_flags(args: ServerArgs) -> None:
    """The lines `kiln serve` would log for the SGLang flags Kiln takes without implementing, on stderr (stdout
    stays the plan, --json parseable)."""
    for level, line in foreign_flag_messages(args.foreign_flags):
        kind = "warning" if level >= logging.WARNING else "note"
        print(f"kiln plan: {kind}: {line}", file=sys.stderr)


def run(namespace: argparse.Namespace) -> int:
    """Print the ledger and the verdict; 0 fits, 1 does not fit, 2 unusable arguments."""
    try:
        given = ServerArgs.from_cli(namespace)
        print_foreign_flags(given)
        args = given.with_defaults()
        ledger = ledger_for_args(args)
    except (ValueError, KeyError, TypeError, OSError) as e:  # OSError: no default model installed
        print(f"kiln plan: error: {e}", file=sys.stderr)
        return 2
    if namespace.json:
        print(ledger_json(ledger))
    else:
        # a Hugging Face id by its name, not by the hash its snapshot directory is named after
        hub_id = given.model_path if given.model_path and given.model_path != args.model_path else None
        name = hub_id or Path(args.model_path).name or args.model_path
        title = f"Kiln memory plan for {name}: {ledger.device}, tp {ledger.tp_size}, per rank (GiB = 2^30 B)"
        print(format_table(ledger, title))
        print(format_verdict(ledger))
    return 0 if ledger.fits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad arguments already; keep the code
        return int(e.code or 0)
    return run(namespace)


if __name__ == "__main__":
    sys.exit(main())
