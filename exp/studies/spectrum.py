"""Spectrum study: the exact GGN spectrum of a mini-batch and its approximations.

Trains the model briefly with SGD (or loads ``--checkpoint``), draws a mini-batch
(or, with ``--curvature-data test``, takes the whole held-out set as a
list of batches) and computes, with :class:`vivit.LowRankGGN`:

- ``exact``: all eigenvalues of the exact GGN (from the ``N·C`` Gram matrix);
- ``mc``: the Monte-Carlo approximation (``mc_samples`` per sample, ``N·M`` rows);
- ``subsample``: the GGN of the first ``--subsample-size`` samples of the batch
  (of the held-out set: one batch of ``--batch-size`` by default);
- ``block_diagonal``: one GGN block per layer, eigenvalues of all blocks merged.

It reports every eigenvalue, how many of them are resolved (above the
numerical-zero tolerance), how well each approximation recovers the top-k
eigenvalues (relative errors) and eigenspace (overlap ``‖Q Pᵀ‖_F² / k`` of the
flattened eigenvectors, block eigenvectors embedded with zeros), and the time
each method took: the median of ``--timing-repeats`` runs (the first run of a
method pays one-off costs such as memory allocation and library loading).

By default (``--gram-dtype auto``) a float32 model's Gram matrices are accumulated
in float64 whenever they fit into memory: the float32 Gram matrix cannot resolve
eigenvalues below about ``N·C·ε₃₂·λ_max`` (``docs/math.rst``, "Precision and the
numerical zero").
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Parameter

from studies.cli import (
    add_gram_dtype_option,
    add_training_options,
    base_parser,
    positive_int,
    study_main,
)
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
from studies.report import model_summary, number, wrapped_values, write
from studies.training import evaluate_splits, train_sgd
from vivit import GramTooLargeError, LowRankGGN
from vivit.linalg.solvers import numerical_zero_tolerance
from vivit.memory import check_gram_fits
from vivit.model_inputs import take_samples

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
    add_training_options(study)
    study.add_argument(
        "--mc-samples",
        type=positive_int,
        default=1,
        help="Monte-Carlo samples per datum of the MC approximation.",
    )
    study.add_argument(
        "--curvature-data",
        choices=("batch", "test"),
        default="batch",
        help="Samples whose GGN is studied: 'batch' (a training mini-batch of "
        "--batch-size) or 'test' (the whole held-out set, passed to vivit as a "
        "loader of --batch-size batches; every method then uses that loader, "
        "and 'subsample' is the GGN of its first --subsample-size samples).",
    )
    study.add_argument(
        "--subsample-size",
        type=positive_int,
        default=None,
        help="Samples whose GGN is the subsampling approximation (default: half the "
        "batch; with --curvature-data test, one batch of --batch-size).",
    )
    study.add_argument(
        "--timing-repeats",
        type=positive_int,
        default=5,
        help="Runs of every method; its times are the medians over the runs.",
    )
    study.add_argument(
        "--blocks",
        choices=("layer", "parameter"),
        default="layer",
        help="Blocks of the block-diagonal approximation: one per layer (weight and "
        "bias together) or one per parameter tensor.",
    )
    add_gram_dtype_option(study)
    return parser


def choose_gram_dtype(
    choice: str, model_dtype: torch.dtype, num_rows: int, num_grams: int, device
) -> torch.dtype:
    """The type the study accumulates its Gram matrices in.

    Args:
        choice: ``--gram-dtype``.
        model_dtype: Type of the model and the data.
        num_rows: Side length of the largest Gram matrix.
        num_grams: Most Gram matrices held at once (blocks).
        device: Device of the computation.

    Returns:
        ``float64`` if chosen, or if ``auto`` and it fits into memory; else the
        model's type.
    """
    if choice == "model":
        return model_dtype
    if choice == "float64":
        return torch.float64
    try:
        check_gram_fits(num_rows, num_grams, torch.float64, device)
    except GramTooLargeError:
        return model_dtype
    return torch.float64


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
            eigenvectors, and in total: medians over repeated runs.
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
    repeats: int = 1,
) -> Method:
    """Run one method and collect its eigenvalues, top eigenpairs and times.

    Args:
        label: Human-readable name.
        build: Constructs the ``LowRankGGN`` (the backward pass); every call must
            give the same GGN (seed any randomness inside it).
        params: All trainable parameters, in the order of flattened vectors.
        top_k: Number of leading eigenpairs.
        repeats: Runs of the whole method; the times are their medians, the
            results those of the last run.

    Returns:
        The method's results.
    """
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        ggn = build()
        built = time.perf_counter()
        num_groups = len(ggn.param_groups)
        with engine_errors(f"{label}: eigendecomposition"):
            evals = [ggn.eigvalsh(g) for g in range(num_groups)]
            decomposed = time.perf_counter()
            pairs = [ggn.eigh(top_k, g) for g in range(num_groups)]
        done = time.perf_counter()
        runs.append(
            {
                "backward": built - start,
                "eigendecomposition": decomposed - built,
                "eigenvectors": done - decomposed,
                "total": done - start,
            }
        )
    times = {key: statistics.median(run[key] for run in runs) for key in runs[0]}

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
        times=times,
    )


def compare(
    method: Method, exact: Method, gram_dtype: torch.dtype, model_dtype: torch.dtype
) -> dict:
    """A method's results and its agreement with the exact top-k.

    Args:
        method: The method.
        exact: The exact method.
        gram_dtype: Type the Gram matrices were accumulated in.
        model_dtype: Type of the model (of the factors of ``V``).

    Returns:
        The entry of ``results.json``.
    """
    errors = relative_errors(exact.top_values, method.top_values)
    finite = [e for e in errors if math.isfinite(e)]
    # vivit's convention, applied to the eigenvalues of all of a method's blocks
    tolerance = numerical_zero_tolerance(
        torch.tensor(method.eigenvalues, dtype=gram_dtype), factor_dtype=model_dtype
    )
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


def trained_model(setup: Setup) -> tuple[torch.nn.Module, dict | None, dict]:
    """A copy of the study's model, trained (:func:`train_or_load`) and evaluated.

    Args:
        setup: The study's setup.

    Returns:
        The model, what the training did (``None``: skipped) and its
        :func:`~studies.training.evaluate_splits` metrics.
    """
    model = copy.deepcopy(setup.model)
    training = train_or_load(setup, model)
    return model, training, evaluate_splits(model, setup.loss_func, setup.data)


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
    model, training, metrics = trained_model(setup)

    held_out = args.curvature_data == "test"
    if held_out:  # the whole held-out set, batch by batch
        inputs, targets = data.test_inputs, data.test_targets
        curvature_data = data.test_batches(args.batch_size)
        default_subsample = min(args.batch_size, len(targets))
    else:
        num_train = len(data.train_targets)
        batch = BatchStream(num_train, args.batch_size, setup.seed(2)).next()
        inputs, targets = data.train_batch(batch)
        curvature_data = (inputs, targets)
        default_subsample = max(1, args.batch_size // 2)
    num_samples = len(targets)
    subsample_size = args.subsample_size or default_subsample
    if subsample_size > num_samples:
        limit = (
            f"the {num_samples} held-out samples"
            if held_out
            else f"--batch-size {args.batch_size}"
        )
        raise StudyError(f"--subsample-size {subsample_size} exceeds {limit}.")
    params = trainable_parameters(model)
    blocks = block_groups(model, args.blocks)
    gram_dtype = choose_gram_dtype(
        args.gram_dtype,
        setup.dtype,
        num_samples * data.num_classes,
        len(blocks),
        setup.device,
    )

    def ggn(data=curvature_data, **kwargs) -> Callable[[], LowRankGGN]:
        return lambda: low_rank_ggn(
            model,
            loss_func,
            data,
            gram_dtype=gram_dtype,
            engine=args.engine,
            progress=False if args.no_progress else None,
            **kwargs,
        )

    def mc_ggn() -> LowRankGGN:  # the same MC samples in every repeated run
        return low_rank_ggn(
            model,
            loss_func,
            curvature_data,
            progress=False if args.no_progress else None,
            mc_samples=args.mc_samples,
            gram_dtype=gram_dtype,
            engine=args.engine,
            generator=setup.generator(3),
        )

    ggn()()  # warm-up, not timed
    top_k, repeats = args.top_k, args.timing_repeats
    exact = compute("exact", ggn(), params, top_k, repeats)
    methods = {
        "exact": exact,
        "mc": compute(
            f"MC ({args.mc_samples} sample{'s' * (args.mc_samples > 1)})",
            mc_ggn,
            params,
            top_k,
            repeats,
        ),
        "subsample": compute(
            f"subsample ({subsample_size} of {num_samples})",
            ggn((take_samples(inputs, slice(subsample_size)), targets[:subsample_size]))
            if held_out
            else ggn(subsampling=list(range(subsample_size))),
            params,
            top_k,
            repeats,
        ),
        "block_diagonal": compute(
            f"block-diagonal ({len(blocks)} {args.blocks}s)",
            ggn(param_groups=[group for _, group in blocks]),
            params,
            top_k,
            repeats,
        ),
    }
    entries = {
        name: compare(method, exact, gram_dtype, setup.dtype)
        for name, method in methods.items()
    }
    entries["block_diagonal"]["blocks"] = [name for name, _ in blocks]
    results = {
        "curvature_data": args.curvature_data,
        "num_samples": num_samples,
        "batch_size": args.batch_size,
        "num_classes": data.num_classes,
        "num_parameters": sum(p.numel() for p in params),
        "gram_dtype": str(gram_dtype).removeprefix("torch."),
        "top_k": top_k,
        "timing_repeats": repeats,
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
    if results.get("curvature_data") == "test":  # absent before the option
        batches = -(-results["num_samples"] // results["batch_size"])
        samples = (
            f"the whole held-out set ({results['num_samples']} samples, "
            f"{batches} batches of up to {results['batch_size']})"
        )
    else:
        samples = f"a mini-batch of {results['batch_size']}"
    top = exact["top_eigenvalues"]
    if len(top) < results["top_k"]:
        header = (
            f"Top {len(top)} eigenvalues (--top-k {results['top_k']}; only "
            f"{len(top)} are non-zero):"
        )
    else:
        header = f"Top {len(top)} eigenvalues:"
    lines = [
        model_summary("Spectrum", results, args),
        f"Exact GGN of {samples}: Gram matrix "
        f"{exact['gram_sizes'][0]} x {exact['gram_sizes'][0]} in "
        f"{results['gram_dtype']}, {exact['num_nonzero']} of "
        f"{len(exact['eigenvalues'])} eigenvalues resolved (above the "
        f"numerical-zero tolerance {exact['zero_tolerance']:.2g}).",
        header,
        *wrapped_values(top),
        f"{'method':<28} {'time [s]':>9} {'max rel. err':>13} {'mean rel. err':>14} "
        f"{'overlap':>8}",
    ]
    for entry in results["methods"].values():
        max_err, mean_err = entry["max_relative_error"], entry["mean_relative_error"]
        lines.append(
            f"{entry['label']:<28} {number(entry['time_s']['total']):>9} "
            f"{number(max_err):>13} {number(mean_err):>14} "
            f"{entry['subspace_overlap']:>8.3f}"
        )
    return lines


main = study_main(build_parser, run)
