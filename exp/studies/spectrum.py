"""Spectrum study: the exact GGN spectrum of a mini-batch and its approximations.

Trains the model briefly with SGD (or loads ``--checkpoint``), draws a mini-batch
and computes, with :class:`vivit.LowRankGGN`:

- ``exact``: all eigenvalues of the exact GGN (from the ``N·C`` Gram matrix);
- ``mc``: the Monte-Carlo approximation (``mc_samples`` per sample, ``N·M`` rows);
- ``subsample``: the GGN of the first ``--subsample-size`` samples of the batch;
- ``block_diagonal``: one GGN block per layer, eigenvalues of all blocks merged.

It reports every eigenvalue, how well each approximation recovers the top-k
eigenvalues (relative errors) and eigenspace (overlap ``‖Q Pᵀ‖_F² / k`` of the
flattened eigenvectors, block eigenvectors embedded with zeros), and the time
each method took.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Parameter

from studies.cli import (
    base_parser,
    momentum,
    non_negative_int,
    positive_float,
    positive_int,
)
from studies.cli import run_study as _run_study
from studies.context import Setup, prepare
from studies.curvature import (
    descending,
    embed,
    engine_errors,
    low_rank_ggn,
    relative_errors,
    subspace_overlap,
)
from studies.data import BatchStream
from studies.errors import StudyError
from studies.models import layer_groups, trainable_parameters
from studies.plots import spectrum_figure
from studies.report import write
from studies.training import evaluate_splits, train_sgd
from vivit import LowRankGGN
from vivit.linalg.solvers import numerical_zero_tolerance

STUDY = "spectrum"


def build_parser() -> argparse.ArgumentParser:
    """The spectrum study's command line.

    Returns:
        The parser.
    """
    parser = base_parser(STUDY, __doc__.split("\n\n", 1)[0])
    study = parser.add_argument_group("spectrum study")
    study.add_argument(
        "--top-k",
        type=positive_int,
        default=10,
        help="Number of leading eigenpairs whose recovery is measured.",
    )
    study.add_argument(
        "--train-steps",
        type=non_negative_int,
        default=100,
        help="SGD steps before the curvature is computed (ignored with "
        "--checkpoint; 0 studies the initialisation).",
    )
    study.add_argument(
        "--lr", type=positive_float, default=0.1, help="SGD learning rate."
    )
    study.add_argument(
        "--momentum", type=momentum, default=0.9, help="SGD momentum in [0, 1)."
    )
    study.add_argument(
        "--mc-samples",
        type=positive_int,
        default=1,
        help="Monte-Carlo samples per datum of the MC approximation.",
    )
    study.add_argument(
        "--subsample-size",
        type=positive_int,
        default=None,
        help="Samples of the mini-batch whose GGN is the subsampling approximation "
        "(default: half the batch).",
    )
    study.add_argument(
        "--blocks",
        choices=("layer", "parameter"),
        default="layer",
        help="Blocks of the block-diagonal approximation: one per layer (weight and "
        "bias together) or one per parameter tensor.",
    )
    return parser


@dataclass
class Method:
    """One way of computing the spectrum, and what it gave.

    Attributes:
        label: Human-readable name.
        groups: The parameter groups (one GGN block each).
        eigenvalues: All eigenvalues (all blocks merged), descending.
        top_values: The top-k eigenvalues, descending.
        top_vectors: Their eigenvectors over all parameters, ``[k, D]``.
        gram_sizes: Side of each block's Gram matrix.
        times: Seconds for the backward pass, the eigendecomposition, the
            eigenvectors, and in total.
    """

    label: str
    groups: list[list[Parameter]]
    eigenvalues: list[float]
    top_values: list[float]
    top_vectors: Tensor
    gram_sizes: list[int]
    times: dict[str, float]


def compute(
    label: str,
    build: Callable[[], LowRankGGN],
    params: Sequence[Parameter],
    top_k: int,
) -> Method:
    """Run one method and collect its eigenvalues, top eigenpairs and times.

    Args:
        label: Human-readable name.
        build: Constructs the ``LowRankGGN`` (the backward pass).
        params: All trainable parameters, in the order of flattened vectors.
        top_k: Number of leading eigenpairs.

    Returns:
        The method's results.
    """
    start = time.perf_counter()
    ggn = build()
    built = time.perf_counter()
    num_groups = len(ggn.param_groups)
    with engine_errors(f"{label}: eigendecomposition"):
        evals = [ggn.eigvalsh(g) for g in range(num_groups)]
        decomposed = time.perf_counter()
        pairs = [ggn.eigh(top_k, g) for g in range(num_groups)]
    done = time.perf_counter()

    candidates = []  # (value, group, index within the group's top-k)
    for g, (values, _) in enumerate(pairs):
        candidates += [(float(v), g, i) for i, v in enumerate(values.tolist())]
    candidates = sorted(candidates, reverse=True)[:top_k]
    embedded = [
        embed(vectors, group, params)
        for (_, vectors), group in zip(pairs, ggn.param_groups, strict=True)
    ]
    top_vectors = torch.stack([embedded[g][i] for _, g, i in candidates])
    return Method(
        label=label,
        groups=ggn.param_groups,
        eigenvalues=descending(torch.cat([e.detach().cpu() for e in evals])),
        top_values=[value for value, _, _ in candidates],
        top_vectors=top_vectors,
        gram_sizes=[ggn.gram(g).shape[0] for g in range(num_groups)],
        times={
            "backward": built - start,
            "eigendecomposition": decomposed - built,
            "eigenvectors": done - decomposed,
            "total": done - start,
        },
    )


def compare(method: Method, exact: Method, dtype: torch.dtype) -> dict:
    """A method's results and its agreement with the exact top-k.

    Args:
        method: The method.
        exact: The exact method.
        dtype: Data type of the computation (sets the numerical-zero tolerance).

    Returns:
        The entry of ``results.json``.
    """
    errors = relative_errors(exact.top_values, method.top_values)
    finite = [e for e in errors if math.isfinite(e)]
    # vivit's convention, applied to the eigenvalues of all of a method's blocks
    tolerance = numerical_zero_tolerance(torch.tensor(method.eigenvalues, dtype=dtype))
    return {
        "label": method.label,
        "num_blocks": len(method.groups),
        "gram_sizes": method.gram_sizes,
        "eigenvalues": method.eigenvalues,
        "zero_tolerance": tolerance,
        "num_nonzero": sum(v > tolerance for v in method.eigenvalues),
        "top_eigenvalues": method.top_values,
        "relative_errors": errors,
        "max_relative_error": max(finite) if finite else None,
        "mean_relative_error": sum(finite) / len(finite) if finite else None,
        "subspace_overlap": subspace_overlap(exact.top_vectors, method.top_vectors),
        "time_s": method.times,
    }


def block_groups(
    model: torch.nn.Module, kind: str
) -> list[tuple[str, list[Parameter]]]:
    """Parameter groups of the block-diagonal approximation.

    Args:
        model: The model.
        kind: ``"layer"`` (one block per layer) or ``"parameter"`` (one block per
            parameter tensor).

    Returns:
        ``(name, parameters)`` pairs.
    """
    if kind == "layer":
        return layer_groups(model)
    return [
        (name, [param])
        for name, param in model.named_parameters()
        if param.requires_grad
    ]


def train_or_load(setup: Setup, model: torch.nn.Module) -> dict | None:
    """Briefly train the model with SGD unless a checkpoint was given.

    Args:
        setup: The study's setup.
        model: The model to train, in place.

    Returns:
        What the training did, or ``None`` if it was skipped.
    """
    args = setup.args
    if args.checkpoint is not None or args.train_steps == 0:
        return None
    start = time.perf_counter()
    batches = BatchStream(len(setup.data.train_targets), args.batch_size, setup.seed(1))
    losses = train_sgd(
        model,
        setup.loss_func,
        setup.data,
        batches,
        args.train_steps,
        args.lr,
        args.momentum,
        progress=not args.no_progress,
        description="SGD training",
    )
    return {
        "steps": args.train_steps,
        "lr": args.lr,
        "momentum": args.momentum,
        "batch_losses": losses,
        "time_s": time.perf_counter() - start,
    }


def run(args: argparse.Namespace) -> dict:
    """Run the spectrum study.

    Args:
        args: Parsed command-line options.

    Returns:
        The content of ``results.json``.

    Raises:
        StudyError: For input the study cannot work with.
    """
    setup = prepare(args, STUDY)
    data, loss_func = setup.data, setup.loss_func
    model = copy.deepcopy(setup.model)
    training = train_or_load(setup, model)
    metrics = evaluate_splits(model, loss_func, data)

    num_train = len(data.train_targets)
    batch = BatchStream(num_train, args.batch_size, setup.seed(2)).next()
    inputs, targets = data.train_inputs[batch], data.train_targets[batch]
    subsample_size = args.subsample_size or max(1, args.batch_size // 2)
    if subsample_size > args.batch_size:
        raise StudyError(
            f"--subsample-size {subsample_size} exceeds --batch-size {args.batch_size}."
        )
    params = trainable_parameters(model)
    blocks = block_groups(model, args.blocks)

    def ggn(**kwargs) -> Callable[[], LowRankGGN]:
        return lambda: low_rank_ggn(
            model, loss_func, inputs, targets, engine=args.engine, **kwargs
        )

    ggn()()  # warm-up, not timed
    top_k = args.top_k
    exact = compute("exact", ggn(), params, top_k)
    methods = {
        "exact": exact,
        "mc": compute(
            f"MC ({args.mc_samples} sample{'s' * (args.mc_samples > 1)})",
            ggn(mc_samples=args.mc_samples, generator=setup.generator(3)),
            params,
            top_k,
        ),
        "subsample": compute(
            f"subsample ({subsample_size} of {args.batch_size})",
            ggn(subsampling=list(range(subsample_size))),
            params,
            top_k,
        ),
        "block_diagonal": compute(
            f"block-diagonal ({len(blocks)} {args.blocks}s)",
            ggn(param_groups=[group for _, group in blocks]),
            params,
            top_k,
        ),
    }
    entries = {
        name: compare(method, exact, setup.dtype) for name, method in methods.items()
    }
    entries["block_diagonal"]["blocks"] = [name for name, _ in blocks]
    results = {
        "batch_size": args.batch_size,
        "num_classes": data.num_classes,
        "num_parameters": sum(p.numel() for p in params),
        "top_k": top_k,
        "training": training,
        "metrics": metrics,
        "methods": entries,
    }
    payload = setup.payload(
        results, {name: m.times["total"] for name, m in methods.items()}
    )
    summary = summarize(results, args)
    write(
        setup.output,
        payload,
        {"spectrum.png": spectrum_figure(entries, top_k)},
        summary,
        checkpoints={"model.pt": model.state_dict()},
    )
    return payload


def summarize(results: dict, args: argparse.Namespace) -> list[str]:
    """The human summary of the spectrum study.

    Args:
        results: The study's results.
        args: Parsed command-line options.

    Returns:
        Lines to print.
    """
    exact = results["methods"]["exact"]
    metrics = results["metrics"]
    trained = results["training"]
    state = (
        f"after {trained['steps']} SGD steps"
        if trained
        else ("from --checkpoint" if args.checkpoint else "at initialisation")
    )
    top = ", ".join(f"{v:.3g}" for v in exact["top_eigenvalues"])
    lines = [
        f"Spectrum study: model {args.model} "
        f"({results['num_parameters']:,} parameters) {state}: train loss "
        f"{metrics['train_loss']:.3f}, test accuracy "
        f"{100 * metrics['test_accuracy']:.1f} %.",
        f"Exact GGN of a mini-batch of {results['batch_size']}: Gram matrix "
        f"{exact['gram_sizes'][0]} x {exact['gram_sizes'][0]}, "
        f"{exact['num_nonzero']} non-zero eigenvalues.",
        f"Top-{results['top_k']} eigenvalues: {top}",
        f"{'method':<28} {'time [s]':>9} {'max rel. err':>13} {'mean rel. err':>14} "
        f"{'overlap':>8}",
    ]
    for entry in results["methods"].values():
        max_err, mean_err = entry["max_relative_error"], entry["mean_relative_error"]
        lines.append(
            f"{entry['label']:<28} {entry['time_s']['total']:>9.3f} "
            f"{_number(max_err):>13} {_number(mean_err):>14} "
            f"{entry['subspace_overlap']:>8.3f}"
        )
    return lines


def _number(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (``None``: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    return _run_study(build_parser(), run, argv)
