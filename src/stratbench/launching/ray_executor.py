"""The Ray executor: each job gets a placement group (one bundle per node: CPUs = its processes per node, GPUs
when the job uses them; STRICT_SPREAD over distinct nodes for several nodes) and one ``ray_node.NodeRunner``
actor per bundle, which runs stratbench's own launcher there (``--nnodes N --node-rank i --master-addr <node 0's
IP> --master-port <a free port on node 0>``). Ray reserves and places; it schedules no training itself.

Outputs go where the job says (the sweep's folder): on a real cluster that folder must be on a filesystem every
node shares (docs/cluster.md). Ray is imported only here, when this executor is used.

A job's placement group and actors are named after its key (``Job.key``: its folder and cell) in the ``stratbench``
namespace. They belong to the driver that made them, so Ray ends them when that driver dies; but a driver killed
while connected through Ray Client (``ray://``) leaves them running for the client server's reconnect grace period
(30 s), and a rerun that comes sooner finds them by name and removes them before it runs their cells
(``launching.submissions``). A name can be held once, so the same cell can never run twice at once.

``--ray-address auto`` connects to ``$RAY_ADDRESS``, else to the cluster whose address ``ray start`` left in Ray's
temporary folder (``ray_current_cluster``), else to a cluster whose processes run here; an address that does not
answer within CONNECT_TIMEOUT_S is one line naming it and where it came from, and one found in the file (a head
that was killed leaves it behind) is passed over for a private local Ray, as when none is found.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stratbench.core.errors import ConfigError, UnsupportedError
from stratbench.launching.executor import Executor, Found, Handle, Job, Outcome, Shape
from stratbench.launching.ray_node import NodeRunner

STOP_TIMEOUT_S = 15.0
"""How long a cancelled job's node runners get to stop their processes before their actors are killed."""
RECHECK_S = 10.0
"""How often a job waiting for its placement group checks that the live nodes can still hold it."""
CONNECT_TIMEOUT_S = 5.0
"""How long a cluster's address gets to answer (a TCP connection, then a gRPC handshake) before it is called
unreachable: Ray's own client retries a dead address for minutes."""
NAMESPACE = "stratbench"
"""The Ray namespace of every job's named placement group and actors."""


def _ray():
    try:
        import ray
    except ImportError:  # UnsupportedError: exit code 3, "needs what this machine lacks"
        raise UnsupportedError(
            '--executor ray needs Ray: pip install "stratbench[cluster]" (or "ray[default]")'
        ) from None
    return ray


def _auth_hint() -> str:
    """What a refused connection may need: Ray 2.60 sends its token only where RAY_AUTH_MODE=token is set."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return " (RAY_AUTH_MODE=token is set: is the token in RAY_AUTH_TOKEN or ~/.ray/auth_token the cluster's?)"
    return (" (a cluster with token authentication also needs RAY_AUTH_MODE=token here, its token in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token)")  # fmt: skip


def _split(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT or ray://HOST:PORT; one line for anything else."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address!r} is not HOST:PORT, ray://HOST:PORT, 'auto' or 'local'")
    return host, int(port)


def _unanswered(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why nothing answers at ``address`` within ``timeout_s`` (no TCP connection, or no gRPC server behind it:
    the GCS and the Ray Client server both speak gRPC), or None when something does."""
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return str(exc.strerror or exc)
    try:
        import grpc
    except ImportError:  # Ray's client extra brings it; without it the TCP check has to do
        return None
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        return f"no gRPC answer within {timeout_s:g} s"
    finally:
        channel.close()
    return None


def _address_file() -> Path:
    """Where ``ray start`` writes the address of the cluster it started (Ray's ``ray_current_cluster``), which
    ``ray.init(address="auto")`` reads."""
    try:
        from ray._common.utils import get_ray_address_file

        return Path(get_ray_address_file(None))
    except ImportError:  # Ray moves its helpers between versions: its documented default place
        base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        return Path(base) / "ray" / "ray_current_cluster"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


