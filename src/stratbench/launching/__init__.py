"""Starting a run: one process or torchrun, the job around it (locks, resume, memory check), the torchrun entry."""
