"""One engine on CUDA with the default graph settings: the capture log lines, bars and figures."""

import json
import logging
import sys
import time

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
import torch  # noqa: E402

import kiln  # noqa: E402

free0, total = torch.cuda.mem_get_info()
t0 = time.time()
eng = kiln.Engine(model_path=sys.argv[1], device="cuda", max_total_tokens=65536)
free1, _ = torch.cuda.mem_get_info()
print(
    "device used by the engine",
    (free0 - free1) >> 20,
    "MiB; allocator reserved",
    torch.cuda.memory_reserved() >> 20,
    "MiB, allocated",
    torch.cuda.memory_allocated() >> 20,
    "MiB",
)
s = eng.scheduler.runner.graphs.summary()
for name, ph in s.items():
    print(
        name,
        ph["backend"],
        "sizes",
        ph["sizes"],
        "capture_s",
        ph["capture_seconds"],
        "bytes",
        ph["capture_bytes"],
    )
print(
    "ledger graph reserve",
    eng.parts.ledger.graph_reserve_bytes,
    eng.parts.ledger.line("graph reserve").inputs,
    "startup s",
    round(time.time() - t0, 1),
)
from kiln.memory.measure import memory_check  # noqa: E402

print(
    "memory check",
    [
        r
        for r in memory_check(eng.parts.ledger, eng.scheduler.runner.measured)
        if r["name"] == "graph_capture"
    ],
)
out = eng.generate(
    input_ids=[[1, 2, 3, 4, 5]] * 3, sampling_params=[{"max_new_tokens": 8, "temperature": 0.0}] * 3
)
print("generated", [o["output_ids"] for o in out])
json.dump(s, open(sys.argv[2], "w"), indent=1)