CLIENT_ATTEMPTS = 3
"""Ray Client (``ray://``) sessions tried before giving up: a client server whose previous client died (a killed
sweep) opens the next session slowly and may refuse one while it cleans up; a cluster that answers its port is
asked again, 5 s apart, and said to be asked again."""
CLIENT_SESSION_TIMEOUT_S = 180.0
"""How long a Ray Client session may take to open before the sweep gives up in one line. Ray's client waits for
its server's answer without a bound (and, with RAY_CLIENT_RECONNECT_GRACE_PERIOD set high, retries a broken
stream silently for that long); a fresh head's first session takes ~40 s here, later ones 3-5 s."""


def _init(ray: Any, address: str, source: str, quiet: dict[str, Any]) -> Any:
    """``ray.init`` at a cluster whose port answers; a Ray Client address is tried ``CLIENT_ATTEMPTS`` times,
    each for at most ``CLIENT_SESSION_TIMEOUT_S``."""
    client = address.startswith("ray://")
    if client:  # a session may take a while to open (CLIENT_SESSION_TIMEOUT_S): not a silent wait
        _say(f"--executor ray: connecting to {address} ({source}, Ray Client)")
    attempts = CLIENT_ATTEMPTS if client else 1
    for attempt in range(1, attempts + 1):
        try:
            return _session(ray, address, quiet) if client else ray.init(address=address, **quiet)
        except ConnectionError:
            if attempt == attempts:
                raise ConfigError(
                    f"cannot connect to the Ray cluster at {address} ({source}){_auth_hint()}"
                ) from None
            _say(f"--executor ray: the Ray Client server at {address} refused a session; asking again in 5 s "
                 f"({attempt}/{attempts - 1})")  # fmt: skip
            time.sleep(5)
    return None


def _session(ray: Any, address: str, quiet: dict[str, Any]) -> Any:
    """``ray.init(address)`` through Ray Client in a daemon thread, given ``CLIENT_SESSION_TIMEOUT_S``: one line
    (not a silent wait) when the client server does not open the session. A session that timed out is not asked
    again in this process (the stuck one could still open under a second)."""
    import threading

    got: dict[str, Any] = {}

    def connect() -> None:
        try:
            got["info"] = ray.init(address=address, **quiet)
        except BaseException as exc:  # handed to the caller's thread
            got["error"] = exc

    thread = threading.Thread(target=connect, name="stratbench-ray-client", daemon=True)
    thread.start()
    thread.join(CLIENT_SESSION_TIMEOUT_S)
    if thread.is_alive():
        raise ConfigError(f"the Ray Client server at {address} opened no session within "
                          f"{CLIENT_SESSION_TIMEOUT_S:g} s (its head overloaded, or its client server stuck?); "
                          "run the command again, or connect to the cluster's GCS address from a node of it")  # fmt: skip
    if "error" in got:
        raise got["error"]
    return got["info"]


