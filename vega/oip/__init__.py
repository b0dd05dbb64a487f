"""The Open Inference Protocol (v2): routes, the binary tensor extension, statistics."""
