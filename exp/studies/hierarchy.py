"""Hierarchy study: Papyan's three levels, per-layer spectra and the SLQ density.

Trains the model briefly with SGD (or loads ``--checkpoint``), draws a mini-batch
and computes, from one :class:`vivit.LowRankGGN` with one parameter group per
layer (``vivit.analysis``):

- the exact split of the GGN into class means, cross-class means and
  within-class deviations (Papyan's probability-weighted means, or plain means
  with ``--weighting plain``), every part's non-zero spectrum and the overlap of
  its top eigenspace with the GGN's top eigenspace (``docs/math.rst``,
  "Hierarchy of the spectrum");
- the spectrum of every layer's diagonal GGN block;
- the spectral density of the Gram matrix by stochastic Lanczos quadrature,
  compared with the exact spectrum: Wasserstein-1 distance, its bound, the
  number of non-zero eigenvalues and the trace (``docs/math.rst``, "Spectral
  density by stochastic Lanczos quadrature").
"""

from __future__ import annotations

import argparse
import time

import torch

from studies.cli import (
    add_gram_dtype_option,
    add_training_options,
    base_parser,
    positive_float,
    positive_int,
    study_main,
)
from studies.context import prepare
from studies.curvature import descending, engine_errors, eval_mode, low_rank_ggn
from studies.data import BatchStream
from studies.errors import StudyError
from studies.models import layer_groups
from studies.plots import hierarchy_figure
from studies.report import model_summary, number, write
from studies.spectrum import choose_gram_dtype, trained_model
from vivit import InvalidArgumentError
from vivit.analysis import (
    Hierarchy,
    hierarchy,
    spectral_density,
    wasserstein_bound,
    wasserstein_distance,
)
from vivit.model_inputs import call_model

STUDY = "hierarchy"
#: What the hierarchy needs of the model and the data.
NEEDS_CLASSIFIER = (
    "The hierarchy needs a classifier with outputs [N, C] and one label per sample"
)
PARTS = ("class_means", "cross_class", "within_class")
#: What the summary calls each ``--weighting``.
WEIGHTING_NAMES = {
    "probabilities": "Papyan's parts (probability-weighted means)",
    "plain": "plain-mean parts (a variant, not Papyan's decomposition)",
}
#: Eigenvalue counts above these fractions of the largest, SLQ against exact.
COUNT_THRESHOLDS = (1e-1, 1e-2, 1e-3, 1e-4)


def build_parser() -> argparse.ArgumentParser:
    """The hierarchy study's command line.

    Returns:
        The parser.
    """
    parser = base_parser(STUDY, __doc__.split("\n\n", 1)[0])
    study = parser.add_argument_group("hierarchy study")
    add_training_options(study)
    study.add_argument(
        "--weighting",
        choices=("probabilities", "plain"),
        default="probabilities",
        help="Means of the (label, class) pairs: weighted by the softmax "
        "probabilities as Papyan defines them, or plain means over the samples.",
    )
    study.add_argument(
        "--lanczos-steps",
        type=positive_int,
        default=60,
        help="Lanczos steps per probe of the spectral density.",
    )
    study.add_argument(
        "--probes",
        type=positive_int,
        default=20,
        help="Random probe vectors of the spectral density.",
    )
    study.add_argument(
        "--failure-probability",
        type=positive_float,
        default=1e-3,
        help="η of the Wasserstein bound (it holds with probability 1 − η).",
    )
    add_gram_dtype_option(study)
    return parser


def overlaps(parts: Hierarchy, classes: int) -> dict[str, dict[str, float]]:
    """Each part's top eigenspace in the GGN's top ``C``, ``C²`` eigenvectors.

    Args:
        parts: The hierarchy.
        classes: ``C``.

    Returns:
        Part name to ``{"top_k": k, "in_top_C": …, "in_top_C2": …}``, with ``k``
        the part's rank bound (``C``, ``C(C−1)``) or ``C²`` for the within part.
    """
    sizes = {
        "class_means": classes,
        "cross_class": classes * (classes - 1),
        "within_class": classes * classes,
    }
    return {
        name: {
            "top_k": sizes[name],
            "in_top_C": parts.overlap(name, sizes[name], classes),
            "in_top_C2": parts.overlap(name, sizes[name], classes * classes),
        }
        for name in PARTS
    }


def density_results(parts: Hierarchy, args: argparse.Namespace, seed: int) -> dict:
    """SLQ of the Gram matrix against its exact spectrum.

    Args:
        parts: The hierarchy (its Gram matrix and tolerance).
        args: Parsed command-line options.
        seed: Seed of the probes.

    Returns:
        The entry of ``results.json``.
    """
    start = time.perf_counter()
    density = spectral_density(
        parts.gram, lanczos_steps=args.lanczos_steps, probes=args.probes, seed=seed
    )
    elapsed = time.perf_counter() - start
    exact = torch.linalg.eigvalsh(parts.gram.double())
    spread = (exact[-1] - exact[0]).item()
    size = parts.gram.shape[0]
    return {
        "dim": size,
        "lanczos_steps": density.lanczos_steps,
        "probes": density.probes,
        "nodes": density.nodes.flatten().tolist(),
        "weights": density.weights.flatten().tolist(),
        "wasserstein_distance": wasserstein_distance(density, exact),
        "wasserstein_bound": wasserstein_bound(
            size,
            density.lanczos_steps,
            density.probes,
            spread,
            args.failure_probability,
        ),
        "failure_probability": args.failure_probability,
        "spread": spread,
        "counts_above": [
            {
                "fraction": fraction,
                "threshold": fraction * exact[-1].item(),
                "slq": density.count(fraction * exact[-1].item()),
                "exact": int((exact > fraction * exact[-1]).sum()),
            }
            for fraction in COUNT_THRESHOLDS
        ],
        "trace": density.trace(),
        "exact_trace": exact.sum().item(),
        "time_s": elapsed,
    }


