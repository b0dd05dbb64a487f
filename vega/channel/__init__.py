"""The Redis side channel's parts below ``vega.streams``: key layout, wire format, the
client factory, and the thief that runs peers' batches."""
