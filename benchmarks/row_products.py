"""The products a decoder's layers compute, on 1 to 8 rows: ``nn.Linear``'s ``x @ Wᵀ`` against
``W @ xᵀ`` transposed back to the rows' layout (what ``decoding.FewRowProducts`` computes).

The weights are SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up and down; hidden 576,
3 key-value heads of 64, MLP 1,536), random, fp32: all 210 products run one after another, so
no weight is still cached when its turn comes, as in a forward. The figure is the median time of
the 210 products, in ms; on the CPU ``decoding.FEW_ROWS`` says which row counts the loop gives
``W @ xᵀ``: this table is how to check that rule on another CPU.

    .venv/bin/python -m benchmarks.row_products --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

HIDDEN, KV, MLP, LAYERS = 576, 192, 1536, 30
SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (MLP, HIDDEN),
    (MLP, HIDDEN),
    (HIDDEN, MLP),
]


def median_ms(products, repeats: int) -> float:
    for _ in range(3):
        products()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        products()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(out, width) for _ in range(LAYERS) for out, width in SHAPES]
    table = []
    for rows in range(1, 9):
        inputs = {width: torch.randn(rows, width) for width in (HIDDEN, MLP)}
        pairs = [(w, inputs[w.shape[1]]) for w in weights]

        def linear(pairs=pairs):
            for w, x in pairs:
                torch.nn.functional.linear(x, w)

        def weight_by_rows(pairs=pairs):
            for w, x in pairs:
                torch.mm(w, x.t()).t().contiguous()

        table.append(
            {
                "rows": rows,
                "nn_linear_ms": median_ms(linear, args.repeats),
                "w_by_rows_ms": median_ms(weight_by_rows, args.repeats),
            }
        )
        print(json.dumps(table[-1]), flush=True)


if __name__ == "__main__":
    main()
