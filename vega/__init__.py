"""Vega: an inference server for bursty traffic on fixed hardware."""

__version__ = "0.1.0"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the server's and its children's
