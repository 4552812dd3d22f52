"""Newton study: DampedNewton against SGD and Adam from one initialisation.

Trains copies of the same initial model on the same sequence of mini-batches with

- ``newton-constant``: :class:`vivit.optim.DampedNewton` with a constant damping,
- ``newton-bootstrap``: DampedNewton with :class:`vivit.optim.BootstrapDamping`
  (a damping per direction, chosen from the per-sample directional derivatives),
- ``sgd``: SGD with momentum, and ``adam``: Adam,

and reports the mini-batch loss and accuracy of every step, training and test loss
and accuracy at regular evaluations, and the wall-clock time of the steps.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
from backpack import extend
from torch import Tensor, nn
from torch.optim import Optimizer
from tqdm.auto import tqdm

from studies.cli import (
    base_parser,
    momentum,
    non_negative_float,
    positive_float,
    positive_int,
    study_main,
)
from studies.context import Setup, prepare
from studies.data import BatchStream
from studies.errors import StudyError
from studies.models import has_batchnorm, trainable_parameters
from studies.plots import newton_figure
from studies.report import number, write
from studies.training import (
    accuracy,
    evaluate_splits,
    gradient_step,
    refresh_batchnorm,
)
from vivit.model_inputs import ModelInputs, call_model
from vivit.optim import BootstrapDamping, ConstantDamping, DampedNewton

STUDY = "newton"
OPTIMIZERS = ("newton-constant", "newton-bootstrap", "sgd", "adam")


def top_k_or_all(text: str) -> int | None:
    """Parse ``--top-k``: a positive integer or ``all`` (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The number, or ``None`` for all numerically non-zero directions.
    """
    return None if text == "all" else positive_int(text)


def optimizer_list(text: str) -> list[str]:
    """Parse ``--optimizers``: a comma-separated subset of :data:`OPTIMIZERS`.

    Args:
        text: The command-line value.

    Returns:
        The names, in the given order.

    Raises:
        argparse.ArgumentTypeError: For an unknown name or an empty list.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in OPTIMIZERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(OPTIMIZERS)}; got {text!r}"
        )
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """The Newton study's command line.

    Returns:
        The parser.
    """
    parser = base_parser(STUDY, __doc__.split("\n\n", 1)[0])
    parser.set_defaults(batch_size=64)
    study = parser.add_argument_group("newton study")
    study.add_argument(
        "--steps", type=positive_int, default=80, help="Steps of every optimizer."
    )
    study.add_argument(
        "--eval-every",
        type=positive_int,
        default=10,
        help="Steps between evaluations on the full training and test sets.",
    )
    study.add_argument(
        "--optimizers",
        type=optimizer_list,
        default=",".join(OPTIMIZERS),
        help=f"Comma-separated optimizers to compare, from {', '.join(OPTIMIZERS)}.",
    )
    newton = parser.add_argument_group("DampedNewton")
    newton.add_argument(
        "--top-k",
        type=top_k_or_all,
        default="all",
        help="Leading GGN eigendirections of the Newton step, or 'all' for every "
        "numerically non-zero one.",
    )
    newton.add_argument(
        "--newton-lr",
        type=positive_float,
        default=1.0,
        help="Scale of the damped Newton step.",
    )
    newton.add_argument(
        "--damping",
        type=non_negative_float,
        default=1.0,
        help="Constant damping δ of newton-constant (mean-reduced loss scale).",
    )
    newton.add_argument(
        "--trust-fraction",
        type=positive_float,
        default=0.25,
        help="Largest loss decrease the quadratic model may predict per Newton "
        "step, as a fraction of the mini-batch loss (DampedNewton's default).",
    )
    newton.add_argument(
        "--bootstrap-grid",
        type=positive_float,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="Range of 13 log-spaced candidate dampings of newton-bootstrap "
        "(default: BootstrapDamping's own grid).",
    )
    newton.add_argument(
        "--bootstrap-resamples",
        type=positive_int,
        default=100,
        help="Bootstrap resamples of newton-bootstrap.",
    )
    first_order = parser.add_argument_group("first-order baselines")
    first_order.add_argument(
        "--sgd-lr", type=positive_float, default=0.1, help="SGD learning rate."
    )
    first_order.add_argument(
        "--momentum", type=momentum, default=0.9, help="SGD momentum in [0, 1)."
    )
    first_order.add_argument(
        "--adam-lr", type=positive_float, default=0.01, help="Adam learning rate."
    )
    return parser


