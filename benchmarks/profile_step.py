"""Where one Kiln step spends its time: torch profiler over a prefill (or decode) on the default model.

python benchmarks/profile_step.py --prompt-len 512            # one 512-token extend
python benchmarks/profile_step.py --prompt-len 16 --decode 32 # 32 decode steps at batch 1
python benchmarks/profile_step.py --batch 32 --prompt-len 200 --decode 64  # the 32-stream serving shape
python benchmarks/profile_step.py --batch 32 --shared-prefix 1300 --prompt-len 20 --decode 32 --cuda-graph-bs 32
                                  # 32 questions after one system prompt, decode compiled at batch 32
"""

from __future__ import annotations

import argparse
import random

from torch.profiler import profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=0, help="decode steps to profile after the prefill")
    ap.add_argument("--batch", type=int, default=1, help="requests generated together")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens every prompt starts with (radix cache on)"
    )
    ap.add_argument(
        "--cuda-graph-bs", type=int, nargs="*", default=None, help="decode batch sizes to compile"
    )
    args = ap.parse_args()
    from kiln import Engine

    graphs = {"cuda_graph_bs": args.cuda_graph_bs} if args.cuda_graph_bs else {}
    eng = Engine(max_total_tokens=65536, max_running_requests=64, num_threads=args.threads,
                 disable_radix_cache=not args.shared_prefix, **graphs)  # fmt: skip
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(args.shared_prefix)]

    def prompt() -> list[int]:
        return system + [rng.randrange(100, 40000) for _ in range(args.prompt_len)]

    params = {"max_new_tokens": 1 + args.decode, "temperature": 0.0, "ignore_eos": True}
    eng.generate(input_ids=prompt(), sampling_params=params)  # warm-up (and the system prompt, cached)
    batch = [prompt() for _ in range(args.batch)]
    with profile(record_shapes=True) as prof:
        eng.generate(input_ids=batch, sampling_params=[params] * args.batch)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
