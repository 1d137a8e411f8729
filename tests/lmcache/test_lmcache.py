"""LMCache's remote storage plugin (``mooncake_ray.integrations.lmcache``) on a real store.

The connector is always built by LMCache's own loader (``CreateConnector`` with an
``LMCacheEngineConfig`` naming the plugin in ``remote_storage_plugins``, as LMCache's
RemoteBackend does), over a real ``LocalCPUBackend`` whose allocator hands out the
MemoryObjs, on CPU. Further up LMCache's stack, a StorageManager and two LMCacheEngines
(with a CPU stand-in for the GPU connector) use the plugin through LMCache's
RemoteBackend. Chunks are small (2 layers, 16 tokens, 2 KB in bfloat16).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import pytest
import ray
import torch

from mooncake_ray._private import deploy
from mooncake_ray._private.naming import MASTER_NAME
from mooncake_ray.errors import ConfigError, MasterUnavailableError, MooncakeRayError
from tests.conftest import wait_for

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, CreateConnector
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from mooncake_ray.integrations.lmcache import (
    MooncakeRayConnectorAdapter,
    MooncakeRayRemoteConnector,
    PluginConfigError,
)

pytestmark = pytest.mark.timeout(120)

CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 8)  # layers, K and V, tokens, heads, head size
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 2  # bfloat16
PLUGIN = "mooncake_ray"
MODULE = "mooncake_ray.integrations.lmcache"


# ------------------------------------------------------------------- helpers ----
def lmcache_config(namespace: str, *, save_chunk_meta: bool | None = False, plugin: str = PLUGIN,
                   plugin_keys: dict | None = None, plugins: list[str] | None = None, **top) -> LMCacheEngineConfig:
    """An LMCache configuration using the plugin as its users write it (see the module
    docstring of the plugin); ``plugin_keys`` adds or replaces keys under its prefix."""
    p = f"remote_storage_plugin.{plugin}."
    extra = {p + "module_path": MODULE, p + "class_name": "MooncakeRayConnectorAdapter",
             p + "namespace": namespace, p + "store_wait_s": 2.0}
    extra.update({p + k: v for k, v in (plugin_keys or {}).items()})
    if save_chunk_meta is not None:
        extra["save_chunk_meta"] = save_chunk_meta
    return LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.01,
        "remote_storage_plugins": plugins or [plugin], "extra_config": extra, **top})


def engine_metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=CHUNK, role="worker")


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("tiny", 1, 0, 0xC0FFEE00 + i, torch.bfloat16)


class Plugin:
    """A connector from LMCache's loader, its LocalCPUBackend, and the event loop thread
    LMCache runs connector coroutines on."""

    def __init__(self, config: LMCacheEngineConfig, plugin: str = PLUGIN):
        self.metadata = engine_metadata()
        self.backend = LocalCPUBackend(config, self.metadata, "cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        try:
            self.conn = CreateConnector(f"plugin://{plugin}", self.loop, self.backend, config, self.metadata,
                                        plugin_name=plugin)
        except BaseException:
            self.stop()
            raise
        self.inner = self.conn.getWrappedConnector()

    def run(self, coro, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def chunk(self, seed: int, tokens: int = CHUNK):
        """A MemoryObj from LMCache's allocator, of ``tokens`` tokens of random bytes."""
        obj = self.backend.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes())
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        obj.raw_tensor[:obj.get_size()].copy_(torch.randint(0, 256, (obj.get_size(),), dtype=torch.uint8, generator=g))
        return obj

    def put(self, keys, objs) -> None:
        """Put as LMCache's RemoteBackend does: the connector gets a reference of its own
        per object, which the instrumented wrapper drops when the put is done."""
        for o in objs:
            o.ref_count_up()
        self.run(self.conn.batched_put(keys, objs))

    def allocations(self) -> int:
        """MemoryObjs allocated from LMCache's CPU buffer and not freed yet."""
        return self.backend.memory_allocator.pin_allocator.num_active_allocations

    def stop(self) -> None:
        if getattr(self, "conn", None) is not None:
            self.run(self.conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def plugins():
    made: list[Plugin] = []

    def make(config: LMCacheEngineConfig, plugin: str = PLUGIN) -> Plugin:
        made.append(Plugin(config, plugin))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def released(objs) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


# --------------------------------------------------------------- no store needed ----
def test_the_plugin_implements_exactly_what_lmcache_declares_abstract():
    assert RemoteConnector.__abstractmethods__ == {"exists", "exists_sync", "get", "put", "list", "close"}
    assert ConnectorAdapter.__abstractmethods__ == {"create_connector"}
    assert not MooncakeRayRemoteConnector.__abstractmethods__
    assert not MooncakeRayConnectorAdapter.__abstractmethods__
    batched = ["batched_get", "batched_put", "batched_contains", "batched_async_contains",
               "batched_get_non_blocking", "remove_sync", "ping"]
    assert [m for m in batched if getattr(MooncakeRayRemoteConnector, m) is getattr(RemoteConnector, m)] == []
    supports = [m for m in dir(RemoteConnector) if m.startswith("support_")]
    assert sorted(supports) == ["support_batched_async_contains", "support_batched_contains", "support_batched_get",
                                "support_batched_get_non_blocking", "support_batched_put", "support_ping"]
    assert all(getattr(MooncakeRayRemoteConnector, m)(None) is True for m in supports)


def test_adapter_claims_its_plugin_names_only():
    a = MooncakeRayConnectorAdapter()
    assert a.can_parse("plugin://mooncake_ray") and a.can_parse("plugin://mooncake_ray.second")
    assert not a.can_parse("plugin://mooncake_ray_other") and not a.can_parse("plugin://mooncakestore")
    assert not a.can_parse("mooncakestore://127.0.0.1:50051")


def test_unknown_and_bad_plugin_keys_are_named():
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.mooncake_ray\.'.*\n\s*namespce: got 'x'; "
                                          r"unknown field") as e:
        Plugin(lmcache_config("ns", plugin_keys={"namespce": "x"}))
    assert isinstance(e.value, IrrecoverableException)  # LMCache does not retry it
    with pytest.raises(ConfigError, match=r"store_wait_s: got 0; Input should be greater than 0"):
        Plugin(lmcache_config("ns", plugin_keys={"store_wait_s": 0}))
    with pytest.raises(ConfigError, match=r"'cachegen' needs save_chunk_meta: true"):
        Plugin(lmcache_config("ns", remote_serde="cachegen"))


