"""stratbench: train one PyTorch model under every common training method and compare them side by side.

From Python, ``from stratbench.api import TrainConfig, train, compare, estimate``: the commands of the same name,
returning their results instead of printing them.
"""

__version__ = "0.1.0"
