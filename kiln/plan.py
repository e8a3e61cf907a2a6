"""`kiln plan [serve arguments]`: print the memory ledger and a verdict without allocating anything.

Exit status: 0 fits, 1 does not fit, 2 unusable arguments — so a script can gate a deployment on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.memory.ledger import Ledger, LedgerInputs, compute_ledger, resolve_dtype
from kiln.memory.ledger_format import format_refusal, format_table, format_verdict, ledger_json
from kiln.platform import (
    available_memory_bytes,
    detect_device,
    host_available_bytes,
    parse_size,
    total_memory_bytes,
)

__all__ = ["add_arguments", "build_inputs", "format_refusal", "load_model_config", "main", "register", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve-like flags `kiln plan` understands (SGLang's names and defaults)."""
    p.add_argument(
        "--model-path",
        "--model",
        default=None,
        help="config.json dir, a config.json file, or a .gguf (default: the bundled SmolLM2-135M-Instruct GGUF)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: detected")
    p.add_argument("--device-memory", default=None, help="per-device memory, e.g. 80GiB (default: probed)")
    p.add_argument("--host-memory", default=None, help="node RAM available, e.g. 512GiB (default: probed)")
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    p.add_argument("--cuda-graph-max-bs-prefill", type=int, default=None)
    p.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None)
    p.add_argument("--disable-prefill-graph", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-weight-prepack", action="store_true")
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument(
        "--hicache-size", type=float, default=0.0, help="GB (1e9 B) per rank; 0 = use --hicache-ratio"
    )
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="print the memory ledger and whether it fits, without allocating")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def load_model_config(model_path: str) -> dict:
    """An HF config dict from a directory, a config.json, or a .gguf file (metadata only, no weights read)."""
    path = Path(model_path)
    if path.is_dir():
        if (path / "config.json").is_file():
            path = path / "config.json"
        else:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(f"{model_path}: no config.json and not exactly one .gguf file")
            path = ggufs[0]
    if not path.is_file():
        raise ValueError(f"{model_path}: not found (give a model directory, a config.json or a .gguf)")
    if path.suffix == ".gguf":
        from kiln.loader.gguf_loader import read_gguf_config

        return read_gguf_config(str(path))
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the model config: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def build_inputs(args: argparse.Namespace, hf_config: dict, draft: dict | None = None) -> LedgerInputs:
    """LedgerInputs from serve-like arguments; memory is probed unless given. Raises ValueError."""
    device = args.device or detect_device()
    tp = args.tp_size
    if args.device_memory:
        total = avail = parse_size(args.device_memory)  # planning for a device: assume it is empty
    elif device == "cuda" and detect_device() != "cuda":
        raise ValueError("--device cuda on a machine without CUDA: give --device-memory (e.g. 80GiB)")
    else:
        total, avail = total_memory_bytes(device), available_memory_bytes(device)
    if device == "cpu" and tp > 1:  # CPU ranks share one machine's RAM
        total, avail = total // tp, avail // tp
    host = parse_size(args.host_memory) if args.host_memory else None
    if host is None and args.enable_hierarchical_cache:
        host = host_available_bytes()
    if tp < 1:
        raise ValueError("--tp-size must be >= 1")
    return LedgerInputs(
        hf_config=hf_config, device=device, device_memory_bytes=total, available_memory_bytes=avail, tp_size=tp,
        dtype=resolve_dtype(hf_config, device, args.dtype), kv_cache_dtype=args.kv_cache_dtype,
        mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens,
        context_length=args.context_length, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
        page_size=args.page_size, cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_bs=tuple(args.cuda_graph_bs) if args.cuda_graph_bs else None,
        cuda_graph_max_bs_prefill=args.cuda_graph_max_bs_prefill,
        cuda_graph_bs_prefill=tuple(args.cuda_graph_bs_prefill) if args.cuda_graph_bs_prefill else None,
        disable_cuda_graph=args.disable_cuda_graph, disable_prefill_graph=args.disable_prefill_graph,
        enable_hierarchical_cache=args.enable_hierarchical_cache, hicache_size_gb=args.hicache_size,
        hicache_ratio=args.hicache_ratio, host_memory_bytes=host, draft_hf_config=draft,
        weight_prepack=not getattr(args, "disable_weight_prepack", False),
    )  # fmt: skip


def ledger_for_args(args: argparse.Namespace) -> Ledger:
    if args.model_path is None:
        from kiln.loader.default_model import default_model_path

        args.model_path = default_model_path()
    hf_config = load_model_config(args.model_path)
    draft = (
        load_model_config(args.speculative_draft_model_path) if args.speculative_draft_model_path else None
    )
    return compute_ledger(build_inputs(args, hf_config, draft))


def run(args: argparse.Namespace) -> int:
    """Print the ledger and the verdict; 0 fits, 1 does not fit, 2 unusable arguments."""
    try:
        ledger = ledger_for_args(args)
    except (ValueError, KeyError, TypeError) as e:
        print(f"kiln plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(ledger_json(ledger))
    else:
        name = Path(args.model_path).name or args.model_path
        title = f"Kiln memory plan for {name}: {ledger.device}, tp {ledger.tp_size}, per rank (GiB = 2^30 B)"
        print(format_table(ledger, title))
        print(format_verdict(ledger))
    return 0 if ledger.fits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad arguments already; keep the code
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
