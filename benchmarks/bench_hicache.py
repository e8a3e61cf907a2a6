"""The hierarchical cache on the default model, in-process engines side by side in one run.

1. Multi-turn chat whose history outgrows a deliberately small device pool: --conversations chats take turns
   (round robin), each turn sending the whole history plus a new user message; the device pool holds about two
   histories, so without a host tier every turn of a chat finds its history evicted and prefills it again. The
   figure is the mean time to first token of the turns after the first round (a turn is one prefill and one new
   token), with the host tier against without it: engines side by side, each turn sent to each. A third engine
   whose device pool holds every history gives the bound a tier can reach (the ratio's floor on this workload).
2. Restart: a long prefix prefilled cold, the engine shut down, a new engine started on the same storage
   directory; the time to first token of the same prompt served from the file storage tier against the cold one.

    python benchmarks/bench_hicache.py [--conversations 6] [--turns 6] [--pool-tokens 1024]
                                       [--prefix-tokens 2000] [--threads N] [--device cpu|cuda]
                                       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

FIRST_TOKEN = {"max_new_tokens": 1, "temperature": 0}


def user_message(conversation: int, turn: int) -> str:
    words = " ".join(f"c{conversation}t{turn}w{i}" for i in range(12))
    return f"\nUser: please look at {words}\nAssistant: noted, {words[:60]}"


def engine(model: str, pool_tokens: int, device: str = "cpu", **tier):
    import kiln

    return kiln.Engine(model_path=model, device=device, **{"max_total_tokens": pool_tokens, **tier})


def chat_configs(args: argparse.Namespace) -> dict[str, dict]:
    """The engines of the chat workload: the small device pool alone, with the host tier, and a device pool that
    holds every history (what no tier can beat: only the new messages are computed, nothing is copied)."""
    every_history = args.conversations * args.turns * 256  # ~140 tokens a message, with room to spare
    return {
        "device_only": {},
        "host_tier": dict(enable_hierarchical_cache=True, hicache_ratio=8.0),
        "device_holds_all": dict(max_total_tokens=max(every_history, args.pool_tokens)),
    }


def ttft(eng, prompt: str) -> float:
    t0 = time.perf_counter()
    eng.generate(prompt, FIRST_TOKEN)
    return time.perf_counter() - t0


def chat_ttfts(model: str, args: argparse.Namespace, configs: dict[str, dict]) -> dict[str, list[float]]:
    """TTFT of every turn after the first round, for each engine configuration. The engines live side by side
    and take each turn one after the other, their order reversed from turn to turn, so that a burst of load on a
    shared host lands on all of them instead of on whichever ran during it."""
    engines = {name: engine(model, args.pool_tokens, args.device, **tier) for name, tier in configs.items()}
    try:
        histories = ["System: a long chat." for _ in range(args.conversations)]
        times: dict[str, list[float]] = {name: [] for name in engines}
        for turn in range(args.turns):
            for c in range(args.conversations):
                histories[c] += user_message(c, turn)
                order = list(engines) if (turn * args.conversations + c) % 2 == 0 else list(engines)[::-1]
                for name in order:
                    seconds = ttft(engines[name], histories[c])
                    if turn:
                        times[name].append(seconds)
        return times
    finally:
        for eng in engines.values():
            eng.shutdown()


def restart_ttfts(model: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(cold TTFT, TTFT after a restart from storage, prompt tokens)."""
    prompt = " ".join(f"line {i}: the value is {i * 7 % 13}." for i in range(args.prefix_tokens // 10))
    with tempfile.TemporaryDirectory() as storage:
        tier = dict(
            enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=storage
        )
        eng = engine(model, args.prefix_tokens * 2, args.device, **tier)
        tokens = len(eng.tokenizer.encode(prompt))
        cold = ttft(eng, prompt)
        eng.scheduler.kv.cache.storage.drain()
        eng.shutdown()
        eng = engine(model, args.prefix_tokens * 2, args.device, **tier)
        try:
            warm = ttft(eng, prompt)
            assert eng.scheduler.kv.cache.storage.hit_tokens > 0, "the restart did not hit the storage tier"
        finally:
            eng.shutdown()
    return cold, warm, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--pool-tokens", type=int, default=1024)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the host tier's copies on a copy stream")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kiln.loader.default_model import default_model_path

    model = args.model or default_model_path()
    chat = chat_ttfts(model, args, chat_configs(args))
    plain, tiered, bound = chat["device_only"], chat["host_tier"], chat["device_holds_all"]
    cold, warm, tokens = restart_ttfts(model, args)
    result = {
        "device": args.device,
        "chat_mean_ttft_s": {name: statistics.mean(times) for name, times in chat.items()},
        "chat_ratio": statistics.mean(tiered) / statistics.mean(plain),
        "chat_bound_ratio": statistics.mean(bound) / statistics.mean(plain),
        "host_tier_over_bound": statistics.mean(tiered) / statistics.mean(bound),
        "restart": {
            "prompt_tokens": tokens,
            "cold_ttft_s": cold,
            "storage_ttft_s": warm,
            "ratio": warm / cold,
        },
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