def make_optimizer(name: str, model: nn.Module, setup: Setup) -> tuple[Optimizer, dict]:
    """Create an optimizer of the study and describe its hyperparameters.

    Args:
        name: One of :data:`OPTIMIZERS`.
        model: The model it trains.
        setup: The study's setup.

    Returns:
        The optimizer and its hyperparameters.

    Raises:
        StudyError: If a hyperparameter is invalid.
    """
    args = setup.args
    params = trainable_parameters(model)
    if name == "sgd":
        hyper = {"lr": args.sgd_lr, "momentum": args.momentum}
        return torch.optim.SGD(params, **hyper), hyper
    if name == "adam":
        hyper = {"lr": args.adam_lr}
        return torch.optim.Adam(params, **hyper), hyper
    hyper = {
        "lr": args.newton_lr,
        "top_k": args.top_k,
        "trust_fraction": args.trust_fraction,
    }
    try:
        if name == "newton-constant":
            damping = ConstantDamping(args.damping)
            hyper["damping"] = args.damping
        else:
            grid = None
            if args.bootstrap_grid is not None:
                low, high = sorted(args.bootstrap_grid)
                grid = torch.logspace(
                    math.log10(low), math.log10(high), 13, dtype=torch.float64
                )
            damping = BootstrapDamping(
                damping_grid=grid,
                num_resamples=args.bootstrap_resamples,
                generator=setup.generator(4),
            )
            hyper["damping_grid"] = damping.damping_grid.tolist()
            hyper["num_resamples"] = args.bootstrap_resamples
        with_data = (
            {}
            if args.engine == "backpack"
            else {
                "model": model,
                "loss_func": setup.loss_func,
                "engine": args.engine,
            }
        )
        optimizer = DampedNewton(
            params,
            lr=args.newton_lr,
            damping=damping,
            top_k=args.top_k,
            trust_fraction=args.trust_fraction,
            **with_data,
        )
    except ValueError as error:
        raise StudyError(f"{name}: {error}") from None
    return optimizer, hyper


def newton_step(
    model: nn.Module,
    optimizer: DampedNewton,
    loss_func: nn.Module,
    inputs: ModelInputs,
    targets: Tensor,
) -> tuple[float, float, dict]:
    """One DampedNewton step, with the model in evaluation mode.

    BatchNorm's running statistics are updated on the batch first (as in training
    mode), then the curvature uses them.

    Args:
        model: The extended model.
        optimizer: The DampedNewton optimizer.
        loss_func: The extended loss function.
        inputs: Mini-batch inputs.
        targets: Mini-batch labels.

    Returns:
        Mini-batch loss and accuracy before the step, and the number of
        directions and of skipped directions (infinite damping).
    """
    if has_batchnorm(model):
        refresh_batchnorm(model, inputs)
    model.eval()
    captured = {}

    def closure() -> Tensor:
        captured["logits"] = call_model(model, inputs)
        return loss_func(captured["logits"], targets)

    if optimizer.model is None:  # --engine backpack: the extended model's loss
        loss = optimizer.step(closure)
    else:  # the accuracy before the step
        with torch.no_grad():
            captured["logits"] = call_model(model, inputs)
        loss = optimizer.step(data=(inputs, targets))
    dampings = optimizer.last_steps[0].dampings
    info = {
        "directions": int(dampings.numel()),
        "skipped": int(torch.isinf(dampings).sum()),
    }
    return float(loss), accuracy(captured["logits"].detach(), targets), info


