"""Noise study: curvature and its noise along the top eigenvectors during training.

Trains the model with SGD and, at regular checkpoints, computes on a fixed probe
mini-batch (with :meth:`vivit.LowRankGGN.directional_derivatives`) the top-k GGN
eigenvalues and, per eigendirection ``e_k``, the per-sample first and second
directional derivatives ``γ_nk = e_kᵀ∇ℓ_n`` and ``λ_nk = e_kᵀ G_n e_k``: their
means, variances and signal-to-noise ratios ``mean² / variance``. Also records
which fraction of the mini-batch gradient lies in the top-k eigenspace.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from tqdm.auto import tqdm

from studies.cli import add_sgd_options, base_parser, positive_int, study_main
from studies.context import Setup, prepare
from studies.curvature import engine_errors, low_rank_ggn
from studies.data import BatchStream
from studies.errors import StudyError
from studies.plots import noise_figure
from studies.report import write
from studies.training import evaluate_splits, gradient_step
from vivit.model_inputs import ModelInputs

STUDY = "noise"

#: Per-direction statistics of :class:`vivit.DirectionalDerivatives` recorded.
STATISTICS = (
    "gamma_mean",
    "gamma_var",
    "gamma_snr",
    "lambda_mean",
    "lambda_var",
    "lambda_snr",
)


def build_parser() -> argparse.ArgumentParser:
    """The noise study's command line.

    Returns:
        The parser.
    """
    parser = base_parser(STUDY, __doc__.split("\n\n", 1)[0])
    study = parser.add_argument_group("noise study")
    study.add_argument(
        "--top-k",
        type=positive_int,
        default=10,
        help="Number of leading eigendirections whose noise is recorded.",
    )
    study.add_argument(
        "--steps", type=positive_int, default=200, help="SGD training steps."
    )
    study.add_argument(
        "--every",
        type=positive_int,
        default=20,
        help="Steps between two curvature checkpoints (the first is at step 0, the "
        "last after the final step).",
    )
    add_sgd_options(study)
    return parser


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """Steps after which the curvature is probed.

    Args:
        steps: Number of training steps.
        every: Interval.

    Returns:
        ``0, every, 2·every, …`` and ``steps``.
    """
    return sorted(set(range(0, steps + 1, every)) | {steps})


def probe(
    setup: Setup, model: torch.nn.Module, inputs: ModelInputs, targets: torch.Tensor
) -> dict:
    """Top-k eigenvalues and directional-derivative noise on the probe batch.

    Args:
        setup: The study's setup.
        model: The model (evaluation mode is set here).
        inputs: Probe batch inputs.
        targets: Probe batch labels.

    Returns:
        Eigenvalues and per-direction statistics, ordered by descending
        eigenvalue, the gradient fraction in their span, and the time it took.
    """
    start = time.perf_counter()
    ggn = low_rank_ggn(
        model,
        setup.loss_func,
        (inputs, targets),
        "Probing curvature",
        engine=setup.args.engine,
    )
    with engine_errors("Directional derivatives"):
        derivatives = ggn.directional_derivatives(top_k=setup.args.top_k)
    order = derivatives.evals.argsort(descending=True)
    record = {"eigenvalues": derivatives.evals[order].detach()}
    for name in STATISTICS:
        record[name] = getattr(derivatives, name)[order].detach()
    elapsed = time.perf_counter() - start

    # γ̄_k = e_kᵀ∇L: the gradient's component along direction k (any reduction).
    grad_norm2 = float(sum(g.pow(2).sum() for g in ggn.gradient()))
    in_span = float(derivatives.gamma_bar.pow(2).sum())
    record["gradient_fraction_in_top_k"] = in_span / grad_norm2 if grad_norm2 else None
    record["probe_loss"] = float(ggn.loss)
    record["time_s"] = elapsed
    return record


def run(args: argparse.Namespace) -> dict:
    """Run the noise study.

    Args:
        args: Parsed command-line options.

    Returns:
        The content of ``results.json``.

    Raises:
        StudyError: For input the study cannot work with.
    """
    setup = prepare(args, STUDY)
    if args.batch_size < 2:
        raise StudyError("--batch-size must be at least 2 to estimate variances.")
    data, loss_func = setup.data, setup.loss_func
    model = copy.deepcopy(setup.model)
    num_train = len(data.train_targets)
    batches = BatchStream(num_train, args.batch_size, setup.seed(1))
    probe_index = BatchStream(num_train, args.batch_size, setup.seed(2)).next()
    probe_inputs, probe_targets = data.train_batch(probe_index)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    probes = set(checkpoint_steps(args.steps, args.every))
    checkpoints, batch_losses = [], []
    curvature_time = training_time = 0.0
    for step in tqdm(
        range(args.steps + 1), desc="SGD + curvature", disable=args.no_progress
    ):
        if step in probes:
            record = probe(setup, model, probe_inputs, probe_targets)
            curvature_time += record["time_s"]
            checkpoints.append(
                {"step": step, **evaluate_splits(model, loss_func, data), **record}
            )
        if step == args.steps:
            break
        start = time.perf_counter()
        index = batches.next()
        inputs, targets = data.train_batch(index)
        loss, _ = gradient_step(model, optimizer, loss_func, inputs, targets)
        training_time += time.perf_counter() - start
        if not math.isfinite(loss):
            raise StudyError(
                f"SGD training diverged at step {step} (loss {loss}); lower --lr."
            )
        batch_losses.append(loss)

    results = {
        "batch_size": args.batch_size,
        "top_k": args.top_k,
        "steps": args.steps,
        "every": args.every,
        "lr": args.lr,
        "momentum": args.momentum,
        "batch_losses": batch_losses,
        "checkpoints": checkpoints,
    }
    payload = setup.payload(
        results, {"training_s": training_time, "curvature_s": curvature_time}
    )
    summary = summarize(results, args)
    write(
        setup.output,
        payload,
        {"snr.png": noise_figure(_plain(checkpoints), args.top_k)},
        summary,
        checkpoints={"model.pt": model.state_dict()},
    )
    return payload


def _plain(checkpoints: list[dict]) -> list[dict]:
    """Checkpoints with tensors turned into lists of floats (for plotting)."""
    return [
        {
            key: value.tolist() if isinstance(value, torch.Tensor) else value
            for key, value in c.items()
        }
        for c in checkpoints
    ]


def _median(values: torch.Tensor) -> float:
    finite = [v for v in values.tolist() if math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def summarize(results: dict, args: argparse.Namespace) -> list[str]:
    """The human summary of the noise study.

    Args:
        results: The study's results.
        args: Parsed command-line options.

    Returns:
        Lines to print.
    """
    lines = [
        f"Noise study: model {args.model}, SGD (lr {args.lr}, momentum "
        f"{args.momentum}) for {args.steps} steps, top-{args.top_k} directions of "
        f"a probe batch of {args.batch_size}.",
        f"{'step':>6} {'test acc':>9} {'λ_1':>10} {'λ_k':>10} {'med SNR γ':>10} "
        f"{'med SNR λ':>10} {'grad in top-k':>14}",
    ]
    for c in results["checkpoints"]:
        evals = c["eigenvalues"].tolist()
        fraction = c["gradient_fraction_in_top_k"]
        lines.append(
            f"{c['step']:>6} {100 * c['test_accuracy']:>8.1f}% {evals[0]:>10.3g} "
            f"{evals[-1]:>10.3g} {_median(c['gamma_snr']):>10.3g} "
            f"{_median(c['lambda_snr']):>10.3g} "
            f"{'n/a' if fraction is None else f'{100 * fraction:.1f} %':>14}"
        )
    first, last = results["checkpoints"][0], results["checkpoints"][-1]
    lines.append(
        "Median gradient SNR over the top directions went from "
        f"{_median(first['gamma_snr']):.3g} to {_median(last['gamma_snr']):.3g}, "
        f"curvature SNR from {_median(first['lambda_snr']):.3g} to "
        f"{_median(last['lambda_snr']):.3g} (SNR < 1: noise dominates the mean)."
    )
    return lines


main = study_main(build_parser, run)