def run(args: argparse.Namespace) -> dict:
    """Run the hierarchy study.

    Args:
        args: Parsed command-line options.

    Returns:
        The content of ``results.json``.
    """
    setup = prepare(args, STUDY)
    data, loss_func = setup.data, setup.loss_func
    if data.train_targets.ndim != 1:
        raise StudyError(
            f"{NEEDS_CLASSIFIER}, but the targets have shape "
            f"{list(data.train_targets.shape)} (one label per position, e.g. a "
            "language model's next tokens): Papyan's classes are the samples' labels."
        )
    model, training, metrics = trained_model(setup)

    batch = BatchStream(len(data.train_targets), args.batch_size, setup.seed(2)).next()
    inputs, targets = data.train_batch(batch)
    layers = layer_groups(model)
    classes = data.num_classes
    gram_dtype = choose_gram_dtype(
        args.gram_dtype,
        setup.dtype,
        len(targets) * classes,
        len(layers) + 2,
        setup.device,
    )
    start = time.perf_counter()
    ggn = low_rank_ggn(
        model,
        loss_func,
        (inputs, targets),
        engine=args.engine,
        param_groups=[group for _, group in layers],
        gram_dtype=gram_dtype,
        progress=False if args.no_progress else None,
    )
    probabilities = "plain"
    if args.weighting == "probabilities":
        with eval_mode(model), torch.no_grad():
            probabilities = call_model(model, inputs).softmax(dim=1)
    with engine_errors("The hierarchy"):
        try:
            parts = hierarchy(ggn, targets, probabilities=probabilities)
        except InvalidArgumentError as error:
            raise StudyError(f"{NEEDS_CLASSIFIER}: {error}") from None
    hierarchy_time = time.perf_counter() - start
    density = density_results(parts, args, setup.seed(4))

    results = {
        "num_samples": len(targets),
        "num_classes": classes,
        "num_parameters": sum(p.numel() for _, g in layers for p in g),
        "gram_dtype": str(gram_dtype).removeprefix("torch."),
        "weighting": parts.weighting,
        "training": training,
        "metrics": metrics,
        "zero_tolerance": parts.zero_tolerance,
        "spectra": {
            name: descending(parts.part(name).eigenvalues) for name in ("full", *PARTS)
        },
        "traces": {
            name: parts.part(name).eigenvalues.sum().item() for name in ("full", *PARTS)
        },
        "overlaps": overlaps(parts, classes),
        "layers": {
            name: descending(spectrum)
            for (name, _), spectrum in zip(layers, parts.group_spectra, strict=True)
        },
        "density": density,
        "time_s": {"hierarchy": hierarchy_time, "density": density["time_s"]},
    }
    payload = setup.payload(results, {"hierarchy": hierarchy_time})
    write(
        setup.output,
        payload,
        {"hierarchy.png": hierarchy_figure(results)},
        summarize(results, args),
        checkpoints={"model.pt": model.state_dict()},
    )
    return payload


def summarize(results: dict, args: argparse.Namespace) -> list[str]:
    """The human summary of the hierarchy study.

    Args:
        results: The study's results.
        args: Parsed command-line options.

    Returns:
        Lines to print.
    """
    density, classes = results["density"], results["num_classes"]
    lines = [
        model_summary("Hierarchy", results, args),
        f"GGN of a mini-batch of {results['num_samples']}, C = {classes}: "
        f"{WEIGHTING_NAMES[results['weighting']]}:",
        f"{'part':<14} {'non-zero':>8} {'largest':>9} {'trace':>9} "
        f"{'in top C':>9} {'in top C²':>10}",
    ]
    for name in ("full", *PARTS):
        spectrum = results["spectra"][name]
        overlap = results["overlaps"].get(name)
        largest = number(spectrum[0] if spectrum else 0)
        lines.append(
            f"{name:<14} {len(spectrum):>8} {largest:>9} "
            f"{number(results['traces'][name]):>9} "
            + (
                f"{overlap['in_top_C']:>9.3f} {overlap['in_top_C2']:>10.3f}"
                if overlap
                else f"{'':>9} {'':>10}"
            )
        )
    lines.append(
        "Largest eigenvalue per layer: "
        + ", ".join(
            f"{name} {number(spectrum[0])}"
            for name, spectrum in results["layers"].items()
        )
    )
    lines.append(
        f"SLQ of the {density['dim']} x {density['dim']} Gram matrix "
        f"({density['lanczos_steps']} steps, {density['probes']} probes, "
        f"{number(density['time_s'])} s): Wasserstein-1 distance "
        f"{number(density['wasserstein_distance'])} (bound "
        f"{number(density['wasserstein_bound'])}, spectrum width "
        f"{number(density['spread'])}); trace {number(density['trace'])} (exact "
        f"{number(density['exact_trace'])}). Eigenvalues above a fraction of the "
        "largest, SLQ (exact): "
        + ", ".join(
            f"{entry['fraction']:.0e}: {entry['slq']:.1f} ({entry['exact']})"
            for entry in density["counts_above"]
        )
        + ".",
    )
    return lines


main = study_main(build_parser, run)
