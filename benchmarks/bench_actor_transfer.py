"""One 64 MiB torch CPU tensor, actor to actor: our transport as a Ray Direct Transport,
against Ray's object store and Ray's own RDT over gloo, side by side in one run.

Paths (producer on Ray node A, consumer on node B unless said otherwise; the nodes are
raylets of one ``ray.cluster_utils.Cluster`` on this machine, each with its own object
store, so "across nodes" means an object-manager transfer over loopback):

  mooncake          ``@ray.method(tensor_transport="mooncake")``: the consumer's engine
                    reads the producer's tensor (UCX get: cma on one host).
  mooncake_arena    the same, the producer's tensor allocated with ``ray_rdt.empty`` (in
                    transport shared memory): the consumer reads it with a memcpy.
  objstore_return   the producer returns the tensor (default transport), the consumer gets
                    the ref: across nodes, and on one node (``_same_node``).
  objstore_return_zerocopy  the same with Ray's opt-in RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1
                    (tensors travel as numpy buffers, read in place from plasma): the
                    object store's best case.
  objstore_put      the driver ``ray.put``s the tensor and passes the ref (timed: put +
                    call); the driver is on the head node, the consumer on node B.
  gloo              ``@ray.method(tensor_transport="gloo")`` after
                    ``ray.experimental.collective.create_collective_group`` (torch gloo,
                    GLOO_SOCKET_IFNAME=lo in the actors' runtime env).
  mooncake_tiny, objstore_tiny  a 1 KiB tensor through the mooncake / objstore_return
                    paths: Ray's fixed cost per transfer ("beyond_floor" in the JSON is a
                    path's median minus its floor: the data movement alone).

One transfer = ``ray.get(consumer.consume.remote(producer.produce.remote()))`` timed from
the driver; the consumer reads one byte of every 4 KiB page (so a tensor mapped in place
pays its page faults) and returns the byte count. Ray's task round trips are included for
every path alike (``mooncake_tiny`` shows how much they are). Each path: 2 warm-up transfers then --transfers timed ones,
per run; --runs runs, the paths interleaved in every run so they see the same noise.
Every path is checked byte-exact (sha256) once before timing. For the mooncake paths the
consumer also reports the read alone (``fetch`` to completion) as ``transport_only``.

Finally (--gloo-plain-receiver) it shows why a first try of gloo here timed out: a
consumer created without ``enable_tensor_transport=True`` deadlocks the transfer until
Ray's RDT timeout (shortened to 15 s for this part).

    make bench B=benchmarks/bench_actor_transfer.py [ARGS="--runs 3 --transfers 8"]

Writes benchmarks/results/bench_actor_transfer.{json,png}. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import host_info, host_label, spread

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20
RDT_TIMEOUT_MS = 20000  # Ray's RDT fetch timeout for this run (default 60 s)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_rdt_fetch_fail_timeout_milliseconds", str(RDT_TIMEOUT_MS))

import ray  # noqa: E402
import torch  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from mooncake_ray.integrations import ray_rdt  # noqa: E402

ray_rdt.register()  # before the classes: the decorator checks the transport's name

ENV = {"env_vars": {"GLOO_SOCKET_IFNAME": "lo",
                    "RAY_rdt_fetch_fail_timeout_milliseconds": str(RDT_TIMEOUT_MS)}}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _fill(t: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    return t


class _Producer:
    def __init__(self, nbytes: int, arena: bool = False):
        buf = ray_rdt.empty((nbytes,), torch.uint8) if arena else torch.empty(nbytes, dtype=torch.uint8)
        self.t = _fill(buf)
        self.tiny = torch.arange(1024, dtype=torch.uint8)

    def expected(self) -> str:
        return sha(self.t)

    def ready(self) -> bool:
        return True


@ray.remote(num_cpus=0, runtime_env=ENV)
class MooncakeProducer(_Producer):
    @ray.method(tensor_transport="mooncake")
    def produce(self):
        return self.t

    @ray.method(tensor_transport="mooncake")
    def produce_tiny(self):
        return self.tiny


@ray.remote(num_cpus=0, runtime_env=ENV)
class GlooProducer(_Producer):
    @ray.method(tensor_transport="gloo")
    def produce(self):
        return self.t


class _PlainProducer(_Producer):
    def produce(self):
        return self.t

    def produce_tiny(self):
        return self.tiny


PlainProducer = ray.remote(num_cpus=0, runtime_env=ENV)(_PlainProducer)


# Ray's opt-in zero-copy path for torch tensors in the object store (RAY_ENABLE_ZERO_COPY_
# TORCH_TENSORS): tensors travel as numpy buffers and are read in place from plasma.
ZC_ENV = {"env_vars": {**ENV["env_vars"], "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
ZeroCopyProducer = ray.remote(num_cpus=0, runtime_env=ZC_ENV)(_PlainProducer)


class _Consumer:
    def consume(self, t) -> int:
        # One byte of every page: a tensor mapped in place (the zero-copy object store path)
        # pays its page faults here, as any real consumer would; the rest is identical.
        flat = t.reshape(-1).view(torch.uint8)
        int(flat[::4096].sum())
        return flat.numel()

    def checksum(self, t) -> str:
        return sha(t)

    def ready(self) -> bool:
        return True

    def rdt_stats(self) -> dict:
        return ray_rdt.engine_stats()


# Receivers of RDT objects need enable_tensor_transport=True (see ray_rdt's docstring).
RdtConsumer = ray.remote(num_cpus=0, runtime_env=ENV, enable_tensor_transport=True)(_Consumer)
PlainConsumer = ray.remote(num_cpus=0, runtime_env=ENV)(_Consumer)
ZeroCopyConsumer = ray.remote(num_cpus=0, runtime_env=ZC_ENV)(_Consumer)


def on(cls, node_id, *args):
    return cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)


def gbps(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / s / 1e9 for s in seconds]


class Path_:
    """A producer/consumer pair and how one transfer between them is made."""

    def __init__(self, name: str, nbytes: int, producer, consumer, kind: str = "call"):
        self.name, self.nbytes, self.p, self.c, self.kind = name, nbytes, producer, consumer, kind
        self.tensor = None  # objstore_put: the driver's copy
        self.runs: list[list[float]] = []
        self.transport_only: list[float] = []
        self.error: str | None = None

    def once(self) -> float:
        t0 = time.perf_counter()
        if self.kind == "put":
            ref = ray.put(self.tensor)
            n = ray.get(self.c.consume.remote(ref), timeout=120)
            del ref
        elif self.kind == "tiny":
            n = ray.get(self.c.consume.remote(self.p.produce_tiny.remote()), timeout=120)
        else:
            n = ray.get(self.c.consume.remote(self.p.produce.remote()), timeout=120)
        dt = time.perf_counter() - t0
        assert n == self.nbytes, (self.name, n)
        return dt

    def check(self) -> None:
        if self.kind == "tiny":
            return
        want = ray.get(self.p.expected.remote())
        ref = ray.put(self.tensor) if self.kind == "put" else self.p.produce.remote()
        got = ray.get(self.c.checksum.remote(ref), timeout=120)
        if got != want:
            raise AssertionError(f"{self.name}: bytes differ")

    def run(self, n: int) -> None:
        rdt = self.name.startswith("mooncake") and self.kind != "tiny"
        before = ray.get(self.c.rdt_stats.remote()) if rdt else {}
        for _ in range(2):
            self.once()
        mid = ray.get(self.c.rdt_stats.remote()) if rdt else {}
        self.runs.append([self.once() for _ in range(n)])
        if rdt:
            after = ray.get(self.c.rdt_stats.remote())
            b = after["rdt_read_bytes"] - mid.get("rdt_read_bytes", 0)
            s = after["rdt_read_seconds"] - mid.get("rdt_read_seconds", 0.0)
            if s > 0:
                self.transport_only.append(b / s / 1e9)
        del before

    def result(self) -> dict:
        out: dict = {"nbytes": self.nbytes}
        if self.error:
            out["error"] = self.error
        if not self.runs:
            return out
        flat = [x for r in self.runs for x in r]
        out["transfer_ms"] = {k: v * 1e3 for k, v in spread(flat).items()}
        out["gb_per_s"] = spread(gbps(self.nbytes, flat))
        out["run_median_gb_per_s"] = [statistics.median(gbps(self.nbytes, r)) for r in self.runs]
        out["samples_s"] = self.runs
        if self.transport_only:
            out["transport_only_gb_per_s"] = {**spread(self.transport_only), "runs": self.transport_only}
        return out


def setup_gloo(a, b, nbytes: int) -> Path_:
    from ray.experimental.collective import create_collective_group

    p, c = on(GlooProducer, a, nbytes), on(RdtConsumer, b)
    ray.get([p.ready.remote(), c.ready.remote()])
    t0 = time.perf_counter()
    create_collective_group([p, c], backend="torch_gloo", name="bench-gloo")
    print(f"gloo group created in {time.perf_counter() - t0:.2f}s", flush=True)
    return Path_("gloo", nbytes, p, c)


def gloo_plain_receiver(a, b, attempts: int = 4) -> dict:
    """A gloo transfer to a consumer without enable_tensor_transport=True."""
    from ray.experimental.collective import create_collective_group

    p, c = on(GlooProducer, a, 4 * MiB), on(PlainConsumer, b)
    ray.get([p.ready.remote(), c.ready.remote()])
    create_collective_group([p, c], backend="torch_gloo", name="bench-gloo-plain")
    log = []
    for i in range(attempts):
        t0 = time.perf_counter()
        try:
            ray.get(c.consume.remote(p.produce.remote()), timeout=RDT_TIMEOUT_MS / 1e3 + 30)
            log.append({"attempt": i, "ok": True, "seconds": time.perf_counter() - t0})
        except Exception as e:  # noqa: BLE001 - the point is to record it
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1][:300]
            log.append({"attempt": i, "ok": False, "seconds": time.perf_counter() - t0,
                        "error": f"{type(e).__name__}: {last}"})
            break
    for h in (p, c):
        try:
            ray.kill(h)
        except Exception:  # noqa: BLE001 - Ray may already have killed it
            pass
    return {"rdt_timeout_s": RDT_TIMEOUT_MS / 1e3, "attempts": log}


def start_cluster(attempts: int = 3):
    """A head (the driver's node) and two worker nodes. Retried: on a loaded machine a
    raylet may miss Ray's fixed 30 s startup deadline."""
    from ray.cluster_utils import Cluster

    for i in range(attempts):
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(num_cpus=1, include_dashboard=False)
            nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
            cluster.wait_for_nodes()
            return cluster, nodes
        except Exception as e:  # noqa: BLE001
            print(f"cluster start failed ({e}); retrying", flush=True)
            cluster.shutdown()
            if i == attempts - 1:
                raise
    raise AssertionError("unreachable")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--transfers", type=int, default=8)
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--gloo-plain-receiver", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(RESULTS / "bench_actor_transfer.json"))
    args = ap.parse_args()
    nbytes = args.mib * MiB

    t0 = time.perf_counter()
    cluster, nodes = start_cluster()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    a, b = nodes[0].node_id, nodes[1].node_id
    print(f"cluster up in {time.perf_counter() - t0:.1f}s", flush=True)
    load0 = os.getloadavg()

    paths = [
        Path_("mooncake", nbytes, on(MooncakeProducer, a, nbytes), on(RdtConsumer, b)),
        Path_("mooncake_arena", nbytes, on(MooncakeProducer, a, nbytes, True), on(RdtConsumer, b)),
        Path_("objstore_return", nbytes, on(PlainProducer, a, nbytes), on(PlainConsumer, b)),
        Path_("objstore_return_same_node", nbytes, on(PlainProducer, a, nbytes), on(PlainConsumer, a)),
        Path_("objstore_return_zerocopy", nbytes, on(ZeroCopyProducer, a, nbytes), on(ZeroCopyConsumer, b)),
        Path_("objstore_return_zerocopy_same_node", nbytes, on(ZeroCopyProducer, a, nbytes),
              on(ZeroCopyConsumer, a)),
        Path_("objstore_put", nbytes, None, on(PlainConsumer, b), kind="put"),
    ]
    paths[-1].tensor = _fill(torch.empty(nbytes, dtype=torch.uint8))
    paths[-1].p = paths[2].p  # only for .expected(): same bytes
    tiny = [Path_("mooncake_tiny", 1024, paths[0].p, paths[0].c, kind="tiny"),
            Path_("objstore_tiny", 1024, paths[2].p, paths[2].c, kind="tiny")]
    ray.get([x.c.ready.remote() for x in paths] + [x.p.ready.remote() for x in paths])
    gloo_error = None
    if not args.no_gloo:
        try:
            paths.append(setup_gloo(a, b, nbytes))
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            gloo_error = f"{type(e).__name__}: {e}"
            print("gloo unavailable:", gloo_error, flush=True)
    paths += tiny

    for p in list(paths):
        try:
            p.check()
        except Exception as e:  # noqa: BLE001
            p.error = f"check failed: {type(e).__name__}: {e}"
            print(p.name, p.error, flush=True)
    for r in range(args.runs):
        for p in paths:
            if p.error:
                continue
            try:
                p.run(args.transfers)
            except Exception as e:  # noqa: BLE001
                p.error = f"run {r}: {type(e).__name__}: {str(e)[:500]}"
                print(p.name, p.error, flush=True)
                continue
            med = statistics.median(p.runs[-1])
            print(f"run {r} {p.name:26s} {med * 1e3:8.2f} ms  {p.nbytes / med / 1e9:6.2f} GB/s", flush=True)

    results = {p.name: p.result() for p in paths}
    if gloo_error:
        results["gloo"] = {"error": gloo_error}
    stats = ray.get(paths[0].c.rdt_stats.remote())
    ratios = {}
    for base in ("objstore_return", "objstore_return_same_node", "objstore_return_zerocopy",
                 "objstore_return_zerocopy_same_node", "objstore_put"):
        for ours in ("mooncake", "mooncake_arena"):
            rs = [x / y for x, y in zip(results[ours].get("run_median_gb_per_s", []),
                                        results[base].get("run_median_gb_per_s", []))]
            if rs:
                ratios[f"{ours}/{base}"] = spread(rs)
    # Data movement alone: the median minus the same path's 1 KiB floor (Ray's round trips).
    for name, r in results.items():
        floor = results.get("mooncake_tiny" if name.startswith("mooncake") else
                            "objstore_tiny" if name.startswith("objstore") else "", {})
        if "transfer_ms" in r and "transfer_ms" in floor and r["nbytes"] == nbytes:
            data_ms = r["transfer_ms"]["median"] - floor["transfer_ms"]["median"]
            r["beyond_floor"] = {"ms": data_ms, "gb_per_s": nbytes / data_ms / 1e6 if data_ms > 0 else None}
    if "run_median_gb_per_s" in results.get("gloo", {}):
        rs = [x / y for x, y in zip(results["mooncake"]["run_median_gb_per_s"],
                                    results["gloo"]["run_median_gb_per_s"])]
        ratios["mooncake/gloo"] = spread(rs)
    plain = None
    if args.gloo_plain_receiver and not args.no_gloo:
        try:
            plain = gloo_plain_receiver(a, b)
        except Exception as e:  # noqa: BLE001
            plain = {"error": f"{type(e).__name__}: {e}"}
        print("gloo, consumer without enable_tensor_transport:", json.dumps(plain), flush=True)

    out = {
        "host": host_info(),
        "tensor_bytes": nbytes,
        "runs": args.runs,
        "transfers_per_run": args.transfers,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform(),
                    "ray": ray.__version__, "torch": torch.__version__,
                    "loadavg_start": load0, "loadavg_end": os.getloadavg()},
        "placement": {"head(driver)": head, "A(producers)": a, "B(consumers)": b},
        "paths": results,
        "ratios_of_run_medians": ratios,
        "target": "mooncake / objstore >= 3x",
        "consumer_engine_counters_mooncake": {k: v for k, v in stats.items() if k != "config"},
        "gloo_plain_receiver": plain,
    }
    ray.shutdown()
    cluster.shutdown()
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    plot(out, dest.with_suffix(".png"))
    print("host:", host_label(out["host"], model=True))
    print(json.dumps({k: v.get("gb_per_s", v.get("error")) for k, v in results.items()}, indent=2))
    print(json.dumps(ratios, indent=2))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in out["paths"].items() if "gb_per_s" in r and r["nbytes"] == out["tensor_bytes"]]
    med = [out["paths"][n]["gb_per_s"]["median"] for n in names]
    lo = [m - out["paths"][n]["gb_per_s"]["min"] for n, m in zip(names, med)]
    hi = [out["paths"][n]["gb_per_s"]["max"] - m for n, m in zip(names, med)]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    colors = ["tab:blue" if n.startswith("mooncake") else "tab:orange" if n == "gloo" else "tab:gray"
              for n in names]
    labels = [n.replace("objstore_", "objstore\n").replace("_same_node", "\nsame node")
              .replace("mooncake_", "mooncake\n") for n in names]
    ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=colors)
    for i, n in enumerate(names):
        ax.plot([i] * len(out["paths"][n]["run_median_gb_per_s"]), out["paths"][n]["run_median_gb_per_s"],
                "k.", ms=5)
        ax.text(i + 0.08, med[i], f"{med[i]:.2f}", ha="left", va="bottom", fontsize=8)
    for n, r in out["paths"].items():
        if "error" in r and n not in names:
            ax.text(0.99, 0.95, f"{n}: {r['error'][:60]}", transform=ax.transAxes, ha="right", fontsize=7)
    ax.set_ylabel("GB/s (median, min-max bars, dots = run medians)")
    mib = out["tensor_bytes"] // MiB
    ax.set_title(f"{mib} MiB torch CPU tensor, actor to actor ({out['runs']} runs x "
                 f"{out['transfers_per_run']} transfers; {host_label(out.get('host'))})")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
