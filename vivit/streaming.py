"""Leading GGN eigenpairs of a data set whose layer factors do not fit into memory.

Each product with the Gram matrix recomputes the factors in two passes over the
loader (:mod:`vivit.sources.streamed`); the results are :mod:`vivit.results`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.distributed import local_view
from vivit.engines.base import Engine, OutputSelector
from vivit.errors import InvalidArgumentError
from vivit.options import check_streaming, options_from
from vivit.results import CurvatureResults
from vivit.sources.streamed import StreamedFactors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class StreamingGGN(CurvatureResults):
    """Leading GGN eigenpairs of a data set, recomputing the factors per product.

    The GGN of the loss on all samples of the loader, as :class:`~vivit.LowRankGGN`
    over the loader gives it, without storing any layer factors: each product with
    the Gram matrix makes two passes over the loader, the eigenvectors, ``γ`` and
    the step one each (``docs/math.rst``, "Data sets and processes"; :attr:`passes`
    counts them). The leading eigenpairs are kept per group, solver, tolerance and
    seed. What needs the whole Gram matrix is refused by name
    (:class:`~vivit.InvalidArgumentError`): :meth:`gram`, :meth:`eigvalsh`,
    :meth:`zero_tolerance` and ``top_k=None``.

    The loader must yield the same batches every time (checked batch by batch);
    every pass starts from the random state at construction (a shuffled loader's
    order repeats), and a pass after the model's parameters or buffers changed
    raises :class:`~vivit.ModelChangedError`.

    Example::

        ggn = StreamingGGN(model, CrossEntropyLoss(), DataLoader(dataset, 256))
        evals, evecs = ggn.eigh(top_k=10)

    Options: the keyword arguments after ``param_groups`` are those of
    :class:`~vivit.options.CurvatureOptions`. Every pass reads the same batches in
    the same chunks and draws the same MC samples (as ``LowRankGGN`` over the
    loader with the same ``generator`` and ``chunk_size``). Refused before the
    first pass: the solvers ``"dense"`` and ``"gram_krylov"``,
    ``route="implicit"``, a ``subsampling`` and a process group
    (``process_group`` defaults to ``False``).

    Args:
        data: A re-iterable loader of ``(inputs, targets)`` batches (a list, a
            ``DataLoader``), or one batch; not an iterator or generator. ``model``,
            ``loss_func`` and ``param_groups`` are :class:`~vivit.LowRankGGN`'s.

    Raises:
        VivitError: As :class:`~vivit.LowRankGGN` for malformed arguments or
            batches; :class:`~vivit.InvalidArgumentError` for an iterator and the
            options refused above.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: Iterable[tuple[Tensor, Tensor]],
        *,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        mc_samples: int = 0,
        mc_per: str = "token",
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        route: str = "auto",
        solver: str = "auto",
        solver_tol: float | None = None,
        solver_seed: int = 0,
        engine: str | Engine = "auto",
        progress: bool | None = None,
        process_group: ProcessGroup | bool | None = False,
        chunk_size: int | None = None,
        output: OutputSelector = None,
        max_batches: int | None = None,
    ):
        check_grad_mode("StreamingGGN")
        options = options_from(locals())
        check_streaming(options)
        module, placement = local_view(model)  # a collective for FSDP2
        self._stream = StreamedFactors(
            module, loss_func, data, placement.groups(param_groups), options
        )
        super().__init__(self._stream, options, placement)

    @property
    def passes(self) -> int:
        """Passes over the data made so far."""
        return self._stream.passes

    @property
    def num_rows(self) -> int:
        """Side length ``N·C`` (``N·M`` with MC) of the Gram matrix, all batches."""
        return self._stream.num_rows

    def gram_matmul(self, vectors: Tensor, group: int = 0) -> Tensor:
        """``G̃ U = Vᵀ (V U)`` of a group, by two passes over the data.

        ``vectors`` are ``[N·C, K]`` Gram-space columns (rows batch by batch, each
        sample-major, as :meth:`vivit.LowRankGGN.gram`); the result is too.

        Raises:
            InvalidArgumentError: If ``vectors`` is not a ``[N·C, K]`` tensor of
                the group's Gram-space type and device.
            GroupIndexError: If there is no such group.
        """
        source = self._stream.group(group)
        if (
            not isinstance(vectors, Tensor)
            or vectors.dim() != 2
            or vectors.shape[0] != self.num_rows
            or vectors.dtype != source.dtype
            or vectors.device != source.device
        ):
            got = (
                f"{tuple(vectors.shape)} {vectors.dtype} on {vectors.device}"
                if isinstance(vectors, Tensor)
                else type(vectors).__name__
            )
            raise InvalidArgumentError(
                f"vectors must be a [{self.num_rows}, K] tensor (N·C rows, one "
                f"column per vector) of {source.dtype} on {source.device}, got {got}."
            )
        return source.products.gram_matmul(vectors)
