"""The async lane: work that can wait is queued as a job and run on spare capacity."""
