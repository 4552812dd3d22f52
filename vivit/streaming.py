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
from vivit.engines.base import Engine, OutputSelector
from vivit.errors import InvalidArgumentError
from vivit.options import check_streaming, options_from
from vivit.results import CurvatureResults
from vivit.sources.streamed import StreamedFactors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class StreamingGGN(CurvatureResults):
    """Leading GGN eigenpairs of a data set, recomputing the factors per product.

    The GGN is that of the loss on all samples of the loader together, as for
    :class:`~vivit.LowRankGGN` over a loader, which stores every batch's layer
    factors; this class stores none. The construction makes one pass (loss,
    gradient, normalization); :meth:`eigh` then makes two per product with the
    Gram matrix and one for the eigenvectors (``docs/math.rst``, "Data sets and
    processes"), :meth:`directional_derivatives` one more for ``γ``,
    :meth:`newton` one for the step, every product of :meth:`operator` one or two.
    The leading eigenpairs are kept per group, solver, tolerance and seed.

    It answers :class:`~vivit.LowRankGGN`'s methods except what needs the whole
    Gram matrix, refused by name (:class:`~vivit.InvalidArgumentError`):
    :meth:`gram`, :meth:`eigvalsh`, :meth:`zero_tolerance` and ``top_k=None``.

    The loader must yield the same batches every time (``shuffle=False``, no
    random augmentation; checked batch by batch). Every pass starts from the
    random state at construction (Dropout in training mode draws the same masks
    in every pass). A pass after the model's parameters or buffers changed raises
    :class:`~vivit.ModelChangedError`.

    Example::

        loader = DataLoader(TensorDataset(X, y), batch_size=256)
        ggn = StreamingGGN(model, CrossEntropyLoss(), loader)
        evals, evecs = ggn.eigh(top_k=10)
        print(ggn.passes, "passes over the data")

    Options: every keyword argument after ``param_groups`` is an option of
    :class:`~vivit.options.CurvatureOptions`, described there (``route`` is
    not one here). What is specific here: every pass reads the same batches
    (``max_batches``), in the same chunks (``chunk_size``), with a progress bar
    (``progress``), and block ``b`` draws the same MC samples in every pass, the
    same as ``LowRankGGN`` over the loader with the same ``generator`` and
    ``chunk_size``; ``gram_dtype`` is the type of every product; ``solver`` is
    ``"auto"`` or ``"factor_krylov"``. Refused before the first pass
    (:class:`~vivit.InvalidArgumentError`): the solvers ``"dense"`` and
    ``"gram_krylov"``, ``route="implicit"`` (a route of ``LowRankGGN``), a
    ``subsampling`` (pass a loader over the samples you
    want) and a process group (``process_group`` defaults to ``False``: each
    process streams over its own loader).

    Args:
        data: A re-iterable loader of ``(inputs, targets)`` batches (a list, a
            ``DataLoader``), or one batch; not an iterator or generator. ``model``,
            ``loss_func`` and ``param_groups`` are :class:`~vivit.LowRankGGN`'s.

    Attributes:
        loss: The loss on all samples (detached).
        param_groups: The parameter groups.
        engine: Name of the engine.

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
        self._stream = StreamedFactors(model, loss_func, data, param_groups, options)
        super().__init__(self._stream, options)

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

        Args:
            vectors: ``U``, Gram-space vectors as columns, ``[N·C, K]`` (rows
                ordered batch by batch, each sample-major, as
                :meth:`vivit.LowRankGGN.gram`).
            group: Index of the parameter group.

        Returns:
            ``[N·C, K]``.

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