def test_keys_of_other_plugins_and_of_the_loader_are_not_ours():
    from mooncake_ray.integrations.lmcache import parse_config

    extra = {"remote_storage_plugin.mooncake_ray.module_path": MODULE,
             "remote_storage_plugin.mooncake_ray.class_name": "MooncakeRayConnectorAdapter",
             "remote_storage_plugin.mooncake_ray.namespace": "a",
             "remote_storage_plugin.mooncake_ray.b.namespace": "b",
             "remote_storage_plugin.fs.base_path": "/x", "save_chunk_meta": False}
    names = ["mooncake_ray", "mooncake_ray.b"]
    assert parse_config(extra, "mooncake_ray", names).namespace == "a"
    assert parse_config(extra, "mooncake_ray.b", names).namespace == "b"
    with pytest.raises(PluginConfigError, match=r"b\.namespace: got 'b'; unknown field"):
        parse_config(extra, "mooncake_ray", ["mooncake_ray"])  # no plugin named mooncake_ray.b


# ------------------------------------------------------------ on a real store ----
def test_namespace_without_a_store_is_named(ray_cluster):
    with pytest.raises(MasterUnavailableError, match="no-store-here"):
        Plugin(lmcache_config("no-store-here"))


def test_zero_copy_layout_round_trips_byte_exact(make_store, plugins):
    client = make_store()
    p = plugins(lmcache_config(client.config.namespace, save_chunk_meta=False))
    assert isinstance(p.inner, MooncakeRayRemoteConnector) and p.inner.layout == "r" and p.inner.zero_copy
    objs = [p.chunk(i) for i in range(3)] + [p.chunk(3, tokens=5)]  # the last one a partial chunk
    want = [bytes(o.byte_array) for o in objs]
    keys = [key(i) for i in range(4)]
    p.put(keys, objs)
    assert [o.get_ref_count() for o in objs] == [1, 1, 1, 1]  # the put let go of its references

    # stored as the bare bytes, under the prefixed LMCache key
    assert client.get("lmcache/r/" + keys[0].to_string()) == want[0]
    assert len(client.get("lmcache/r/" + keys[3].to_string())) == 5 * CHUNK_BYTES // CHUNK

    got = p.run(p.conn.batched_get(keys + [key(99)]))
    assert [bytes(g.byte_array) for g in got[:4]] == want and got[4] is None
    assert [g.get_shape() for g in got[:4]] == [torch.Size([2, 2, CHUNK, 16])] * 3 + [torch.Size([2, 2, 5, 16])]
    assert all(g.get_memory_format() == MemoryFormat.KV_2LTD for g in got[:4])
    released(got)

    # single-key calls
    one = p.chunk(7)
    p.run(p.conn.put(key(7), one))
    g = p.run(p.conn.get(key(7)))
    assert bytes(g.byte_array) == bytes(one.byte_array)
    released([g, one])
    assert p.run(p.conn.get(key(98))) is None
    assert p.run(p.conn.exists(key(7))) and not p.inner.exists_sync(key(98))

    # lookups count the leading run of stored keys
    probe = [key(0), key(1), key(99), key(2)]
    assert p.conn.batched_contains(probe) == 2
    assert p.run(p.conn.batched_async_contains("lookup-1", probe)) == 2
    assert p.conn.batched_contains([key(99)] + keys) == 0
    lead = p.run(p.conn.batched_get_non_blocking("lookup-1", probe))
    assert [bytes(o.byte_array) for o in lead] == want[:2]
    released(lead)
    assert p.run(p.conn.ping()) == 0

    # storing a key again leaves it as it was; removing it makes it a miss
    p.put([key(0)], [objs[1]])
    assert client.get("lmcache/r/" + keys[0].to_string()) == want[0]
    # a read lease (the get just above) holds the value for the length of the read
    wait_for(lambda: p.conn.remove_sync(key(0)), timeout_s=15, what="the read lease to end and the key to go")
    assert not p.conn.remove_sync(key(0))
    assert p.conn.batched_contains(keys) == 0
    released(objs)
    with pytest.raises(NotImplementedError, match="does not list keys"):
        p.run(p.conn.list())
    assert p.allocations() == 0  # every MemoryObj went back to LMCache's allocator


