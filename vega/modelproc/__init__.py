"""The model process: a child that owns the model, fed batches through shared memory.

An eager module's forward pass makes hundreds of Python-level calls, each of which
takes the GIL back from the event loop (DESIGN.md rule 12). In a child process it has
a GIL of its own. The parent's event loop packs a batch into a shared-memory slot and
sends a small header over a pipe; the answer turns the pipe readable, and the loop reads
it there, so no thread of the parent wakes for a batch.
"""

from vega.modelproc.handle import ModelProcess, ModelProcessError, ProcessPlan

__all__ = ["ModelProcess", "ModelProcessError", "ProcessPlan"]
