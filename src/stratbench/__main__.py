"""``python -m stratbench`` (used by torchrun and the deepspeed launcher)."""

from stratbench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
