"""Tools around the server, never imported by it: load generator and traffic profiles,
reports and plots, the simulator and its clock, the profiler, and ``vega cluster``."""
