"""stratbench: train one PyTorch model under every common training method and compare them side by side."""

__version__ = "0.1.0"
