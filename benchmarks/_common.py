"""Helpers the benchmark scripts share: the host record, the spread of repeated measurements,
sizes, the transport without Ray, and ucx_perftest as a peer. Scripts import it as
``_common`` (they run from this folder or with it on ``sys.path``)."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def light_import(module: str):
    """Import a ``mooncake_ray`` submodule without the package's ``__init__`` (which imports
    Ray): for scripts that measure the transport or the spill tier alone."""
    if "mooncake_ray" not in sys.modules:
        pkg = types.ModuleType("mooncake_ray")
        pkg.__path__ = [str(ROOT / "mooncake_ray")]
        sys.modules["mooncake_ray"] = pkg
    import importlib

    return importlib.import_module(module)


def parse_size(s: str) -> int:
    """"4k", "1MiB", "2gb", "4096" -> bytes (the store's own parser)."""
    return light_import("mooncake_ray.config").parse_size(s)


def spread(values, keep: bool = False) -> dict | None:
    """Median, min, max and count of repeated measurements (NaN and None left out); with
    ``keep``, the values too. None if nothing was measured."""
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return None
    out = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
    if keep:
        out["runs"] = list(values)
    return out


ISA_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512_vnni", "avx512f")


def host_info() -> dict:
    """The host a benchmark ran on: CPU model, vCPUs, an ISA label ("AMX", "AVX-512+BF16",
    "AVX-512", "AVX2" or "other"), which of ``ISA_FLAGS`` it has, memory (GiB) and kernel.
    Where /proc is missing, what ``os`` and ``platform`` tell."""
    model, flags, mem_gib = None, set(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except (OSError, ValueError, IndexError):
        pass
    if {"amx_tile", "amx_bf16"} <= flags:
        isa = "AMX"
    elif "avx512f" in flags:
        isa = "AVX-512+BF16" if "avx512_bf16" in flags else "AVX-512"
    else:
        isa = "AVX2" if "avx2" in flags else "other"
    return {"cpu_model": model or platform.processor() or None, "vcpus": os.cpu_count(), "isa": isa,
            "flags": sorted(flags & set(ISA_FLAGS)), "mem_gib": mem_gib, "kernel": platform.release()}


def host_label(host: dict | None, model: bool = False) -> str:
    """A ``host_info`` record in short, for a plot title ("AVX-512+BF16, 2 vCPUs"); with
    ``model``, the CPU model too, for a printed summary."""
    if not host:
        return "host not recorded"
    parts = [host.get("isa"), f"{host.get('vcpus')} vCPUs"] + ([host.get("cpu_model")] if model else [])
    return ", ".join(str(p) for p in parts if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_perftest(tls: str, test: str, size: int, iters: int, extra: tuple = ()) -> dict:
    """One ucx_perftest run (server and client on 127.0.0.1, the wheel's UCX):
    ``{"lat_us", "gbps"}``. A run that times out or prints no result gives NaN for both,
    with its output on stderr, so a benchmark records the miss and goes on."""
    import libucx

    base = Path(libucx.__file__).parent
    exe = str(base / "bin" / "ucx_perftest")
    env = dict(os.environ, LD_LIBRARY_PATH=str(base / "lib"), UCX_TLS=tls, UCX_NET_DEVICES="lo")
    port = free_port()
    srv = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out, failed = "", {"lat_us": float("nan"), "gbps": float("nan")}
    try:
        for _ in range(100):  # the server accepts one connection: retry the client until it listens
            time.sleep(0.05)
            try:
                run = subprocess.run([exe, "-p", str(port), "127.0.0.1", "-t", test, "-s", str(size),
                                      "-n", str(iters), *extra], env=env, capture_output=True, text=True,
                                     timeout=60)
            except subprocess.TimeoutExpired:
                print(f"ucx_perftest {tls} {test} {size}: timed out", file=sys.stderr)
                return failed
            out = run.stdout + run.stderr
            if "Final:" in out or "Connection refused" not in out:
                break
    finally:
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    for line in out.splitlines():
        if line.startswith("Final:"):
            f = line.split()
            # iterations, lat p50, lat avg, lat overall (usec), bw avg, bw overall (MB/s = MiB/s), ...
            return {"lat_us": float(f[2]), "gbps": float(f[6]) * (1 << 20) / 1e9}
    print(f"ucx_perftest {tls} {test} {size} gave no result:\n{out[-2000:]}", file=sys.stderr)
    return failed


def versions(packages) -> dict:
    """Installed version of each distribution (None where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in packages:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def wait_for(pred, timeout_s: float = 120.0, interval_s: float = 0.01, what: str = "condition"):
    """``pred()``'s first truthy value, polled every ``interval_s``; TimeoutError after
    ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval_s)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_port(port: int, timeout_s: float = 30.0, proc=None, log=None) -> None:
    """Wait until something listens on 127.0.0.1:``port``; fail at once if ``proc`` (the
    process expected to listen) exits, quoting the end of its ``log``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log).read_text(errors="replace").splitlines()[-4:] if log else []
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: " + " | ".join(tail))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


def stop_processes(procs: list, wait_s: float = 15.0) -> None:
    """Stop the child processes a benchmark started (by pid, last started first): SIGTERM,
    then SIGKILL after ``wait_s``; empties ``procs``."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    procs.clear()


class Processes:
    """Child processes a benchmark starts, each logging to ``log_dir/<name>.log``; all
    stopped, by pid, on ``stop_all``."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.procs: list = []

    def start(self, name: str, argv: list[str]):
        """Start ``argv`` in a session of its own; returns ``(process, log path)``."""
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p, log

    def stop_all(self, wait_s: float = 15.0) -> None:
        stop_processes(self.procs, wait_s)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def role_pids(ns: str) -> dict[str, int]:
    """The process of each role of a store with one store node in namespace ``ns``: this
    client, the master, the store node."""
    import ray

    from mooncake_ray._private.naming import MASTER_NAME, store_actor_name

    master = ray.get_actor(MASTER_NAME, namespace=ns)
    node_id = ray.get(master.nodes.remote())[0]["node_id"]
    node = ray.get_actor(store_actor_name(node_id), namespace=ns)
    return {"client": os.getpid(), "master": ray.get(master.pid.remote()), "node": ray.get(node.pid.remote())}


def local_ray(object_store_bytes: int = 128 << 20) -> None:
    """A local Ray of the benchmark's own (never whatever cluster /tmp/ray names), quiet."""
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             object_store_memory=object_store_bytes)


def git_state() -> dict:
    """The commit measured, files of the store's code that differed from it, and where the
    store's package and native module were imported from (an editable install imports its
    own checkout's package whatever the working directory or PYTHONPATH: a copy of the tree
    measures the copy only where that says so)."""
    root = Path(__file__).resolve().parents[1]
    out: dict = {}
    try:
        import importlib.util

        for name in ("mooncake_ray", "mooncake_ray._native"):
            spec = importlib.util.find_spec(name)
            out[f"{name.split('.')[-1]}_from"] = spec.origin if spec else None
    except Exception as e:  # noqa: BLE001
        out["import_error"] = str(e)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mooncake_ray", "native"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.splitlines()
        return {"head": head, "uncommitted_store_files": [d[3:] for d in dirty], **out}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e), **out}