def test_a_cancelled_get_returns_its_memory_objects_when_the_read_ends(make_store, plugins, monkeypatch):
    client = make_store()
    p = plugins(lmcache_config(client.config.namespace, save_chunk_meta=False))
    objs = [p.chunk(50 + i) for i in range(4)]
    keys = [key(50 + i) for i in range(4)]
    p.put(keys, objs)
    released(objs)
    assert p.allocations() == 0

    reading, finish = threading.Event(), threading.Event()
    read = p.inner.client.batch_get_into

    def slow_read(*args, **kwargs):  # holds the read open until the get has been cancelled
        reading.set()
        finish.wait(30)
        return read(*args, **kwargs)

    monkeypatch.setattr(p.inner.client, "batch_get_into", slow_read)
    # LMCache's RemoteBackend cancels a get that outlives blocking_timeout_secs
    fut = asyncio.run_coroutine_threadsafe(p.conn.batched_get(keys), p.loop)
    assert reading.wait(30)
    assert p.allocations() == 4
    fut.cancel()
    wait_for(lambda: fut.done(), timeout_s=10, what="the cancellation")
    assert p.allocations() == 4  # the read still writes into them: not freed yet
    finish.set()
    wait_for(lambda: p.allocations() == 0, timeout_s=30, what="the abandoned chunks to be freed")


