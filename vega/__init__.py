"""Vega: an inference server for bursty traffic on fixed hardware."""

__version__ = "0.1.0"
