"""The route ``route="auto"`` takes over a data loader, against each route's time.

``LowRankGGN(model, loss_func, loader, ...)`` followed by ``eigh(top_k=10)``,
in CPU time (one thread) over that of one forward+backward pass of every batch
(the best of five), for each choice named: ``auto`` (the defaults),
``implicit`` (``route="implicit"``) or a Gram-route solver (``dense``,
``gram_krylov``, ``factor_krylov``);
printed as one JSON line with the route ``"auto"`` took and its reason
(``docs/math.rst``, "Choosing the route"; ``benchmarks/README.md``, "The route
for data loaders").

Run: ``python benchmarks/loader_routes.py --problem char-lstm --samples 32
--batch-size 8 --choices auto implicit gram_krylov``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from problems import PROBLEMS, make_problem

from vivit import LowRankGGN


def cpu_time(function) -> tuple[float, object]:
    """CPU seconds of ``function()``, and what it returned."""
    start = time.process_time()
    result = function()
    return time.process_time() - start, result


def request(model, loss_func, loader, choice: str) -> LowRankGGN:
    """The curvature of the loader and its top 10 eigenpairs."""
    options = (
        {"route": choice}
        if choice in ("auto", "implicit")
        else {"route": "gram", "solver": choice}
    )
    ggn = LowRankGGN(model, loss_func, loader, progress=False, **options)
    ggn.eigh(top_k=10)
    return ggn


def forward_backward(model, loss_func, loader) -> None:
    """One forward and backward pass of every batch."""
    for inputs, targets in loader:
        model.zero_grad()
        loss_func(model(inputs), targets).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", choices=sorted(PROBLEMS), required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--choices", nargs="+", default=["auto", "implicit"])
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the rounding floor's, reported elsewhere
    torch.set_num_threads(1)
    model, loss_func, X, y = make_problem(
        args.problem, args.samples, 0, torch.device("cpu")
    )
    size = args.batch_size
    loader = [(X[i : i + size], y[i : i + size]) for i in range(0, len(X), size)]
    request(model, loss_func, loader[:1], "auto")  # libraries paged in
    unit = min(
        cpu_time(lambda: forward_backward(model, loss_func, loader))[0]
        for _ in range(5)
    )
    result = {"problem": args.problem, "samples": args.samples, "batch": size}
    for choice in args.choices:
        seconds, ggn = cpu_time(lambda c=choice: request(model, loss_func, loader, c))
        result[choice] = round(seconds / unit, 1)
        if choice == "auto":
            result["route"], result["reason"] = ggn.plan.route, ggn.plan.reason
    print(json.dumps(result))


if __name__ == "__main__":
    main()
