"""The fallback model (VEGA_FALLBACK_MODEL): a cheaper model that serves the degradable
classes of the main model's requests under pressure (docs/pressure.md).

``load_fallback`` loads it beside the main model and checks that it takes the same
inputs; ``Fallback.check_answers`` checks, once both are loaded, that it answers in the
same shape. At serving time ``Fallback.serves`` says which requests it may take,
``Fallback.order`` which of the two models is tried first, and ``first_admitted``
tries them in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from vega.admission import NeverFits
from vega.config import Settings
from vega.errors import REFUSALS, VegaError, invalid_input
from vega.models import ModelAdapter, load_model, min_length
from vega.models.loader import ModelLoadError
from vega.records import PRIORITY_BY_NAME

Model = TypeVar("Model")
Admitted = TypeVar("Admitted")


@dataclass(frozen=True)
class Fallback:
    """Which requests for the main model the fallback may take, and when it goes first."""

    spec: str  # VEGA_FALLBACK_MODEL, as its errors name it
    name: str  # the fallback's, as served
    main: str  # the model it stands in for
    degradable: frozenset[int]  # VEGA_DEGRADE_CLASSES
    watermark_items: float  # the main model's queue depth past which the fallback goes first

    def serves(self, model: str, priority: int) -> bool:
        """Whether the fallback may serve ``priority`` requests for ``model``."""
        return model == self.main and priority in self.degradable

    def order(self, main: Model, fallback: Model, main_depth: int) -> tuple[Model, Model]:
        """The two models in the order to try them: the fallback first once the main
        model's queue is past VEGA_DEGRADE_WATERMARK, else the main model."""
        return (fallback, main) if main_depth >= self.watermark_items else (main, fallback)

    def check_answers(self, adapters: Sequence[ModelAdapter]) -> None:
        """Raise unless the fallback answers as the main model does, once both are loaded
        (a module's output shapes are found then): a degraded caller gets the same shape."""
        main = next(a for a in adapters if a.name == self.main)
        fallback = next(a for a in adapters if a.name == self.name)
        _check_like(self.spec, main, fallback, "outputs")


def load_fallback(settings: Settings, main: ModelAdapter
                  ) -> tuple[Fallback, ModelAdapter] | None:
    """The fallback for ``main`` and its adapter, None without VEGA_FALLBACK_MODEL; raise
    ModelLoadError unless it is served under another name and takes ``main``'s inputs."""
    spec = settings.fallback_model
    if not spec:
        return None
    adapter = load_model(spec)
    if adapter.name == main.name:
        raise ModelLoadError(f"VEGA_FALLBACK_MODEL={spec!r}: served under the same name "
                             f"as the main model ({main.name!r})")
    _check_like(spec, main, adapter, "inputs")
    fallback = Fallback(spec, adapter.name, main.name,
                        frozenset(PRIORITY_BY_NAME[c] for c in settings.degrade_classes),
                        settings.degrade_watermark * settings.queue_capacity)
    return fallback, adapter


def first_admitted(order: Sequence[Model], admit: Callable[[Model], Admitted]
                   ) -> tuple[Model, Admitted]:
    """The first model of ``order`` that admits the request, and what ``admit`` returned.

    A refusal for load (or one no retry could fit) passes the request to the next
    model; the last model's refusal stands, and any other error is raised at once.
    """
    *tries, last = order
    for model in tries:
        try:
            return model, admit(model)
        except VegaError as error:
            if error.code not in REFUSALS and not isinstance(error, NeverFits):
                raise
    return last, admit(last)


def _check_like(spec: str, main: ModelAdapter, fallback: ModelAdapter, side: str) -> None:
    """Raise unless ``fallback`` takes (``side="inputs"``) or answers (``"outputs"``)
    the tensors ``main`` does, and on inputs, windows at least as long and as short."""
    ours, theirs = getattr(fallback, side), getattr(main, side)
    if [(t.datatype, t.shape) for t in ours] != [(t.datatype, t.shape) for t in theirs]:
        shapes = ", ".join(f"{a.name}: {list(t.shape)}" for a, specs in
                           ((main, theirs), (fallback, ours)) for t in specs)
        verb = "takes" if side == "inputs" else "answers"
        raise ModelLoadError(f"VEGA_FALLBACK_MODEL={spec!r}: {verb} different {side} "
                             f"from {main.name!r} ({shapes})")
    if side == "inputs" and fallback.max_length < main.max_length:  # else a valid one is 422
        raise ModelLoadError(f"VEGA_FALLBACK_MODEL={spec!r}: takes windows of at most "
                             f"{fallback.max_length} steps, {main.name!r} of "
                             f"{main.max_length}")
    if side == "inputs" and min_length(fallback) > min_length(main):
        raise ModelLoadError(f"VEGA_FALLBACK_MODEL={spec!r}: takes windows of at least "
                             f"{min_length(fallback)} steps, {main.name!r} of "
                             f"{min_length(main)}")


def check_lengths(main: ModelAdapter, decoded: Sequence[tuple[object, int]]) -> None:
    """Refuse (422) a window ``main`` would refuse, though the fallback took it: a degraded
    request gets the answer or the refusal of the model it asked for."""
    least = min_length(main)
    for index, (_, length) in enumerate(decoded):
        if not least <= length <= main.max_length:
            where = f"instance {index}: " if len(decoded) > 1 else ""
            raise invalid_input(f"{where}window length {length} outside "
                                f"{least}..{main.max_length}")
