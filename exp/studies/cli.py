"""The command-line interface every study shares: options, errors, entry point."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from studies.errors import StudyError

DEFAULT_MODEL = "cnn"

DATA_HELP = (
    "Data file instead of the default data (scikit-learn's bundled 8x8 handwritten "
    "digits, 1797 images, 10 classes): a '.pt' file saved with torch.save holding a "
    "dict {'inputs': float tensor [N, *shape], 'targets': int tensor [N]}, or a "
    "'.npz' file (numpy.savez) with arrays 'inputs' and 'targets'. Targets are class "
    "indices in [0, C), C the number of model outputs: one per sample [N], or one "
    "per position [N, *T] for a model with outputs [N, C, *T] (e.g. a char-LSTM on "
    "integer token inputs [N, T]). The built-in models adapt to the input shape "
    "(cnn needs [channels, height, width] with height, width >= 4; transformer "
    "needs sequences [T, features]; char-lstm integer tokens [T] and targets [N, T]). "
    "A file without 'inputs' holds the model's keyword inputs instead, every array "
    "but 'targets' passed as model(**inputs) (a Hugging Face model's 'input_ids', "
    "'attention_mask', 'pixel_values'); without 'targets' they are the next tokens "
    "of 'input_ids' (a causal language model; padding, attention_mask 0, ignored). "
    "Targets of -100 are ignored by the loss."
)

MODEL_HELP = (
    "The network: 'mlp' (2 hidden layers of 32 ReLU units), 'cnn' (2 convolutions "
    "with BatchNorm, ReLU, max-pooling and a linear classifier), 'transformer' (a "
    "pre-norm transformer encoder block with mean pooling, for sequences), "
    "'char-lstm' (Embedding, LSTM, per-position classifier, for token sequences) or "
    "'MODULE:FACTORY' with MODULE an importable module (from the current directory) "
    "or a path to a '.py' file and FACTORY a callable without arguments that returns "
    "a torch.nn.Module mapping inputs [N, *shape] to logits [N, C] (or [N, C, *T] "
    "for per-position targets), or a Hugging Face model with --output-field "
    "(built from a config, e.g. GPT2LMHeadModel(GPT2Config(...))). A custom "
    "forward (e.g. residual blocks) needs no backpack.extend: either engine handles "
    "it."
)

OUTPUT_FIELD_HELP = (
    "For a --model that returns a structured output (a Hugging Face ModelOutput, a "
    "dict): the field holding the logits, e.g. 'logits'. Its classes are on the last "
    "axis (Hugging Face's convention) and are moved to dim 1: logits [N, C] of a "
    "sequence or image classifier stay as they are, per-token logits [N, T, C] of a "
    "language model or token classifier become [N, C, T] for targets [N, T] (as "
    "vivit.huggingface.token_logits does)."
)

ENGINE_HELP = (
    "How vivit computes the curvature: 'backpack' (BackPACK's layers only), 'func' "
    "(any model whose samples are independent: transformers, LSTMs, shared weights, "
    "GroupNorm; no backpack.extend) or 'auto' (BackPACK when it supports the model, "
    "else func)."
)


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= {minimum}, got {value}"
        )
    return value


def positive_int(text: str) -> int:
    """Parse an integer ``>= 1`` (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The integer.
    """
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """Parse an integer ``>= 0`` (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The integer.
    """
    return _integer(text, 0)


def positive_float(text: str) -> float:
    """Parse a positive, finite float (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: If it is not a finite number ``> 0``.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """Parse a finite float ``>= 0`` (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: If it is not a finite number ``>= 0``.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def momentum(text: str) -> float:
    """Parse a momentum in ``[0, 1)`` (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: If it is not in ``[0, 1)``.
    """
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def fraction(text: str) -> float:
    """Parse a number in the open interval ``(0, 1)`` (argparse type).

    Args:
        text: The command-line value.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: If it is not in ``(0, 1)``.
    """
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text}")
    return value


def add_sgd_options(group: argparse._ArgumentGroup) -> None:
    """``--lr`` and ``--momentum`` of the studies' SGD training.

    Args:
        group: The study's argument group.
    """
    group.add_argument(
        "--lr", type=positive_float, default=0.1, help="SGD learning rate."
    )
    group.add_argument(
        "--momentum", type=momentum, default=0.9, help="SGD momentum in [0, 1)."
    )


def add_training_options(
    group: argparse._ArgumentGroup,
    help_steps: str = "SGD steps before the curvature is computed (ignored with "
    "--checkpoint; 0 studies the initialisation).",
) -> None:
    """``--train-steps``, ``--lr`` and ``--momentum``, read by ``train_or_load``.

    Args:
        group: The study's argument group.
        help_steps: The ``--help`` text of ``--train-steps``.
    """
    group.add_argument(
        "--train-steps", type=non_negative_int, default=100, help=help_steps
    )
    add_sgd_options(group)


def add_gram_dtype_option(group: argparse._ArgumentGroup) -> None:
    """``--gram-dtype``, read by ``studies.spectrum.choose_gram_dtype``.

    Args:
        group: The study's argument group.
    """
    group.add_argument(
        "--gram-dtype",
        choices=("auto", "model", "float64"),
        default="auto",
        help="Type the Gram matrices are accumulated and decomposed in: 'model' (the "
        "--dtype), 'float64', or 'auto' (float64 if the Gram matrices fit into "
        "memory in float64, else the model's). A float32 Gram matrix resolves no "
        "eigenvalue below about N*C*1.2e-7 times the largest.",
    )


def base_parser(study: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every study shares.

    Studies add their own options and override defaults with ``set_defaults``.

    Args:
        study: Name of the study (``spectrum``, ``noise``, ``newton``).
        description: What the study does, for ``--help``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog=f"python exp/{study}.py",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            "Output: a directory with results.json (configuration, library versions, "
            "seed, every reported number) and PNG figures; a summary is printed. "
            "See docs/studies.rst."
        ),
    )
    data = parser.add_argument_group("model and data")
    data.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    data.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="A state_dict (torch.save(model.state_dict(), FILE)) to load into the "
        "model before the study; it must match --model exactly.",
    )
    data.add_argument("--output-field", default=None, help=OUTPUT_FIELD_HELP)
    data.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    data.add_argument(
        "--engine",
        choices=("auto", "backpack", "func"),
        default="auto",
        help=ENGINE_HELP,
    )
    data.add_argument(
        "--test-fraction",
        type=fraction,
        default=0.2,
        help="Fraction of the data held out to measure test loss and accuracy.",
    )
    data.add_argument(
        "--batch-size",
        type=positive_int,
        default=128,
        help="Mini-batch size N (training batches and curvature mini-batch). The "
        "exact Gram matrix has N*C rows.",
    )

    run = parser.add_argument_group("run")
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of all randomness (initialisation, data split, batches, MC "
        "samples, bootstrap); equal seeds give equal results on the same machine.",
    )
    run.add_argument(
        "--device",
        default="cpu",
        help="'cpu', 'cuda' or 'cuda:INDEX'; 'cuda' fails with an explanation if no "
        "GPU is available.",
    )
    run.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="Floating-point type of the model, the data and the curvature.",
    )
    run.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        help="CPU threads of torch (0: torch's default, one per core). One thread is "
        "fastest for the small default models and avoids the large slow-downs of "
        "multi-threaded eigendecompositions on cores shared with other processes; "
        "raise it for large models.",
    )
    run.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"Output directory (default: runs/{study}-YYYYmmdd-HHMMSS). An existing "
        "directory is refused unless --overwrite is given.",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="Write into an existing output directory, replacing its files.",
    )
    run.add_argument(
        "--no-progress", action="store_true", help="Do not show progress bars."
    )
    return parser


def resolve_device(name: str) -> torch.device:
    """The device of ``--device``, or an explanation why it cannot be used.

    Args:
        name: ``cpu``, ``cuda`` or ``cuda:INDEX``.

    Returns:
        The device.

    Raises:
        StudyError: If the name is invalid or the GPU is not available.
    """
    try:
        device = torch.device(name)
    except RuntimeError:
        raise StudyError(
            f"--device {name!r} is not a device; use 'cpu', 'cuda' or 'cuda:INDEX'."
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise StudyError(
            f"--device {name!r} is not supported; use 'cpu', 'cuda' or 'cuda:INDEX'."
        )
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU-only build)"
        raise StudyError(
            f"--device {name} was requested, but no CUDA GPU is available "
            f"(torch.cuda.is_available() is False; CUDA version of this torch build: "
            f"{build}). Run with --device cpu, or install a CUDA build of torch on a "
            "machine with a GPU."
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise StudyError(
            f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible."
        )
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """The dtype of ``--dtype``.

    Args:
        name: ``float32`` or ``float64``.

    Returns:
        The torch dtype.
    """
    return {"float32": torch.float32, "float64": torch.float64}[name]


def run_study(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], Any],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse the arguments, run a study, turn input problems into clear errors.

    Args:
        parser: The study's argument parser.
        run: Runs the study from the parsed arguments; raises :class:`StudyError`
            for input it cannot work with.
        argv: Command-line arguments (``None``: ``sys.argv[1:]``).

    Returns:
        The exit status: ``0`` on success, ``2`` for a :class:`StudyError`, ``130``
        if interrupted.
    """
    args = parser.parse_args(argv)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings():
            # BackPACK's hooks on the first layer fire although its input needs no
            # gradient; harmless, and printed at every training step otherwise.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            run(args)
    except StudyError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)
    print(f"Finished in {time.perf_counter() - start:.1f} s.")
    return 0


def study_main(
    build_parser: Callable[[], argparse.ArgumentParser],
    run: Callable[[argparse.Namespace], Any],
) -> Callable[[Sequence[str] | None], int]:
    """A study's command-line entry point ``main(argv=None) -> exit status``.

    Args:
        build_parser: Builds the study's argument parser.
        run: Runs the study from the parsed arguments (as for :func:`run_study`).

    Returns:
        ``main``: parses ``argv`` (``None``: ``sys.argv[1:]``) and runs the study
        with :func:`run_study`, returning its exit status.
    """

    def main(argv: Sequence[str] | None = None) -> int:
        return run_study(build_parser(), run, argv)

    return main