def test_header_layout_round_trips_any_memory_object(make_store, plugins):
    client = make_store()
    p = plugins(lmcache_config(client.config.namespace, save_chunk_meta=None))  # LMCache's default: True
    assert p.inner.layout == "m"
    objs = [p.chunk(10), p.chunk(11, tokens=3)]
    blob = p.backend.allocate([torch.Size([1000, 0, 0, 0])], [None], MemoryFormat.BINARY_BUFFER)  # a serde's output
    blob.byte_array[:] = bytes(range(250)) * 4
    objs.append(blob)
    want = [bytes(o.byte_array) for o in objs]
    keys = [key(10), key(11), key(12)]
    p.put(keys, objs)

    value = client.get("lmcache/m/" + keys[1].to_string())
    h = p.inner.remote_metadata_bytes
    meta = RemoteMetadata.deserialize(value[:h])
    assert (meta.length, meta.shapes, meta.dtypes, meta.fmt) == (
        3 * CHUNK_BYTES // CHUNK, [torch.Size([2, 2, 3, 16])], [torch.bfloat16], MemoryFormat.KV_2LTD)
    assert value[h:] == want[1]

    got = p.run(p.conn.batched_get(keys + [key(99)]))
    assert [bytes(g.byte_array) for g in got[:3]] == want and got[3] is None
    assert got[1].get_shapes() == [torch.Size([2, 2, 3, 16])]
    assert got[2].get_memory_format() == MemoryFormat.BINARY_BUFFER
    released(got)
    g = p.run(p.conn.get(key(10)))
    assert bytes(g.byte_array) == want[0]
    released([g])
    released(objs)
    assert p.allocations() == 0

    # an engine writing the other layout does not take these values for its own
    raw = plugins(lmcache_config(client.config.namespace, save_chunk_meta=False))
    assert raw.conn.batched_contains(keys) == 0 and p.conn.batched_contains(keys) == 3


USER_YAML = """\
chunk_size: 16
local_cpu: false
max_local_cpu_size: 0.01
remote_storage_plugins: ["mooncake_ray"]
extra_config:
  remote_storage_plugin.mooncake_ray.module_path: mooncake_ray.integrations.lmcache
  remote_storage_plugin.mooncake_ray.class_name: MooncakeRayConnectorAdapter
  remote_storage_plugin.mooncake_ray.namespace: {namespace}
  save_chunk_meta: false
"""


def test_lmcache_storage_manager_stores_and_retrieves_through_the_plugin(make_store, tmp_path):
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    client = make_store()
    path = tmp_path / "lmcache.yaml"  # the configuration as a user writes it (docs/integrations.md)
    path.write_text(USER_YAML.format(namespace=client.config.namespace))
    config = LMCacheEngineConfig.from_file(str(path))
    sm = StorageManager(config, engine_metadata(), EventManager())
    try:
        assert list(sm.storage_backends) == ["LocalCPUBackend", f"RemoteBackend-{PLUGIN}"]
        remote = sm.storage_backends[f"RemoteBackend-{PLUGIN}"]
        assert isinstance(remote.connection.getWrappedConnector(), MooncakeRayRemoteConnector)
        objs = [sm.allocate(engine_metadata().get_shapes(), engine_metadata().get_dtypes()) for _ in range(3)]
        for i, o in enumerate(objs):
            o.raw_tensor[:o.get_size()].fill_(i + 1)
        want = [bytes(o.byte_array) for o in objs]
        keys = [key(20 + i) for i in range(3)]
        sm.batched_put(keys, objs)  # hands the objects to the backends and drops its references
        wait_for(lambda: all(client.batch_exists(["lmcache/r/" + k.to_string() for k in keys])),
                 timeout_s=30, what="LMCache's puts to reach the store")
        hits, where = sm.batched_contains(keys + [key(99)])
        assert hits == 3 and where == {f"RemoteBackend-{PLUGIN}": keys}
        got = sm.batched_get(keys, location=f"RemoteBackend-{PLUGIN}")  # as LMCache retrieves what a lookup found
        assert [bytes(g.byte_array) for g in got] == want
        released(got)
    finally:
        sm.close()


class CpuKVConnector(MockGPUConnector):
    """LMCache's GPU connector role played on CPU: copies token ranges between a KV tensor
    ``kv`` of shape [K and V, layers, tokens, heads x head size] (passed as LMCache passes
    the serving engine's paged buffers) and the MemoryObjs (format KV_2LTD)."""

    def __init__(self):
        super().__init__(KV_SHAPE)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends):
            kwargs["kv"][:, :, start:end, :].copy_(obj.tensor)


@pytest.mark.parametrize("save_chunk_meta", [False, True])
def test_lmcache_engines_share_kv_through_the_store(make_store, save_chunk_meta):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    client = make_store()
    config = lmcache_config(client.config.namespace, save_chunk_meta=save_chunk_meta, save_unfull_chunk=True)
    n = 3 * CHUNK + 5  # three chunks and a partial one
    tokens = torch.arange(1000, 1000 + n)
    kv = torch.randn(2, KV_SHAPE[0], n, KV_SHAPE[3] * KV_SHAPE[4], generator=torch.Generator().manual_seed(5))
    kv = kv.to(torch.bfloat16)
    ids = [f"writer-{uuid.uuid4().hex[:6]}", f"reader-{uuid.uuid4().hex[:6]}"]
    try:
        # local_cpu is off: what the reader finds, it finds in the store
        writer, reader = (LMCacheEngineBuilder.get_or_create(i, config, engine_metadata(), CpuKVConnector(),
                                                             lambda t, r: None, lambda o, r: o) for i in ids)
        for e in (writer, reader):
            e.post_init()
        assert reader.lookup(tokens) == 0
        writer.store(tokens, kv=kv)  # the remote puts run in the background
        wait_for(lambda: reader.lookup(tokens) == n, timeout_s=30, what="the reader to find every token")
        layout = "m" if save_chunk_meta else "r"
        assert sum(client.batch_exists([f"lmcache/{layout}/{k.to_string()}" for _, _, k in
                                        reader.token_database.process_tokens(tokens)])) == 4
        out = torch.zeros_like(kv)
        mask = reader.retrieve(tokens, kv=out)
        assert int(mask.sum()) == n and torch.equal(out, kv)
    finally:
        for i in ids:
            LMCacheEngineBuilder.destroy(i)


