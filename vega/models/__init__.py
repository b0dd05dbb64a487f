"""Model adapters and the loader that turns a ``VEGA_MODEL`` value into one."""

from vega.models.base import ModelAdapter, SequenceModel, TensorSpec, runs_eagerly
from vega.models.loader import load_model

__all__ = ["ModelAdapter", "SequenceModel", "TensorSpec", "load_model", "runs_eagerly"]
