"""Starting several processes: stratbench re-runs itself under torchrun (``torch.distributed.run``).

The same ``stratbench train`` command also works when the user starts it under torchrun, the deepspeed
launcher or SLURM: then RANK/LOCAL_RANK/WORLD_SIZE are already set and this process is one worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stratbench.config import TrainConfig, dump_yaml
from stratbench.dist import free_port, launched_by_launcher


def needs_launch(cfg: TrainConfig) -> bool:
    """True when this is the user's command and several processes must be started for it."""
    return not launched_by_launcher() and (cfg.nproc > 1 or cfg.nnodes > 1)


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
    cmd = torchrun_command(cfg, config_path)
    env = dict(os.environ)
    # One thread per process unless the user said otherwise (torchrun would set 1 and warn about it).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.run(cmd, env=env, check=False)
    return proc.returncode
