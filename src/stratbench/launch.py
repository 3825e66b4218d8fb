"""Starting several processes: stratbench re-runs itself under torchrun (``torch.distributed.run``).

The same ``stratbench train`` command also works when the user starts it under torchrun, the deepspeed
launcher or SLURM: then RANK/LOCAL_RANK/WORLD_SIZE are already set and this process is one worker. Under SLURM
two patterns work (docs/multinode.md): ``srun`` one task per device (each task is a worker, ranks from
SLURM_PROCID/SLURM_LOCALID), or ``srun`` one task per node with ``--nproc N`` (each task launches torchrun).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stratbench.config import TrainConfig, dump_yaml
from stratbench.dist import free_port


def needs_launch(cfg: TrainConfig) -> bool:
    """True when this is the user's command and several processes must be started for it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False  # a worker of torchrun / the deepspeed launcher
    if cfg.nproc > 1 or cfg.nnodes > 1:
        # Asking for processes per node means this is a per-node launcher, also inside an `srun` task
        # (whose SLURM_PROCID would otherwise make it look like one worker).
        return True
    return False


def torchrun_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.nproc}",
        f"--nnodes={cfg.nnodes}",
        f"--max-restarts={cfg.max_restarts}",
    ]
    if cfg.rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}", "--rdzv-id=stratbench"]
    elif cfg.max_restarts > 0 and cfg.nnodes == 1:
        # Elastic restarts re-rendezvous: the c10d backend does that reliably, the static one can hang.
        port = cfg.master_port or free_port()
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=stratbench"]
    else:
        port = cfg.master_port or (free_port() if cfg.nnodes == 1 else 29500)
        cmd += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}", f"--master-port={port}"]
    return [*cmd, "-m", "stratbench", "train", "--config", str(config_path)]


def launch(cfg: TrainConfig) -> int:
    """Write the resolved config, start torchrun on it, and return torchrun's exit code."""
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / f"launch_config.node{cfg.node_rank}.yaml"
    dump_yaml(cfg, config_path)
    if cfg.node_rank == 0:
        # A result.json left by an earlier run would be read as this run's failure reason if this one dies.
        (out / "result.json").unlink(missing_ok=True)
    cmd = torchrun_command(cfg, config_path)
    env = dict(os.environ)
    # One thread per process unless the user said otherwise (torchrun would set 1 and warn about it).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.run(cmd, env=env, check=False)
    return proc.returncode
