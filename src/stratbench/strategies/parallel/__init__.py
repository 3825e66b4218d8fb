"""Parallelism building blocks that the method files compose (torchtitan's ``distributed/``): no method lives here."""
