"""Figures of the studies (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from studies.errors import StudyError  # noqa: E402


def save(figure: Figure, path: Path) -> None:
    """Write a figure as PNG and release it.

    Args:
        figure: The figure.
        path: Target file.

    Raises:
        StudyError: If the file cannot be written.
    """
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as error:
        raise StudyError(f"Cannot write {path}: {error}") from None
    finally:
        plt.close(figure)


def _positive(values: list[float | None]) -> tuple[list[int], list[float]]:
    """Ranks (from 1) and values of the positive entries, for log axes."""
    kept = [(i + 1, v) for i, v in enumerate(values) if v is not None and v > 0]
    return [i for i, _ in kept], [v for _, v in kept]


def spectrum_figure(methods: dict[str, dict], top_k: int) -> Figure:
    """The spectrum with its approximations, their top-k and their cost.

    Args:
        methods: Method name to its results (``label``, ``eigenvalues`` descending,
            ``num_nonzero`` (eigenvalues above ``zero_tolerance``),
            ``top_eigenvalues`` descending, ``time_s`` with ``total``).
        top_k: Number of leading eigenvalues compared.

    Returns:
        The figure (three panels).
    """
    figure, (full, top, cost) = plt.subplots(
        1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [2, 1.4, 1]}
    )
    for name, method in methods.items():
        style = {"lw": 2.5, "color": "black"} if name == "exact" else {"lw": 1.2}
        nonzero = method["eigenvalues"][: method["num_nonzero"]]
        full.plot(*_positive(nonzero), label=method["label"], **style)
        top.plot(
            *_positive(method["top_eigenvalues"]),
            marker="o" if name == "exact" else ".",
            label=method["label"],
            **style,
        )
    full.axhline(
        methods["exact"]["zero_tolerance"],
        color="black",
        ls=":",
        lw=1,
        label="numerical zero (exact)",
    )
    full.set(
        xscale="log",
        yscale="log",
        xlabel="rank (descending)",
        ylabel="eigenvalue",
        title="GGN spectrum of the mini-batch (non-zero part)",
    )
    full.legend(fontsize="small")
    top.set(
        yscale="log",
        xlabel="rank",
        ylabel="eigenvalue",
        title=f"top-{top_k} eigenvalues",
    )
    labels = [method["label"] for method in methods.values()]
    times = [method["time_s"]["total"] for method in methods.values()]
    cost.barh(labels, times, color="tab:gray")
    cost.invert_yaxis()
    cost.set(xlabel="wall-clock time [s]", title="cost")
    figure.tight_layout()
    return figure


def _direction_panels(axes: object, checkpoints: list[dict], top_k: int) -> None:
    """Eigenvalues, SNR of γ and SNR of λ per direction over the steps.

    Args:
        axes: The 2x2 axes; the panels go to all but the lower right one.
        checkpoints: Per checkpoint: ``step``, ``eigenvalues``, ``gamma_snr``,
            ``lambda_snr`` (descending eigenvalue order; ``None`` left out).
        top_k: Number of directions.
    """
    steps = [c["step"] for c in checkpoints]
    cmap = plt.get_cmap("viridis")
    panels = (
        (axes[0, 0], "eigenvalues", "eigenvalue λ_k", "top GGN eigenvalues"),
        (axes[0, 1], "gamma_snr", "SNR of γ_nk", "gradient SNR per direction"),
        (axes[1, 0], "lambda_snr", "SNR of λ_nk", "curvature SNR per direction"),
    )
    for axis, key, ylabel, title in panels:
        for k in range(top_k):
            series = [
                (s, c[key][k])
                for s, c in zip(steps, checkpoints, strict=True)
                if k < len(c[key]) and c[key][k] is not None and c[key][k] > 0
            ]
            if series:
                axis.plot(
                    *zip(*series, strict=True),
                    marker=".",
                    color=cmap(k / max(1, top_k - 1)),
                    label=f"k={k + 1}" if k in (0, top_k - 1) else None,
                )
        axis.set(yscale="log", ylabel=ylabel, title=title)
        axis.legend(fontsize="small", title="rank")


def noise_figure(checkpoints: list[dict], top_k: int) -> Figure:
    """Top eigenvalues, SNRs per direction and the loss over training.

    Args:
        checkpoints: Per checkpoint: ``step``, ``eigenvalues``, ``gamma_snr``,
            ``lambda_snr`` (descending eigenvalue order), ``train_loss``,
            ``test_loss``.
        top_k: Number of directions.

    Returns:
        The figure (2x2 panels).
    """
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    steps = [c["step"] for c in checkpoints]
    _direction_panels(axes, checkpoints, top_k)
    loss = axes[1, 1]
    loss.plot(steps, [c["train_loss"] for c in checkpoints], label="train", marker=".")
    loss.plot(steps, [c["test_loss"] for c in checkpoints], label="test", marker=".")
    loss.set(yscale="log", ylabel="loss", title="loss")
    loss.legend(fontsize="small")
    for axis in axes[1]:
        axis.set_xlabel("SGD step")
    figure.tight_layout()
    return figure


def newton_figure(optimizers: dict[str, dict]) -> Figure:
    """Loss and accuracy of the optimizers over steps and wall-clock time.

    Args:
        optimizers: Optimizer name to its results (``batch_loss``, ``evaluations``
            with ``step``, ``time_s``, ``train_loss``, ``test_accuracy``).

    Returns:
        The figure (three panels).
    """
    figure, (by_step, by_time, acc) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, result in optimizers.items():
        losses = result["batch_loss"]
        (line,) = by_step.plot(range(len(losses)), losses, lw=0.8, alpha=0.8)
        evals = result["evaluations"]
        color = line.get_color()
        by_step.plot(
            [e["step"] for e in evals],
            [e["train_loss"] for e in evals],
            color=color,
            lw=2,
            label=name,
        )
        by_time.plot(
            [e["time_s"] for e in evals],
            [e["train_loss"] for e in evals],
            color=color,
            marker=".",
            label=name,
        )
        acc.plot(
            [e["step"] for e in evals],
            [e["test_accuracy"] for e in evals],
            color=color,
            marker=".",
            label=name,
        )
    by_step.set(
        yscale="log",
        xlabel="step",
        ylabel="loss",
        title="mini-batch loss (thin), training loss (thick)",
    )
    by_time.set(
        yscale="log",
        xlabel="wall-clock time of the steps [s]",
        ylabel="training loss",
        title="training loss against time",
    )
    acc.set(xlabel="step", ylabel="test accuracy", title="test accuracy")
    for axis in (by_step, by_time, acc):
        axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def monitor_figure(records: list[dict]) -> Figure:
    """A curvature monitor's records over training.

    Args:
        records: Records of :class:`vivit.analysis.CurvatureMonitor` (``step``,
            ``eigenvalues``, ``gamma_snr``, ``lambda_snr`` descending,
            ``gradient_share``, ``newton_angle_deg``).

    Returns:
        The figure (2x2 panels).
    """
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    _direction_panels(axes, records, max(len(r["eigenvalues"]) for r in records))
    steps = [r["step"] for r in records]
    lines = axes[1, 1]
    for key, scale, label in (
        ("gradient_share", 100, "gradient in the top-k span [%]"),
        ("newton_angle_deg", 1, "angle of the Newton step to −∇L [°]"),
    ):
        values = [math.nan if r[key] is None else scale * r[key] for r in records]
        lines.plot(steps, values, marker=".", label=label)
    lines.set(ylim=(0, 102), title="gradient and Newton step")
    lines.legend(fontsize="small")
    for axis in axes[1]:
        axis.set_xlabel("SGD step")
    figure.tight_layout()
    return figure


def approximations_figure(rows: list[dict]) -> Figure:
    """Eigenvalue errors, principal-angle cosines and step cosines per approximation.

    Args:
        rows: :meth:`vivit.analysis.ApproximationAudit.as_rows` (``label``,
            ``status``, ``relative_errors``, ``principal_cosines``,
            ``step_cosine``); rows without numbers are left out.

    Returns:
        The figure (three panels).
    """
    figure, (errors, angles, steps) = plt.subplots(
        1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.3, 1.3, 1]}
    )
    computed = [row for row in rows if row["status"] == "ok"]
    for row in computed:
        ranks = range(1, len(row["relative_errors"]) + 1)
        errors.plot(ranks, row["relative_errors"], marker=".", label=row["label"])
        angles.plot(ranks, row["principal_cosines"], marker=".", label=row["label"])
    errors.set(
        yscale="log",
        xlabel="rank i",
        ylabel="|λ̂_i − λ_i| / λ_i",
        title="top-k eigenvalues: relative errors",
    )
    angles.set(
        ylim=(-0.02, 1.02),
        xlabel="principal angle i",
        ylabel="cos θ_i",
        title="top-k eigenspace: principal-angle cosines",
    )
    labels = [row["label"] for row in computed]
    cosines = [row["step_cosine"] or 0.0 for row in computed]
    steps.barh(labels, cosines, color="tab:gray")
    steps.invert_yaxis()
    steps.set(
        xlim=(min(0.0, *cosines), 1), xlabel="cos(ŝ, s)", title="damped Newton step"
    )
    errors.legend(fontsize="small")
    figure.tight_layout()
    return figure


def _spectrum_axes(axes, title: str) -> None:
    """Log-log axes of eigenvalues against their descending rank."""
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="rank (descending)",
        ylabel="eigenvalue",
        title=title,
    )


def hierarchy_figure(results: dict) -> Figure:
    """The hierarchy's spectra, the layers' spectra, SLQ's counts against the exact.

    Args:
        results: The hierarchy study's results (``spectra``, ``layers``,
            ``zero_tolerance``, ``density`` with ``nodes``, ``weights``).

    Returns:
        The figure (three panels).
    """
    figure, (parts, layers, density) = plt.subplots(1, 3, figsize=(16, 4.2))
    labels = {
        "full": "full GGN",
        "class_means": "class means",
        "cross_class": "cross-class means",
        "within_class": "within-class",
    }
    for name, label in labels.items():
        style = {"lw": 2.5, "color": "black"} if name == "full" else {"lw": 1.3}
        parts.plot(*_positive(results["spectra"][name]), label=label, **style)
    _spectrum_axes(parts, "Papyan's hierarchy (non-zero spectra)")
    parts.legend(fontsize="small")
    tolerance = results["zero_tolerance"]
    for name, spectrum in results["layers"].items():
        nonzero = [v for v in spectrum if v > tolerance]
        layers.plot(*_positive(nonzero), lw=1.3, label=name)
    layers.plot(
        *_positive(results["spectra"]["full"]), lw=2.5, color="black", label="full GGN"
    )
    _spectrum_axes(layers, "Per-layer GGN blocks")
    layers.legend(fontsize="x-small")
    slq = results["density"]
    exact = sorted(v for v in results["spectra"]["full"] if v > 0)
    nodes = sorted(zip(slq["nodes"], slq["weights"], strict=True))
    grid = [exact[0] * (exact[-1] / exact[0]) ** (i / 400) for i in range(401)]
    above_exact = [sum(v > x for v in exact) for x in grid]
    above_slq = [sum(w for n, w in nodes if n > x) for x in grid]
    density.plot(grid, above_exact, lw=2.5, color="black", label="exact")
    density.plot(
        grid,
        above_slq,
        lw=1.5,
        color="tab:red",
        label=f"SLQ ({slq['lanczos_steps']} steps, {slq['probes']} probes)",
    )
    density.set(
        xscale="log",
        yscale="log",
        xlabel="x",
        ylabel="eigenvalues above x",
        title=f"Spectral density by SLQ: W1 = {slq['wasserstein_distance']:.2g} "
        f"(bound {slq['wasserstein_bound']:.2g})",
    )
    density.legend(fontsize="small")
    figure.tight_layout()
    return figure
