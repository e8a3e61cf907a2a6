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
from typing import TYPE_CHECKING

from kiln.config import ServerArgs
from kiln.config_compat import foreign_flag_messages
from kiln.memory.ledger_format import format_refusal, format_table, format_verdict, ledger_json

if TYPE_CHECKING:
    from kiln.platform import Platform
    from kiln.scheduler.resolve import Deployment
    from kiln.server.startup_prediction import StartupFacts

__all__ = ["add_arguments", "deployment_for_args", "format_refusal", "main", "register", "run"]


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


def deployment_for_args(args: ServerArgs) -> Deployment:
    """What `kiln serve` would resolve for these arguments, on the platform they describe (this machine's device,
    or a GPU named by --device-name or --compute-capability). Raises StartupRefused as serve refuses them, with
    the same words; says on stderr what the platform had to assume and what serve would warn of."""
    # resolving imports torch and every model class (seconds): `kiln wait` and `kiln bench`, which share the CLI's
    # parser with plan, start without them
    from kiln.scheduler.resolve import resolve, target_platform

    target = target_platform(args, serving=False)
    deployment = resolve(args, target)
    for assumption in target.assumed:
        print(f"kiln plan: note: assumed {assumption}", file=sys.stderr)
    for warning in deployment.warnings:  # the ledger refused these unless SGLang's switch allows them
        print(f"kiln plan: warning: {warning}", file=sys.stderr)
    return deployment


def platform_json(target: Platform) -> dict:
    """The platform a plan was made for, in --json: what it names, and what it assumed."""
    capability = None if target.capability is None else "{}.{}".format(*target.capability)
    return {
        "device": target.device,
        "name": target.name,
        "compute_capability": capability,
        "this_machine": target.here,
        "assumed": list(target.assumed),
    }


def print_foreign_flags(args: ServerArgs) -> None:
    """The lines `kiln serve` would log for the SGLang flags Kiln takes without implementing, on stderr (stdout
    stays the plan, --json parseable)."""
    for level, line in foreign_flag_messages(args.foreign_flags):
        kind = "warning" if level >= logging.WARNING else "note"
        print(f"kiln plan: {kind}: {line}", file=sys.stderr)


def startup_prediction(deployment: Deployment) -> tuple[StartupFacts, dict[str, float], bool]:
    """How long serve's start would take on this host, phase by phase, for the ledger's shapes; and whether the
    rates came from this host's history."""
    # the kernels' build check imports torch: `kiln wait` shares this module's parser and must start without it
    from kiln.server.startup_history import StartupHistory
    from kiln.server.startup_prediction import facts_for, predict

    ledger = deployment.ledger
    shapes = (
        *(f"decode/{b}" for b in ledger.graph_batch_sizes),
        *(f"prefill/{n}" for n in ledger.graph_prefill_tokens),
    )
    facts = facts_for(deployment.args, deployment.platform.device, shapes)
    learned = StartupHistory().rates(facts.key)
    return facts, predict(facts, learned), bool(learned)


def run(namespace: argparse.Namespace) -> int:
    """Print the ledger and the verdict; 0 fits, 1 does not fit, 2 unusable arguments."""
    try:
        given = ServerArgs.from_cli(namespace)
        print_foreign_flags(given)
        args = given.with_defaults()
        deployment = deployment_for_args(args)
    # StartupRefused is a ValueError; OSError: no default model installed
    except (ValueError, KeyError, TypeError, OSError) as e:
        print(f"kiln plan: error: {e}", file=sys.stderr)
        return 2
    ledger = deployment.ledger
    facts, predicted, learned = startup_prediction(deployment)
    if namespace.json:
        extra = {
            "platform": platform_json(deployment.platform),
            "is_embedding": deployment.args.is_embedding,
            "startup_prediction": predicted,
        }
        print(ledger_json(ledger, **extra))
    else:
        # a Hugging Face id by its name, not by the hash its snapshot directory is named after
        hub_id = given.model_path if given.model_path and given.model_path != args.model_path else None
        name = hub_id or Path(args.model_path).name or args.model_path
        device = ledger.device if deployment.platform.here else deployment.platform.name
        # an embedding deployment (--is-embedding, or found from the model's pooling config) prefills only
        kind = ", embedding model (prefill only, no decode graphs)" if deployment.args.is_embedding else ""
        title = f"Kiln memory plan for {name}{kind}: {device}, tp {ledger.tp_size}, per rank (GiB = 2^30 B)"
        print(format_table(ledger, title))
        print(format_verdict(ledger))
        from kiln.server.startup_prediction import format_prediction

        print(format_prediction(facts, predicted, learned))
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
