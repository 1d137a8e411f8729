"""``mooncake-ray``: deploy, inspect and stop the store on a running Ray cluster.

    mooncake-ray start --config store.yaml      # onto the cluster of `ray start` / `ray up`
    mooncake-ray status
    mooncake-ray stop
"""

from __future__ import annotations

import json
import logging
import sys
import time

import click

from mooncake_ray.errors import MooncakeRayError


def _gb(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def _human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def format_status(stats: dict) -> str:
    """One summary line in the spirit of Mooncake's master log, then a table per store
    node and tier."""
    cap, used = stats["capacity"], stats["used"]
    lines = [f"Storage: {_gb(used)} / {_gb(cap)} GB | Keys: {stats['keys']} "
             f"(soft-pinned: {stats.get('soft_pinned', 0)}, pinned: {stats.get('pinned', 0)}) | "
             f"Hits: {stats.get('hits', 0)} Misses: {stats.get('misses', 0)} "
             f"Evictions: {stats.get('evictions', 0)} Offloads: {stats.get('offloads', 0)} "
             f"Promotions: {stats.get('promotions', 0)}"
             + (" | RECOVERING" if stats.get("recovering") else "")]
    lines.append(f"Membership: joins {stats.get('joins', 0)} | drains {stats.get('drains', 0)}: "
                 f"{stats.get('drain_moved_keys', 0)} keys ({_human(stats.get('drain_moved_bytes', 0))}) moved, "
                 f"{stats.get('drain_lost_keys', 0)} keys ({_human(stats.get('drain_lost_bytes', 0))}) lost | "
                 f"restarts re-adopted {stats.get('readoptions', 0)}: {stats.get('readopted_keys', 0)} keys kept, "
                 f"{stats.get('readopt_dropped_keys', 0)} dropped (bad checksum)")
    undone = stats.get("repair_failures", 0)
    lines.append(f"Copies: under-replicated {stats.get('under_replicated_keys', 0)} keys "
                 f"({_human(stats.get('under_replicated_bytes', 0))}) | repairs {stats.get('repairs', 0)} "
                 f"({_human(stats.get('repair_bytes', 0))})" + (f", {undone} copies to redo" if undone else "")
                 + (f", {stats['surplus_copies_dropped']} surplus copies dropped"
                    if stats.get("surplus_copies_dropped") else ""))
    shards = stats.get("shards")
    if isinstance(shards, list):
        down = [i for i, p in enumerate(shards) if "error" in p]
        lines.append(f"Master shards: {len(shards)}" + (f" (not answering: {down})" if down else "")
                     + "".join(f" | shard {i}: {p.get('keys', 0)} keys" + (" RECOVERING" if p.get("recovering") else "")
                               for i, p in enumerate(shards) if "error" not in p))
    header = (f"{'node':<14} {'tier':<5} {'used':>11} {'capacity':>11} {'use%':>6} {'keys':>8}  "
              f"{'memory':<10} state")
    lines += [header, "-" * len(header)]
    for node_id, node in sorted(stats["nodes"].items()):
        for tier in ("dram", "disk"):
            t = node[tier]
            if tier == "disk" and not t["capacity"]:
                continue
            pct = 100.0 * t["used"] / t["capacity"] if t["capacity"] else 0.0
            state = "draining" if node.get("draining") else "suspect" if node.get("suspect") else "ok"
            if tier == "disk" and t.get("degraded"):
                state = f"DEGRADED: {t['degraded']}"
            mem = ",".join(node.get("memory_types", ["host"])) if tier == "dram" else ""
            lines.append(f"{node_id[:14]:<14} {tier:<5} {_human(t['used']):>11} {_human(t['capacity']):>11} "
                         f"{pct:>5.1f}% {t.get('keys', 0):>8}  {mem:<10} {state}")
    for ev in stats.get("events", [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(ev.get("time", 0)))
        node = str(ev.get("node_id", ""))[:14]
        if ev["event"] == "drained":
            what = (f"drained: {ev['moved_keys']} keys ({_human(ev['moved_bytes'])}) moved, "
                    f"{ev['lost_keys']} keys ({_human(ev['lost_bytes'])}) lost")
        elif ev["event"] == "readopted":
            what = f"restarted, re-adopted its arena: {ev['keys']} keys kept, {ev['dropped']} dropped (bad checksum)"
        else:
            what = ev["event"]
        lines.append(f"{when} {node:<14} {what}")
    return "\n".join(lines)


def _ray_init(address: str | None) -> None:
    import ray

    if not ray.is_initialized():
        from mooncake_ray._private.rayjoin import join

        join(address or "auto", logging_level=logging.WARNING, log_to_driver=False)


@click.group()
def main() -> None:
    """Deploy, inspect and stop a mooncake-ray store on a running Ray cluster."""


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="YAML or JSON StoreConfig file.")
@click.option("--address", default=None, help="Ray cluster address (default: the running one).")
def start(config_path: str | None, address: str | None) -> None:
    """Deploy the store onto the running Ray cluster (idempotent)."""
    from mooncake_ray._private import deploy
    from mooncake_ray.config import load_config

    try:
        cfg = load_config(config_path)
        _ray_init(address or cfg.ray_address)
        masters, nodes = deploy.deploy(cfg)
        shards = f" and {len(masters)} master shards" if len(masters) > 1 else ""
        click.echo(f"mooncake-ray started in namespace {cfg.namespace!r} with {len(nodes)} store node(s){shards}")
        click.echo(format_status(deploy.store_stats(cfg.namespace)))
    except MooncakeRayError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


@main.command()
@click.option("--namespace", default="mooncake_ray", show_default=True)
@click.option("--address", default=None, help="Ray cluster address (default: the running one).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw statistics as JSON.")
def status(namespace: str, address: str | None, as_json: bool) -> None:
    """Capacity, usage and keys of the store, per node and tier."""
    from mooncake_ray._private import deploy

    try:
        _ray_init(address)
        stats = deploy.store_stats(namespace)
    except MooncakeRayError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(stats, indent=2, default=str) if as_json else format_status(stats))


@main.command()
@click.option("--namespace", default="mooncake_ray", show_default=True)
@click.option("--address", default=None, help="Ray cluster address (default: the running one).")
def stop(namespace: str, address: str | None) -> None:
    """Remove the store's actors from the cluster (stored data is dropped)."""
    from mooncake_ray._private import deploy

    try:
        _ray_init(address)
    except MooncakeRayError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    n = deploy.teardown(namespace)
    click.echo(f"stopped {n} mooncake-ray actor(s) in namespace {namespace!r}")


@main.command("make-model")
@click.argument("out_dir")
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden", default=256, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--vocab", default=1024, show_default=True)
@click.option("--arch", type=click.Choice(["llama", "gemma2", "gemma3", "qwen3_next"]), default="llama",
              show_default=True, help="gemma2/gemma3: sliding-window layers; qwen3_next: linear-attention state")
@click.option("--sliding-window", default=64, show_default=True, help="tokens a sliding-window layer sees")
def make_model(out_dir: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, arch: str,
               sliding_window: int) -> None:
    """Build a random-weight model and tokenizer locally (no download), for vLLM."""
    from mooncake_ray.integrations.tiny_model import TinyModelSpec, build

    try:
        spec = TinyModelSpec(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, arch=arch,
                             sliding_window=sliding_window)
        click.echo(build(out_dir, spec))
    except ValueError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
