"""The model process: a child that owns the model, fed batches through shared memory.

An eager module's forward pass makes hundreds of Python-level calls, each of which
takes the GIL back from the event loop (DESIGN.md rule 12). In a child process it has
a GIL of its own. The parent's executor thread packs a batch into a shared-memory
slot, sends a small header over a pipe and sleeps on the answer; the loop is woken
once per batch, as with a thread.
"""

from vega.modelproc.handle import ModelProcess, ModelProcessError, ProcessPlan

__all__ = ["ModelProcess", "ModelProcessError", "ProcessPlan"]