def store_cluster(n_store_nodes: int = 2):
    """A Ray cluster on this host (``ray.cluster_utils``): a head offering no store memory and
    ``n_store_nodes`` nodes with the store resource; this process is its driver."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(n_store_nodes):
        cluster.add_node(num_cpus=1, resources={"mooncake_store": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    return cluster


def put_from_buffer(s, keys: list[str], size: int, buf, **kw) -> tuple[list, float]:
    """Put ``size``-byte values for ``keys`` with ``batch_put_from``, cycling over views of
    ``buf`` (a registered buffer of at least ``min(64, 64 MiB / size)`` values), in calls of
    up to 64 MiB; ``kw`` goes to each call (``replicas=2``). Returns each key's view and the
    seconds it took. Raises RuntimeError naming the first failed put."""
    import time

    per = max(1, min(64, (64 << 20) // size))
    views = [buf[(i % per) * size:(i % per + 1) * size] for i in range(len(keys))]
    t0 = time.perf_counter()
    for i in range(0, len(keys), per):
        bad = [e for e in s.batch_put_from(keys[i:i + per], views[i:i + per], **kw) if e is not None]
        if bad:
            raise RuntimeError(f"put failed: {bad[0]!r}")
    return views, time.perf_counter() - t0


def belady_min_pct(turns, capacity_pages: int) -> float | None:
    """A bound on the share of counted prompt tokens any eviction policy lets a store of
    ``capacity_pages`` pages serve: Belady's MIN, knowing the whole schedule, keeps after
    each turn the pages whose next counted use comes soonest and counts every page present,
    not only a leading run. ``turns``: in order, ``(conversation, counted, pages, usable,
    prompt_tokens, page_tokens)``: a turn's prompt holds every page of the conversation's
    earlier prompts (so all of a conversation's pages are next used at its next counted
    turn); ``pages`` is what the conversation holds after it, ``usable`` how many kept pages
    its prompt can take."""
    turns = list(turns)
    later: dict = {}  # conversation -> its counted turns' positions, last first
    for i in range(len(turns) - 1, -1, -1):
        if turns[i][1]:
            later.setdefault(turns[i][0], []).append(i)
    never, held, num, den = len(turns), {}, 0, 0
    for i, (conv, counted, pages, usable, tokens, page_tokens) in enumerate(turns):
        if counted:
            num += min(held.get(conv, (0, 0))[0], usable) * page_tokens
            den += tokens
        nxt = later.get(conv, [])
        while nxt and nxt[-1] <= i:
            nxt.pop()
        held[conv] = (pages, nxt[-1] if nxt else never)
        over = sum(n for n, _ in held.values()) - capacity_pages
        for c in sorted(held, key=lambda c: -held[c][1]):  # the furthest next use goes first
            if over <= 0:
                break
            n, at = held[c]
            cut = min(n, over)
            held[c], over = (n - cut, at), over - cut
    return 100.0 * num / den if den else None