def train(name: str, setup: Setup, batches: list[Tensor]) -> dict:
    """Train a copy of the initial model with one optimizer.

    A diverging run (non-finite loss, failed eigendecomposition) stops early and
    says so under ``status``; the other optimizers still run.

    Args:
        name: One of :data:`OPTIMIZERS`.
        setup: The study's setup.
        batches: Mini-batch indices of every step.

    Returns:
        The optimizer's entry of ``results.json``.
    """
    args, data, loss_func = setup.args, setup.data, setup.loss_func
    model = copy.deepcopy(setup.model)
    is_newton = name.startswith("newton")
    if (
        is_newton
        and setup.args.engine == "backpack"
        and not any(getattr(m, "_backpack_extend", False) for m in model.modules())
    ):
        # DampedNewton runs on the caller's extended model; the converter makes
        # custom forwards (residual blocks) work, as LowRankGGN does internally
        model = extend(model, use_converter=True)
    optimizer, hyper = make_optimizer(name, model, setup)
    evaluations = [
        {"step": 0, "time_s": 0.0, **evaluate_splits(model, loss_func, data)}
    ]
    batch_loss, batch_accuracy, directions = [], [], []
    step_time, status = 0.0, "completed"
    for step, index in enumerate(tqdm(batches, desc=name, disable=args.no_progress)):
        inputs, targets = data.train_batch(index)
        start = time.perf_counter()
        try:
            if is_newton:
                loss, acc, info = newton_step(
                    model, optimizer, loss_func, inputs, targets
                )
                directions.append(info)
            else:
                loss, acc = gradient_step(model, optimizer, loss_func, inputs, targets)
        except torch.linalg.LinAlgError as error:
            status = f"stopped at step {step}: eigendecomposition failed ({error})"
            break
        step_time += time.perf_counter() - start
        if not math.isfinite(loss):
            status = f"diverged at step {step} (mini-batch loss {loss})"
            break
        batch_loss.append(loss)
        batch_accuracy.append(acc)
        if (step + 1) % args.eval_every == 0 or step + 1 == len(batches):
            evaluations.append(
                {
                    "step": step + 1,
                    "time_s": step_time,
                    **evaluate_splits(model, loss_func, data),
                }
            )
    steps_done = len(batch_loss)
    return {
        "hyperparameters": hyper,
        "status": status,
        "steps": steps_done,
        "batch_loss": batch_loss,
        "batch_accuracy": batch_accuracy,
        "evaluations": evaluations,
        "initial": evaluations[0],
        "final": evaluations[-1],
        "wall_time_s": step_time,
        "time_per_step_s": step_time / steps_done if steps_done else None,
        "directions": directions,
    }


def run(args: argparse.Namespace) -> dict:
    """Run the Newton study.

    Args:
        args: Parsed command-line options.

    Returns:
        The content of ``results.json``.

    Raises:
        StudyError: For input the study cannot work with.
    """
    setup = prepare(args, STUDY)
    num_train = len(setup.data.train_targets)
    batches = BatchStream(num_train, args.batch_size, setup.seed(1)).take(args.steps)
    optimizers = {name: train(name, setup, batches) for name in args.optimizers}
    results = {
        "batch_size": args.batch_size,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "optimizers": optimizers,
    }
    payload = setup.payload(
        results, {name: r["wall_time_s"] for name, r in optimizers.items()}
    )
    summary = summarize(results, args)
    write(setup.output, payload, {"loss.png": newton_figure(optimizers)}, summary)
    return payload


def summarize(results: dict, args: argparse.Namespace) -> list[str]:
    """The human summary of the Newton study.

    Args:
        results: The study's results.
        args: Parsed command-line options.

    Returns:
        Lines to print.
    """
    lines = [
        f"Newton study: model {args.model}, {args.steps} steps on the same "
        f"mini-batches of {args.batch_size}, same initialisation.",
        f"{'optimizer':<17} {'train loss':>17} {'train acc':>10} {'test acc':>9} "
        f"{'time [s]':>9} {'ms/step':>8}  status",
    ]
    for name, r in results["optimizers"].items():
        initial, final = r["initial"], r["final"]
        per_step = r["time_per_step_s"]
        lines.append(
            f"{name:<17} {number(initial['train_loss']):>7} -> "
            f"{number(final['train_loss']):<7} "
            f"{100 * final['train_accuracy']:>9.1f}% "
            f"{100 * final['test_accuracy']:>8.1f}% {number(r['wall_time_s']):>9} "
            f"{number(None if per_step is None else 1000 * per_step):>8}  "
            f"{r['status']}"
        )
    return lines


main = study_main(build_parser, run)
