"""What a run measures: step and phase time, memory (allocator, RSS, CPU probe), FLOPs, GPU utilisation, traces, communication volume, the environment."""
