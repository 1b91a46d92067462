"""Time the joint head at Clef-Flash's full shape on a 2,000-token prompt (fp32, 2 threads): the
head's share of a 9B decision, next to the tower time BENCHMARKS.md estimates.

    python benchmarks/head_share.py
"""

import json
import statistics
import time

import torch

from clef_gguf.convert.synthetic.head import BENCH_COUNTS, random_head, synthetic_spans

FLASH = dict(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)
TOKENS = 2000
COUNTS = list(BENCH_COUNTS)  # bench's questions: a noul, a 4-way choice, a 5-level score


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    head = random_head(FLASH, seed=0).eval()
    hidden = torch.randn(TOKENS, FLASH["hidden_size"])
    questions, options = synthetic_spans(1700, COUNTS)  # after the state
    rows = torch.randn(sum(e - s for s, e in options), FLASH["hidden_size"])
    times = []
    with torch.inference_mode():
        for _ in range(6):  # the first is a warm-up
            start = time.perf_counter()
            head(hidden, rows, questions, options, COUNTS, [0, 1, 2])
            times.append(time.perf_counter() - start)
    ms = [t * 1e3 for t in times[1:]]
    print(json.dumps({"tokens": TOKENS, "head_ms_median": round(statistics.median(ms), 1),
                      "head_ms_min": round(min(ms), 1), "head_ms_max": round(max(ms), 1)}))


if __name__ == "__main__":
    main()
