"""A draft head's catch-up after a verify (1 + the accepted drafts of each request) three ways, side by side in one
run: as one eager extend (how Kiln ran it before catch-ups were captured), as eager decode rows (one a token), and
as the captured decode rows (compiled steps on the CPU, CUDA graphs on CUDA), which serving now runs.

A random EAGLE head on the default model (or --model-path), each request holding --context tokens of the head's KV,
--tokens tokens to catch up on each (num_steps + 1: every draft accepted). The draft's shapes are captured as
serve captures them (capture_draft_graphs, the compile cache as serve's); each way's median ms of --reps,
alternating step by step.

    python benchmarks/bench_catch_up.py [--bs 1 8] [--tokens 4] [--context 512] [--reps 20] [--model-path PATH]
        [--device cpu|cuda] [--threads N] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_verify_cost import save_results, step_arguments, sync

from kiln.core.forward_batch import ForwardBatch, ForwardMode


def write_eagle_head(out: Path, config: dict) -> str:
    """A random EAGLE head for a Llama-shaped target of `config`, in the public layout (`fc`, `layers.0.*`)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    width, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or width // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"fc.weight": (width, 2 * width), "fc.bias": (width,), "self_attn.q_proj.weight": (q, width),
              "self_attn.k_proj.weight": (kv, width), "self_attn.v_proj.weight": (kv, width),
              "self_attn.o_proj.weight": (width, q), "mlp.gate_proj.weight": (inter, width),
              "mlp.up_proj.weight": (inter, width), "mlp.down_proj.weight": (width, inter)}  # fmt: skip
    tensors = {
        (n if n.startswith("fc") else f"layers.0.{n}"): torch.randn(s) * 0.05 for n, s in shapes.items()
    }
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(width)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    head_config = dict(config, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(head_config))
    return str(out)


def batches(
    runner, rows: list[int], context: int, tokens: int
) -> tuple[ForwardBatch, ForwardBatch, ForwardBatch]:
    """The requests' KV (an extend of `context` tokens each in table `rows`) and their catch-up of `tokens` tokens
    each, as an extend and as decode rows. Slots are written straight into the table: the head's pool mirrors the
    target's slots, which this run does not use."""
    table, n, bs = runner.table.req_to_token, context + tokens, len(rows)
    for i, r in enumerate(rows):
        table[r, :n] = torch.arange(1 + i * n, 1 + (i + 1) * n, device=table.device)
    idx = torch.tensor(rows, dtype=torch.int64)

    def extend(start: int, count: int) -> ForwardBatch:
        seqs = [table[r, : start + count] for r in rows]
        return ForwardBatch(
            ForwardMode.EXTEND, torch.randint(100, 1000, (bs * count,)), torch.arange(start, start + count).repeat(bs),
            torch.cat([s[start:] for s in seqs]), logits_index=torch.arange(1, bs + 1) * count - 1,
            extend_lens=[count] * bs, prefix_lens=[start] * bs, seq_slots=seqs,
        )  # fmt: skip

    offsets = torch.arange(tokens).repeat(bs)
    kv_table, mask = runner.table.decode_table(idx.repeat_interleave(tokens), context + offsets + 1)
    as_rows = ForwardBatch(
        ForwardMode.DECODE, torch.randint(100, 1000, (bs * tokens,)), context + offsets,
        table[idx.repeat_interleave(tokens), context + offsets], logits_index=torch.arange(1, bs + 1) * tokens - 1,
        kv_table=kv_table, kv_mask=mask,
    )  # fmt: skip
    return extend(0, context), extend(context, tokens), as_rows


def measure(drafter, bs: int, context: int, tokens: int, reps: int) -> dict:
    runner, head = drafter.runner, drafter.runner.model
    graphs, width = runner.graphs, head.catch_up_feature_width
    dtype = next(head.parameters()).dtype
    rows = [runner.table.alloc() for _ in range(bs)]
    fill, as_extend, as_rows = batches(runner, rows, context, tokens)
    head.set_features(torch.randn(bs * context, width, dtype=dtype, device=runner.device))
    runner.forward(fill)
    features = torch.randn(bs * tokens, width, dtype=dtype, device=runner.device)
    ways = {
        "eager extend": (as_extend, None),
        "eager rows": (as_rows, None),
        "captured rows": (as_rows, graphs),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    replayed = (
        True  # whether the captured shape ran (on the CPU a shape measured slower than eager is dropped)
    )
    for _ in range(reps + 2):
        for name, (fb, step_graphs) in ways.items():
            runner.graphs = step_graphs
            head.set_features(features)
            sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(fb)
            sync(runner.device)
            times[name].append(time.perf_counter() - t0)
            if step_graphs is not None:
                replayed &= runner.last_forward_graph
    runner.graphs = graphs
    for r in rows:
        runner.table.free(r)
    ms = {name: round(statistics.median(t[2:]) * 1e3, 3) for name, t in times.items()}
    return {"bs": bs, "rows": bs * tokens, "ms": ms, "replayed": replayed,
            "captured_vs_extend": round(ms["eager extend"] / ms["captured rows"], 2)}  # fmt: skip


def main() -> None:
    ap = step_arguments(__doc__)
    ap.add_argument("--tokens", type=int, default=4, help="tokens a request catches up on (num_steps + 1)")
    args = ap.parse_args()
    from kiln import Engine
    from kiln.loader.default_model import default_model_path
    from kiln.loader.model_config import read_hf_config
    from kiln.runner.compiler import compile_cache_dir
    from kiln.speculative.draft_model import capture_draft_graphs

    path = args.model_path or default_model_path()
    head = write_eagle_head(Path(tempfile.mkdtemp()) / "head", read_hf_config(path))
    eng = Engine(model_path=path, device=args.device, max_total_tokens=32768, disable_cuda_graph=True,
                 max_running_requests=max(args.bs), num_threads=args.threads, speculative_algorithm="EAGLE",
                 speculative_draft_model_path=head, speculative_num_steps=args.tokens - 1)  # fmt: skip
    drafter = eng.scheduler.spec.drafter
    t0 = time.perf_counter()
    # a server whose largest batch takes the rows of every measured catch-up (CUDA captures catch-ups within it)
    sizes = sorted(set(args.bs) | {max(args.bs) * args.tokens})
    capture_draft_graphs(drafter, sizes, args.context + args.tokens + 8, compile_cache_dir(None))
    captured = drafter.runner.graphs.captured("extend")
    print(f"captured the catch-ups at {captured} rows in {time.perf_counter() - t0:.1f} s")
    results = [measure(drafter, bs, args.context, args.tokens, args.reps) for bs in args.bs]
    runner = drafter.runner
    print(f"model={path} device={runner.device} dtype={runner.dtype} context={args.context} tokens={args.tokens} "
          f"(median of {args.reps})")  # fmt: skip
    print(
        f"{'bs':>4} {'rows':>5}  {'eager extend ms':>16} {'eager rows ms':>14} {'captured rows ms':>17}  speed-up"
    )
    for r in results:
        ms = r["ms"]
        print(f"{r['bs']:>4} {r['rows']:>5}  {ms['eager extend']:>16.2f} {ms['eager rows']:>14.2f} "
              f"{ms['captured rows']:>17.2f}  {r['captured_vs_extend']:.2f}x"
              + ("" if r["replayed"] else "  (no captured shape ran it: eager)"))  # fmt: skip
    save_results(args.json, path, runner.device, results)
    eng.shutdown()


if __name__ == "__main__":
    main()
