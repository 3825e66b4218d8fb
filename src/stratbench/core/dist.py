"""Process-group set-up from the launcher's environment (torchrun, SLURM, deepspeed), rank helpers, seeding."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from stratbench.core.config import TrainConfig
from stratbench.core.errors import ConfigError, UnsupportedError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank, rank on its node, number of processes, and its device."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    node: int = 0
    """The node (machine) this process runs on, 0..nodes-1: what the launcher says (``node_of_process``)."""
    nodes: int = 1
    """Nodes the run's processes spread over."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def launched_by_launcher() -> bool:
    """True when a launcher (torchrun, deepspeed, SLURM srun) started this process as one of several ranks."""
    return (
        "RANK" in os.environ
        and "WORLD_SIZE" in os.environ
        or "SLURM_PROCID" in os.environ
        and int(os.environ.get("SLURM_NTASKS", "1")) > 1
    )


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError("device 'cuda' asked for, but torch sees no CUDA device on this machine")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def node_of_process() -> tuple[int, int]:
    """(this process's node, the run's node count) from its launcher: torchrun's GROUP_RANK / GROUP_WORLD_SIZE
    (stratbench's launcher runs torchrun on every node, also under the Ray and SLURM executors, with its
    ``--node-rank``), SLURM's SLURM_NODEID / SLURM_NNODES (ranks started by ``srun`` itself), the deepspeed
    launcher's CROSS_RANK / CROSS_SIZE; (0, 1) where none is set. A host name would not do: the nodes of a
    loopback run (``--nnodes 2`` on one machine) share it."""
    for node, count in (("GROUP_RANK", "GROUP_WORLD_SIZE"), ("SLURM_NODEID", "SLURM_NNODES"),
                        ("CROSS_RANK", "CROSS_SIZE")):  # fmt: skip
        if node in os.environ:
            return int(os.environ[node]), int(os.environ.get(count, "1"))
    return 0, 1


def read_env(device_kind: str = "auto") -> DistEnv:
    """Read rank/world from torchrun (RANK, LOCAL_RANK, WORLD_SIZE) or SLURM (SLURM_PROCID, ...), and the node."""
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    node, nodes = node_of_process()
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world, device=resolve_device(device_kind, local_rank),
        node=node, nodes=nodes,
    )  # fmt: skip


def die_with_parent(sig: int | None = None) -> None:
    """Ask the kernel to send ``sig`` (default SIGTERM) to this process when its parent exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so that a killed launcher or torchrun agent never leaves workers training
    on under PID 1. Where prctl is missing (macOS, Windows) a daemon thread polls the parent pid instead."""
    import signal
    import sys
    import threading

    sig = signal.SIGTERM if sig is None else sig
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, int(sig), 0, 0, 0) == 0:  # 1 = PR_SET_PDEATHSIG
                if os.getppid() != parent:  # the parent died before prctl took effect
                    os.kill(os.getpid(), sig)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        import time

        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="stratbench-parent-watchdog", daemon=True).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(env: DistEnv, timeout_s: int = 300) -> None:
    """Initialise torch.distributed once (nccl on CUDA, gloo on CPU). A world of one gets a local store."""
    if dist.is_available() and dist.is_initialized():
        return
    # SLURM's variables mapped onto the env:// names torch reads.
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    if env.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError("MASTER_ADDR is not set: export MASTER_ADDR/MASTER_PORT (node 0) before srun")
    os.environ.setdefault("MASTER_PORT", "29500")  # torchrun's default; srun sets no port of its own
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    kwargs = {"device_id": env.device} if env.device.type == "cuda" else {}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After an elastic restart the agent's store still holds the dead group's gloo/nccl addresses;
        # a fresh key prefix per restart keeps the new group from connecting to them ("Connection refused").
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        kwargs["store"] = dist.PrefixStore(f"stratbench/restart{restart}", store)
    dist.init_process_group(
        backend=env.backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def destroy_process_group() -> None:
    """Barrier, then tear down: without it gloo runs abort at exit now and then."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """RNG states as tensors and plain lists, so that ``torch.load(weights_only=True)`` can read them back."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(_plain, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _plain(x):
    return x.item() if hasattr(x, "item") else x


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x):
    return tuple(_to_tuple(i) for i in x) if isinstance(x, list | tuple) else x


def needs_launch(cfg: TrainConfig) -> bool:
    """True when this is the user's command and several processes must be started for it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return False  # a worker of torchrun / the deepspeed launcher
    if cfg.nproc > 1 or cfg.nnodes > 1:
        # Asking for processes per node means this is a per-node launcher, also inside an `srun` task
        # (whose SLURM_PROCID would otherwise make it look like one worker).
        return True
    return False
