"""Approximation study: which approximation of the GGN can I trust on my model?

Trains the model briefly with SGD (or loads ``--checkpoint``), draws a mini-batch
and runs :func:`vivit.analysis.audit_approximations`: the exact top-k GGN
eigenpairs and damped Newton step against Monte-Carlo (``--mc-samples``, one
row each), subsampled (the first ``--subsample-size`` samples), block-diagonal
(one block per layer), diagonal, KFAC and EKFAC (curvlinops, ``pip install
'vivit[audit]'``; rows say "not installed" without it, "unsupported" for layers
other than Linear and Conv2d). Per approximation: the relative errors of its
top-k eigenvalues, the principal angles between its top-k eigenspace and the
exact one, and the cosine between its damped Newton step and the exact one
(``docs/math.rst``, "Approximation audit").
"""

from __future__ import annotations

import argparse

from studies.cli import (
    add_training_options,
    base_parser,
    positive_float,
    positive_int,
    study_main,
)
from studies.context import prepare
from studies.curvature import engine_errors, eval_mode
from studies.data import BatchStream
from studies.models import layer_groups
from studies.plots import approximations_figure
from studies.report import model_summary, wrapped_values, write
from studies.spectrum import choose_gram_dtype, trained_model
from vivit.analysis import audit_approximations

STUDY = "approximations"


def build_parser() -> argparse.ArgumentParser:
    """The approximation study's command line.

    Returns:
        The parser.
    """
    parser = base_parser(STUDY, __doc__.split("\n\n", 1)[0])
    parser.set_defaults(model="mlp")
    study = parser.add_argument_group("approximation study")
    study.add_argument(
        "--top-k",
        type=positive_int,
        default=10,
        help="Number of leading eigenpairs compared.",
    )
    study.add_argument(
        "--damping",
        type=positive_float,
        default=0.1,
        help="Damping δ of every damped Newton step −(G + δI)⁻¹ g.",
    )
    study.add_argument(
        "--mc-samples",
        type=positive_int,
        nargs="+",
        default=[1, 8],
        help="Monte-Carlo samples per datum; one MC row per value.",
    )
    study.add_argument(
        "--subsample-size",
        type=positive_int,
        default=None,
        help="Samples of the subsampled GGN (default: half the batch).",
    )
    add_training_options(
        study,
        "SGD steps before the audit (ignored with --checkpoint; 0 audits the "
        "initialisation).",
    )
    return parser


def run(args: argparse.Namespace) -> dict:
    """Run the approximation study.

    Args:
        args: Parsed command-line options.

    Returns:
        The content of ``results.json``.
    """
    setup = prepare(args, STUDY)
    data, loss_func = setup.data, setup.loss_func
    model, training, metrics = trained_model(setup)

    batch = BatchStream(len(data.train_targets), args.batch_size, setup.seed(2)).next()
    inputs, targets = data.train_batch(batch)
    num_samples = len(targets)
    subsample_size = min(args.subsample_size or max(1, num_samples // 2), num_samples)
    params = [p for p in model.parameters() if p.requires_grad]
    gram_dtype = choose_gram_dtype(
        "auto", setup.dtype, num_samples * data.num_classes, 1, setup.device
    )
    blocks = layer_groups(model)
    with eval_mode(model), engine_errors("Auditing the approximations"):
        audit = audit_approximations(
            model,
            loss_func,
            (inputs, targets),
            top_k=args.top_k,
            damping=args.damping,
            mc_samples=tuple(args.mc_samples),
            subsampling=list(range(subsample_size)),
            param_groups=[group for _, group in blocks],
            seed=setup.seed(3),
            engine=args.engine,
            gram_dtype=gram_dtype,
            progress=not args.no_progress,
        )
    results = {
        "num_samples": num_samples,
        "num_classes": data.num_classes,
        "num_parameters": sum(p.numel() for p in params),
        "gram_dtype": str(gram_dtype).removeprefix("torch."),
        "blocks": [name for name, _ in blocks],
        "training": training,
        "metrics": metrics,
        "audit": audit.to_dict(),
    }
    timings = {row.name: row.time_s for row in audit.rows if row.time_s is not None}
    payload = setup.payload(results, {"exact": audit.exact_time_s, **timings})
    summary = summarize(audit, results, args)
    figures = {"approximations.png": approximations_figure(audit.as_rows())}
    write(setup.output, payload, figures, summary)
    return payload


def summarize(audit, results: dict, args: argparse.Namespace) -> list[str]:
    """The human summary of the approximation study.

    Args:
        audit: The :class:`~vivit.analysis.ApproximationAudit`.
        results: The study's results.
        args: Parsed command-line options.

    Returns:
        Lines to print.
    """
    return [
        model_summary("Approximation", results, args),
        f"Exact top {audit.top_k} GGN eigenvalues (Gram matrix in "
        f"{results['gram_dtype']}):",
        *wrapped_values(audit.exact_eigenvalues),
        str(audit),
    ]


main = study_main(build_parser, run)
