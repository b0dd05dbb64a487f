"""Model adapters and the loader that turns a ``VEGA_MODEL`` value into one."""

from vega.models.base import (
    ModelAdapter,
    SequenceModel,
    TensorSpec,
    decode_all,
    holds_the_gil,
    min_length,
    release,
)
from vega.models.digest import adopt, identity
from vega.models.loader import load_model

__all__ = ["ModelAdapter", "SequenceModel", "TensorSpec", "adopt", "decode_all",
           "holds_the_gil", "identity", "load_model", "min_length", "release"]