WAIT_S = 0.5  # store_wait_s of the store-down test


@pytest.mark.parametrize("outage", ["master killed", "store torn down"])
def test_store_down_gives_errors_and_misses_within_a_bound(make_store, plugins, outage):
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    client = make_store()
    ns = client.config.namespace
    # each call waits store_wait_s for the store to come back before it fails: kept short,
    # as the bound below is what is tested, not the wait
    config = lmcache_config(ns, save_chunk_meta=False, plugin_keys={"store_wait_s": WAIT_S})
    p = plugins(config)
    obj = p.chunk(30)
    p.put([key(30)], [obj])
    remote = RemoteBackend(config, p.metadata, p.loop, p.backend, "cpu", plugin_name=PLUGIN)
    assert remote.contains(key(30))
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    pid = ray.get(master.__ray_call__.remote(lambda self: os.getpid()))
    if outage == "master killed":
        ray.kill(master, no_restart=True)
    else:
        assert deploy.teardown(ns) == 3  # the master and both store nodes
    # Ray reports the actor dead before its process (and the master's transport) is gone
    wait_for(lambda: _gone(pid), timeout_s=30, what="the master's process to exit")

    bound_s = WAIT_S + 2 * 2.0 + 5.0  # store_wait_s, two RPC timeouts (store_config's), slack for a busy machine
    c = p.inner  # the plugin itself: LMCache's instrumented wrapper logs and drops a put's error
    calls = {
        "batched_get": lambda: p.run(c.batched_get([key(30), key(31)])),
        "batched_put": lambda: p.run(c.batched_put([key(32)], [obj])),
        "get": lambda: p.run(c.get(key(30))),
        "batched_contains": lambda: c.batched_contains([key(30)]),
        "batched_async_contains": lambda: p.run(c.batched_async_contains("lookup-2", [key(30)])),
        "exists_sync": lambda: c.exists_sync(key(30)),
        "ping": lambda: p.run(c.ping()),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(MooncakeRayError) as e:
            call()
        took = time.monotonic() - t0
        assert took < bound_s, f"{name} took {took:.1f}s ({type(e.value).__name__}: {e.value})"
        assert e.value.retryable, f"{name}: {type(e.value).__name__}"
    assert obj.get_ref_count() == 1  # the failed put let go of its reference

    # LMCache's remote backend turns the errors into misses
    backend_calls = {
        "contains": (lambda: remote.contains(key(30)), False),
        "batched_contains": (lambda: remote.batched_contains([key(30)]), 0),
        "batched_get_blocking": (lambda: remote.batched_get_blocking([key(30)]), [None]),
        "get_blocking": (lambda: remote.get_blocking(key(30)), None),
        "batched_submit_put_task": (lambda: remote.batched_submit_put_task([key(33)], [obj]), None),
    }
    for name, (call, miss) in backend_calls.items():
        t0 = time.monotonic()
        assert call() == miss, name
        assert time.monotonic() - t0 < bound_s, name
    t0 = time.monotonic()
    remote.close()  # waits for the put LMCache submitted and did not wait for
    assert time.monotonic() - t0 < bound_s and not remote.put_tasks
    assert obj.get_ref_count() == 1
    released([obj])


def test_a_second_plugin_instance_has_its_own_settings(make_store, plugins):
    a, b = make_store(), make_store()
    names = [PLUGIN, f"{PLUGIN}.second"]
    config = lmcache_config(a.config.namespace, plugins=names, plugin_keys={"key_prefix": "first/"})
    extra = dict(config.extra_config)
    q = f"remote_storage_plugin.{PLUGIN}.second."
    extra.update({q + "module_path": MODULE, q + "class_name": "MooncakeRayConnectorAdapter",
                  q + "namespace": b.config.namespace, q + "key_prefix": "second/"})
    config.extra_config = extra
    first, second = plugins(config), plugins(config, plugin=f"{PLUGIN}.second")
    obj = first.chunk(40)
    first.put([key(40)], [obj])
    second.put([key(41)], [obj])
    assert a.exists("first/r/" + key(40).to_string()) and not a.exists("second/r/" + key(41).to_string())
    assert b.exists("second/r/" + key(41).to_string()) and not b.exists("first/r/" + key(40).to_string())
    released([obj])

