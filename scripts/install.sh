#!/usr/bin/env bash
# Create .venv (if missing) and install stratbench into it.
# - No CUDA here: pin the local CPU build of torch (a bare "torch" requirement would pull a multi-GB CUDA
#   build) and the torchvision that matches it, in the same pip command as everything else.
# - CUDA here and a torch already installed in the interpreter: the venv sees it (--system-site-packages)
#   and pip keeps it, since pyproject's "torch>=2.6" is already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.stratbench-installed"

has_cuda_torch() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

if [ ! -x "$VENV/bin/python" ]; then
    if has_cuda_torch; then
        echo "install: CUDA torch found in $PY: creating $VENV with --system-site-packages to keep it"
        "$PY" -m venv --system-site-packages "$VENV"
    else
        "$PY" -m venv "$VENV"
    fi
fi
# libaio for DeepSpeed's nvme offload (apt-get as root, else one line how): checked on every run, before the
# stamp, since it lives outside the venv; silent and ~0.1 s when present, never fails the install.
bash scripts/install_libaio.sh || true
# SLURM's packages for --executor slurm's local cluster (scripts/local_slurm.sh: tests/compare/test_slurm.py), as
# root with apt-get only; silent when present or when it cannot (those tests are then skipped with the reason).
bash scripts/local_slurm.sh install || true
# Re-install only when pyproject.toml or this script changed since the last install.
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# --no-compile: no bytecode for the ~20k modules of torch, transformers, deepspeed, ray, ... at install; Python writes
# it into the venv on each module's first import, for the modules that are used.
if "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --no-compile -e ".[dev,mlflow,wandb,text,hf,ft,lora,lean,qlora,cluster]"
else
    "$VENV/bin/python" -m pip install -q --no-compile "torch==2.13.0" "torchvision==0.28.0" -e ".[dev,mlflow,wandb,text,hf,ft,lora,lean,qlora,cluster]"
fi
# DeepSpeed's async_io op (nvme offload) is not compiled here (minutes of 2 cores): the nvme tests build it in the
# background while the rest of the suite runs, a user's first nvme run builds it as DeepSpeed does, and
# `python scripts/async_io_build.py` builds it ahead (one line and no failure where libaio or a compiler is missing).
touch "$STAMP"