class RayExecutor(Executor):
    """Jobs on a Ray cluster: ``address`` 'auto' (RAY_ADDRESS, else a cluster started on this machine with
    `ray start`, else a local Ray started for the sweep and stopped after it), 'local', or HOST:PORT."""

    name = "ray"
    options = ("ray_address", "cancel_stale")
    durable = True

    def __init__(
        self, max_concurrent: int = 0, ray_address: str | None = None, cancel_stale: bool | None = None
    ) -> None:
        super().__init__(max_concurrent, cancel_stale)
        self.address = ray_address or "auto"
        self.connected_to = ""
        self.private = False
        """The cluster is a local Ray started for this run (stopped with it)."""

    def default_slots(self) -> int:
        return 1_000_000  # every cell submitted: the placement groups queue until the cluster has room

    def connect(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            return
        quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": NAMESPACE}
        if os.environ.get("PYTHONPATH"):  # a checkout run from source: the nodes import the same stratbench
            quiet["runtime_env"] = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
        address, source = self._address()
        info = None
        if address == "auto":  # nothing on record: a cluster whose processes run here, else a local one
            try:
                info = ray.init(address="auto", **quiet)
            except ConnectionError:
                pass
        elif address != "local":
            why = _unanswered(address)
            if why is None:
                info = _init(ray, address, source, quiet)
            elif source == "--ray-address" or source.startswith("$"):
                raise ConfigError(f"cannot reach the Ray cluster at {address} ({source}): {why} (start one with "
                                  "`ray start --head`, or leave --ray-address auto)")  # fmt: skip
            else:  # a head that was killed left its address behind: as when there is none
                _say(f"--executor ray: no Ray cluster answers at {address} (the address in {source}, left by a "
                     f"`ray start` whose head is gone?): {why}; starting a private local Ray for this run")  # fmt: skip
        if info is None:
            info = _start_local(quiet)
            self.private = True
        self.connected_to = getattr(info, "address_info", {}).get("gcs_address") or address

    def _address(self) -> tuple[str, str]:
        """The address to connect to and where it came from: --ray-address, $RAY_ADDRESS, or the file `ray start`
        leaves ('auto': none of them; 'local': a private Ray)."""
        if self.address != "auto":
            return self.address, "--ray-address"
        if os.environ.get("RAY_ADDRESS"):
            return os.environ["RAY_ADDRESS"], "$RAY_ADDRESS"
        path = _address_file()
        try:
            found = path.read_text().strip()
        except OSError:
            found = ""
        return (found, str(path)) if found else ("auto", "")

    def check(self, shapes: Iterable[Shape]) -> None:
        """Connect, then one line for the first shape that no set of live nodes can hold."""
        self.connect()
        for shape in sorted(set(shapes), key=lambda s: (s.nodes, s.procs_per_node, s.gpus_per_node)):
            unfit = self._unfit(shape)
            if unfit:
                self.close()  # a local Ray started for this run stops with it
                raise ConfigError(f"{unfit} (lower --nodes or --world-size, or add nodes)")

    def _unfit(self, shape: Shape) -> str | None:
        """Why no set of the cluster's live nodes can hold ``shape`` (None: some can)."""
        nodes = [n for n in _ray().nodes() if n.get("Alive")]
        fit = [n for n in nodes if n["Resources"].get("CPU", 0) >= shape.procs_per_node
               and n["Resources"].get("GPU", 0) >= shape.gpus_per_node]  # fmt: skip
        if len(fit) >= shape.nodes:
            return None
        have = ", ".join(_describe(n) for n in nodes) or "none"
        return f"a cell needs {shape}; the Ray cluster at {self.connected_to} has {len(nodes)} live node(s): {have}"

    def where(self) -> str:
        return f"Ray at {self.connected_to}" + (" (a private local Ray for this run)" if self.private else "")

    def submit(self, job: Job) -> Handle:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        shape = job.shape
        bundle = {
            "CPU": shape.procs_per_node,
            **({"GPU": shape.gpus_per_node} if shape.gpus_per_node else {}),
        }
        pg = placement_group([dict(bundle) for _ in range(shape.nodes)],
                             strategy="STRICT_SPREAD" if shape.nodes > 1 else "PACK", name=job.key)  # fmt: skip
        state = {"pg": pg, "actors": [], "addresses": [], "runs": None, "ips": [], "key": job.key}
        runner = ray.remote(NodeRunner)
        try:
            for i in range(shape.nodes):
                named = {"name": _actor_name(job.key, i), "namespace": NAMESPACE} if job.key else {}
                state["actors"].append(runner.options(
                    num_cpus=shape.procs_per_node, num_gpus=shape.gpus_per_node, max_concurrency=2, **named,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                ).remote())  # fmt: skip
        except ValueError as exc:  # its name is held: a job of the same cell is still on the cluster
            handle = Handle(job, state=state)
            self._release(handle)
            state["refused"] = (
                f"not started: {_why(exc)} (a job of the same cell is still on the Ray cluster)"
            )
            return handle
        state["addresses"] = [a.address.remote() for a in state["actors"]]
        return Handle(job, state=state)

    def poll(self, handle: Handle) -> Outcome | None:
        ray = _ray()
        st = handle.state
        if st.get("refused"):
            return Outcome(None, 0.0, reason=st["refused"])
        if st["runs"] is None:
            ready, _ = ray.wait(st["addresses"], num_returns=len(st["addresses"]), timeout=0)
            if len(ready) < len(st["addresses"]):
                return self._still_placeable(handle)  # waiting for its placement group: queued
            try:
                found = ray.get(st["addresses"])
            except ray.exceptions.RayError as exc:
                if "ModuleNotFoundError" in str(exc):  # not lost: it would fail again
                    self.cancel(handle)
                    return Outcome(None, 0.0, reason=f"stratbench cannot be imported on a Ray node: {_why(exc)}; "
                                   "install the same stratbench on every node (docs/cluster.md)")  # fmt: skip
                return self._lost(handle, None, exc)
            self._start(handle, found)
            return None
        ready, _ = ray.wait(st["runs"], num_returns=len(st["runs"]), timeout=0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                return self._lost(handle, st["runs"].index(ref), exc)
        if len(ready) < len(st["runs"]):
            return None
        results = ray.get(st["runs"])
        self._release(handle)
        first = results[0]
        code = first["returncode"] or next((r["returncode"] for r in results if r["returncode"]), 0)
        reason = next((r["reason"] for r in results if r["reason"]), "")
        return Outcome(code, time.monotonic() - (handle.started_at or handle.submitted_at), reason=reason,
                       loads=first["loads"], cpu_count=first["cpu_count"])  # fmt: skip

    def _still_placeable(self, handle: Handle) -> Outcome | None:
        """A queued job whose shape the cluster can no longer hold (nodes died since the check) would wait for
        ever: every few seconds it is checked, and such a job ends as lost (a rerun runs it)."""
        now = time.monotonic()
        if now - handle.state.get("checked", handle.submitted_at) < RECHECK_S:
            return None
        handle.state["checked"] = now
        unfit = self._unfit(handle.job.shape)
        if unfit is None:
            return None
        self.cancel(handle)
        return Outcome(
            None, 0.0, reason=f"not started: {unfit}; rerun the same command when it has", lost=True
        )

    def _start(self, handle: Handle, found: list[tuple[str, int, str]]) -> None:
        """Every node placed: start each node's launcher, node 0's IP and free port as the master's."""
        st, job = handle.state, handle.job
        master_ip, master_port, _ = found[0]
        st["ips"] = [ip for ip, _, _ in found]
        st["runs"] = [
            actor.run.remote(job.node_command(rank, master_ip, master_port, python), str(job.node_log(rank)),
                             dict(job.env), job.shape.procs_per_node, job.shape.procs_per_node)
            for rank, (actor, (_, _, python)) in enumerate(zip(st["actors"], found, strict=True))
        ]  # fmt: skip
        handle.started_at = time.monotonic()

    def _lost(self, handle: Handle, rank: int | None, exc: Exception) -> Outcome:
        """A node runner died (its node died, or Ray killed it): the job is stopped everywhere and lost."""
        where = f"node {rank} of this run" if rank is not None else "one of this run's nodes"
        if rank is not None and rank < len(handle.state["ips"]):
            where += f" ({handle.state['ips'][rank]})"
        self.cancel(handle)
        started = handle.started_at or handle.submitted_at
        return Outcome(None, time.monotonic() - started, reason=f"the Ray worker running {where} died: "
                       f"{_why(exc)}; rerun the same command to run it again", lost=True)  # fmt: skip

    def cancel(self, handle: Handle) -> None:
        self.cancel_all([handle])

    def cancel_all(self, handles: list[Handle]) -> None:
        """Each node runner of every job kills its command's tree, all at once; then the actors and the
        placement groups go."""
        ray = _ray()
        stops = []
        for actor in [a for h in handles for a in h.state["actors"]]:
            try:
                stops.append(actor.stop.remote())
            except ray.exceptions.RayError:
                pass
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
        for handle in handles:
            self._release(handle)

    def _release(self, handle: Handle) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for actor in handle.state["actors"]:
            try:
                ray.kill(actor)
            except (ray.exceptions.RayError, ValueError):
                pass
        try:
            remove_placement_group(handle.state["pg"])
        except (ray.exceptions.RayError, ValueError):
            pass

    # --------------------------------------------------------------------------------------------
    # an earlier run's jobs (launching.submissions)

    def ref(self, handle: Handle) -> dict[str, Any]:
        return {"placement_group": handle.state["key"]} if handle.state.get("key") else {}

    def find(self, prefix: str, open_entries: Mapping[str, Mapping[str, Any]]) -> list[Found]:
        """The placement groups and node-runner actors named after a key that starts with ``prefix``, one per
        key: what a killed driver's jobs leave while Ray still keeps them."""
        ray = _ray()
        from ray.util.placement_group import placement_group_table

        actors: dict[str, list[str]] = {}
        for name in ray.util.list_named_actors():
            if name.startswith(prefix) and "-node" in name:
                actors.setdefault(name.rpartition("-node")[0], []).append(name)
        groups = {pg.get("name") for pg in placement_group_table().values()
                  if str(pg.get("name", "")).startswith(prefix) and pg.get("state") != "REMOVED"}  # fmt: skip
        found = []
        for key in sorted(set(actors) | groups):
            held = sorted(actors.get(key, [])) + ([f"placement group {key}"] if key in groups else [])
            found.append(Found(key, {"placement_group": key}, "running", f"Ray {', '.join(held)}"))
        return found

    def remove(self, found: list[Found]) -> None:
        """Each found job's node runners kill their commands' trees, then the actors and the placement group go;
        returns once Ray no longer lists them (at most STOP_TIMEOUT_S after the actors were told to stop)."""
        ray = _ray()
        from ray.util.placement_group import (
            get_placement_group,
            placement_group_table,
            remove_placement_group,
        )

        keys = {f.key for f in found}
        names = [n for n in ray.util.list_named_actors() if n.rpartition("-node")[0] in keys]
        actors = []
        for name in names:
            try:
                actors.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:  # gone meanwhile
                pass
        stops = [a.stop.remote() for a in actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
        for actor in actors:
            try:
                ray.kill(actor)
            except (ray.exceptions.RayError, ValueError):
                pass
        for key in keys:
            try:
                remove_placement_group(get_placement_group(key))
            except (ray.exceptions.RayError, ValueError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            left = [n for n in ray.util.list_named_actors() if n.rpartition("-node")[0] in keys]
            left += [pg["name"] for pg in placement_group_table().values()
                     if pg.get("name") in keys and pg.get("state") != "REMOVED"]  # fmt: skip
            if not left:
                return
            time.sleep(0.2)

    def close(self) -> None:
        try:
            import ray
        except ImportError:
            return
        if ray.is_initialized():
            ray.shutdown()


def _actor_name(key: str, rank: int) -> str:
    """The name of node ``rank``'s runner of the job ``key``."""
    return f"{key}-node{rank}"


def _start_local(options: dict[str, Any]):
    """A Ray on this machine for this run. Its session folder holds Unix sockets, whose paths must stay under
    108 bytes: under a long $TMPDIR it moves to /tmp."""
    ray = _ray()
    temp = Path(tempfile.gettempdir()) / "ray"
    if len(str(temp)) > 40:
        temp = Path("/tmp") / f"ray-stratbench-{os.getuid()}"
    try:
        return ray.init(address="local", include_dashboard=False, _temp_dir=str(temp), **options)
    except (OSError, RuntimeError) as exc:
        ray.shutdown()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(f"could not start a local Ray for --executor ray: {first}") from None


def _describe(node: dict[str, Any]) -> str:
    res = node.get("Resources", {})
    gpus = f", {res['GPU']:g} GPU" if res.get("GPU") else ""
    return f"{node.get('NodeManagerAddress', '?')} ({res.get('CPU', 0):g} CPU{gpus})"


def _why(exc: Exception) -> str:
    """The line of a Ray error that says why the actor died (its node died: which and how)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    telling = [ln for ln in lines if any(w in ln.lower() for w in ("node", "died", "killed", "error:"))]
    return " ".join(telling[-2:] or lines[:1])[:400] or type(exc).__name__
