"""The SGLang HiCache backend against SGLang's own code on a real Ray cluster.

Backends are built by SGLang's loader (``StorageBackendFactory.create_backend("dynamic",
...)``) from a real ``HiCacheStorageConfig``, and given SGLang's own host KV pools
(``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) built from SGLang's real device pools
(``MHATokenToKVPool``, ``MLATokenToKVPool``) on the CPU, as the hierarchical cache's pool
assembler builds them. Page contents are compared through SGLang's own page accessor
(``get_data_page``), not through the backend's layout code.
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import ray
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.observability.metrics_collector import StorageMetrics

from mooncake_ray._private.naming import MASTER_NAME
from mooncake_ray.errors import ConfigError, InvalidArgumentError, MooncakeRayError
from mooncake_ray.integrations import _store
from mooncake_ray.integrations.sglang import MooncakeRayHiCacheStorage
from tests.conftest import store_config, wait_for

pytestmark = pytest.mark.timeout(300)

PS = 16  # tokens a page
LAYERS = 4
LOADER = {"backend_name": "mooncake_ray", "module_path": "mooncake_ray.integrations.sglang",
          "class_name": "MooncakeRayHiCacheStorage", "interface_v1": 1}
MHA_LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["page_first", "layer_first", "page_first_direct"]


# ------------------------------------------------------------------ fixtures ----
def _close_joined_client(ns: str) -> None:
    """Close the process-wide clients the backends joined with (keyed by namespace and
    device path)."""
    for key in [k for k in _store._clients if k[0] == ns]:
        _store._clients.pop(key).close()


@pytest.fixture
def store(make_store):
    """A fresh store, for tests that count its keys or break it."""
    client = make_store()
    ns = client.config.namespace
    yield client, ns
    _close_joined_client(ns)


@pytest.fixture(scope="module")
def shared_store(ray_cluster):
    """One store for the tests that only read back what they wrote: each names its own
    model (the ``model`` fixture), so their keys never meet."""
    import mooncake_ray
    from mooncake_ray._private import deploy

    cfg = store_config()
    client = mooncake_ray.start(cfg)
    yield client, cfg["namespace"]
    _close_joined_client(cfg["namespace"])
    client.close()
    deploy.teardown(cfg["namespace"])


@pytest.fixture
def model(request) -> str:
    """A model name of this test's own."""
    return f"org/{request.node.name}"


def host_pool(mla: bool, layout: str, seed: int = 0):
    """SGLang's host KV pool of the given layout, filled with random bits, built from
    SGLang's device pool as the pool assembler does; ``pin_memory=False`` because pinning
    registers the memory with CUDA, which this torch does not have."""
    with host_memory_budget_scope(1 << 30):  # SGLang's own budget seam: independent of free RAM
        if mla:
            dev = MLATokenToKVPool(size=256, page_size=PS, dtype=torch.bfloat16, kv_lora_rank=32,
                                   qk_rope_head_dim=16, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
            pool = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0,
                                        host_size=0, page_size=PS, layout=layout, pin_memory=False,
                                        device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                        end_layer=dev.end_layer, target_layer_num=dev.layer_num,
                                        override_kv_cache_dim=dev.kv_cache_dim)
        else:
            dev = MHATokenToKVPool(size=256, page_size=PS, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                   layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
            info = dev.get_device_pool_infos()[0].buffer_info
            pool = get_mha_host_pool_cls(info)(info, host_to_device_ratio=2.0, host_size=0, page_size=PS,
                                               layout=layout, pin_memory=False, device_capacity_tokens=dev.size,
                                               start_layer=dev.start_layer, end_layer=dev.end_layer)
    gen = torch.Generator().manual_seed(seed)
    bits = pool.kv_buffer.view(torch.int16)
    bits.copy_(torch.randint(-2**15, 2**15, bits.shape, dtype=torch.int16, generator=gen))
    return pool


def make_backend(ns: str, pool, *, tp=(0, 1), pp=(0, 1), model="org/model-a", metrics=False, **extra):
    """A backend as SGLang's cache controller makes one: the factory, then the host pool."""
    cfg = HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=isinstance(pool, MLATokenToKVPoolHost), enable_storage_metrics=metrics,
        is_page_first_layout=pool.layout == "page_first", model_name=model,
        extra_config={**LOADER, "namespace": ns, "store_wait_s": 2.0, **extra})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert type(backend) is MooncakeRayHiCacheStorage
    backend.register_mem_pool_host(pool)
    return backend


def hashes(n: int, seed: int = 0) -> list[str]:
    """SGLang's chained page hashes of ``n`` pages of tokens."""
    tokens = torch.randint(0, 50_000, (n * PS,), generator=torch.Generator().manual_seed(seed)).tolist()
    return get_storage_hash_str(tokens, None, page_size=PS)


def slots(pages: list[int]) -> torch.Tensor:
    """Host indices of the given pages (as SGLang passes them: every token's slot)."""
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def page_bits(pool, page: int) -> torch.Tensor:
    """A page's content as SGLang's own accessor gives it (the layout's order)."""
    return pool.get_data_page(page * PS, flat=True).view(torch.int16).clone()


def token_major(pool, page: int) -> torch.Tensor:
    """A page's content ordered [component, token, layer, head, dim], from SGLang's
    accessor and the documented shape of a page in each layout."""
    flat = page_bits(pool, page)
    if isinstance(pool, MLATokenToKVPoolHost):
        native = {"page_first": (1, PS, LAYERS, 1, -1), "layer_first": (1, LAYERS, PS, 1, -1),
                  "page_first_direct": (1, LAYERS, PS, 1, -1)}[pool.layout]
    else:
        native = {"page_first": (2, PS, LAYERS, 2, -1), "layer_first": (2, LAYERS, PS, 2, -1),
                  "page_first_direct": (2, LAYERS, PS, 2, -1), "page_head": (2, 2, PS, LAYERS, -1)}[pool.layout]
    perm = {"page_first": (0, 1, 2, 3, 4), "layer_first": (0, 2, 1, 3, 4), "page_first_direct": (0, 2, 1, 3, 4),
            "page_head": (0, 2, 3, 1, 4)}[pool.layout]
    return flat.view(native).permute(perm).contiguous()


# --------------------------------------------------------------------- tests ----
def test_the_abstract_methods_are_the_ones_implemented():
    # An upstream change to the interface fails here rather than in an engine.
    assert HiCacheStorage.__abstractmethods__ == {"get", "batch_get", "set", "batch_set", "exists"}
    assert not MooncakeRayHiCacheStorage.__abstractmethods__
    for name in ("batch_get_v1", "batch_set_v1", "batch_exists", "get_stats", "clear", "register_mem_pool_host",
                 "register_mem_host_pool_v2", "batch_exists_v2", "batch_get_v2", "batch_set_v2",
                 *HiCacheStorage.__abstractmethods__):
        assert getattr(MooncakeRayHiCacheStorage, name) is not getattr(HiCacheStorage, name), name


@pytest.mark.parametrize("mla,layout", [(False, lay) for lay in MHA_LAYOUTS] + [(True, lay) for lay in MLA_LAYOUTS])
def test_pages_round_trip_byte_exact_into_other_slots(shared_store, model, mla, layout):
    client, ns = shared_store
    pool = host_pool(mla, layout)
    # a staging buffer of under two page components: strided layouts move in several runs
    backend = make_backend(ns, pool, model=model, staging_bytes="12kb")
    keys = hashes(6)
    src, dst = [1, 2, 3, 4, 5, 6], [20, 9, 30, 11, 25, 7]
    before = [page_bits(pool, p) for p in dst]
    assert backend.batch_set_v1(keys, slots(src)) == [True] * 6
    names = backend.object_keys(keys)
    assert len(names) == 6 * (1 if mla else 2) and all(client.batch_exists(names))
    assert all(torch.equal(page_bits(pool, d), b) for d, b in zip(dst, before))  # other slots untouched
    assert backend.batch_get_v1(keys, slots(dst)) == [True] * 6
    for s, d in zip(src, dst):
        assert torch.equal(page_bits(pool, d), page_bits(pool, s)), (s, d)


@pytest.mark.parametrize("mla", [False, True])
def test_page_first_stores_exactly_the_memory_sglang_points_zero_copy_io_at(shared_store, model, mla):
    client, ns = shared_store
    pool = host_pool(mla, "page_first")
    backend = make_backend(ns, pool, model=model)
    keys = hashes(3, seed=1)
    assert backend.batch_set_v1(keys, slots([3, 4, 5])) == [True] * 3
    ptrs, sizes = pool.get_page_buffer_meta(slots([3, 4, 5]))  # SGLang's zero-copy pointers
    names = backend.object_keys(keys)
    assert len(names) == len(ptrs)
    for name, ptr, size in zip(names, ptrs, sizes):
        assert client.get(name) == ctypes.string_at(ptr, size), name


@pytest.mark.parametrize("mla,writer,reader", [(False, "layer_first", "page_first"),
                                               (False, "page_head", "page_first_direct"),
                                               (True, "layer_first", "page_first_direct")])
def test_engines_with_different_layouts_share_pages(shared_store, model, mla, writer, reader):
    _, ns = shared_store
    wpool, rpool = host_pool(mla, writer, seed=1), host_pool(mla, reader, seed=2)
    keys = hashes(3, seed=2)
    assert make_backend(ns, wpool, model=model).batch_set_v1(keys, slots([2, 3, 4])) == [True] * 3
    assert make_backend(ns, rpool, model=model).batch_get_v1(keys, slots([10, 5, 8])) == [True] * 3
    for s, d in zip([2, 3, 4], [10, 5, 8]):
        assert torch.equal(token_major(rpool, d), token_major(wpool, s))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_tensor_calls_store_the_same_objects_as_the_zero_copy_ones(shared_store, model, layout):
    # Without "interface_v1" SGLang passes pages as flat tensors (get_data_page /
    # get_dummy_flat_data_page) to batch_set / batch_get.
    _, ns = shared_store
    pool = host_pool(False, layout)
    backend = make_backend(ns, pool, model=model)
    keys = hashes(4, seed=3)
    assert backend.batch_set(keys[:2], [pool.get_data_page(p * PS) for p in (1, 2)])
    assert backend.batch_set_v1(keys[2:], slots([3, 4])) == [True, True]
    assert backend.batch_exists(keys) == 4
    assert backend.batch_get_v1(keys[:2], slots([10, 11])) == [True, True]
    got = backend.batch_get(keys[2:], [pool.get_dummy_flat_data_page() for _ in range(2)])
    for p, page in zip((12, 13), got):
        pool.set_from_flat_data_page(p * PS, page)
    for s, d in zip([1, 2, 3, 4], [10, 11, 12, 13]):
        assert torch.equal(page_bits(pool, d), page_bits(pool, s))
    missing = hashes(1, seed=99)[0]
    assert backend.get(missing) is None and not backend.exists(missing)
    assert torch.equal(backend.get(keys[0]).view(torch.int16), page_bits(pool, 1))
    assert backend.set(keys[0], pool.get_data_page(PS))  # already stored: skipped, still True


def test_batch_exists_counts_whole_pages_from_the_start(store):
    client, ns = store
    pool = host_pool(False, "page_first")
    backend = make_backend(ns, pool)
    keys = hashes(7, seed=4)
    stored = [0, 1, 2, 4, 5, 6]  # a gap at page 3
    assert backend.batch_set_v1([keys[i] for i in stored], slots([i + 1 for i in stored])) == [True] * 6
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:]) == 3
    k5, v5, k6, v6 = backend.object_keys([keys[5], keys[6]])
    assert client.remove(v5)  # page 5 loses its V
    assert backend.batch_exists(keys[4:]) == 1
    # page 6's V named page 5's as its parent: no prefix lookup reaches it now, and the
    # master drops it at its next tick (its K, whose parent is stored, stays)
    wait_for(lambda: not client.exists(v6), timeout_s=10, what="page 6's orphaned V dropped")
    assert client.exists(k5) and client.exists(k6)
    # a miss is a False for that page, not an error
    assert backend.batch_get_v1(keys, slots(range(20, 27))) == [True, True, True, False, True, False, False]
    # storing again puts only what is missing
    assert backend.batch_set_v1(keys, slots(range(1, 8))) == [True] * 7
    assert backend.batch_exists(keys) == 7 and client.stats()["keys"] == 14


def test_mla_is_stored_once_for_all_tp_ranks(store):
    client, ns = store
    pools = [host_pool(True, "page_first", seed=r) for r in range(2)]
    rank0, rank1 = (make_backend(ns, pools[r], tp=(r, 2)) for r in range(2))
    keys = hashes(4, seed=5)
    assert rank0.object_keys(keys) == rank1.object_keys(keys)
    assert rank1.batch_set_v1(keys, slots([1, 2, 3, 4])) == [True] * 4  # not the writer: nothing stored
    assert client.stats()["keys"] == 0 and rank1.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, slots([1, 2, 3, 4])) == [True] * 4
    assert client.stats()["keys"] == 4
    assert rank1.batch_exists(keys) == 4
    assert rank1.batch_get_v1(keys, slots([9, 10, 11, 12])) == [True] * 4
    for s, d in zip([1, 2, 3, 4], [9, 10, 11, 12]):
        assert torch.equal(page_bits(pools[1], d), page_bits(pools[0], s))


def test_tp_and_pp_ranks_have_keys_of_their_own(store):
    client, ns = store
    ranks = {"tp0": dict(tp=(0, 2)), "tp1": dict(tp=(1, 2)), "pp1": dict(tp=(0, 2), pp=(1, 2))}
    pools = {name: host_pool(False, "page_first", seed=i) for i, name in enumerate(ranks)}
    backends = {name: make_backend(ns, pools[name], **kw) for name, kw in ranks.items()}
    keys = hashes(3, seed=6)
    names = {name: set(b.object_keys(keys)) for name, b in backends.items()}
    assert not names["tp0"] & names["tp1"] and not names["tp0"] & names["pp1"] and not names["tp1"] & names["pp1"]
    assert all("/tp1of2/" in k for k in names["tp1"]) and all("/pp1of2/" in k for k in names["pp1"])
    for b in backends.values():  # the same page hashes, each rank its own data
        assert b.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3
    assert client.stats()["keys"] == 3 * 3 * 2
    for name, b in backends.items():
        assert b.batch_get_v1(keys, slots([7, 8, 9])) == [True] * 3
        assert all(torch.equal(page_bits(pools[name], d), page_bits(pools[name], s))
                   for s, d in zip([1, 2, 3], [7, 8, 9])), name


def test_get_stats_reports_pages_and_bandwidth_per_batch(shared_store, model):
    _, ns = shared_store
    pool = host_pool(False, "layer_first")
    backend = make_backend(ns, pool, model=model, metrics=True)
    keys = hashes(5, seed=7)
    assert backend.batch_set_v1(keys, slots(range(1, 6))) == [True] * 5
    assert backend.batch_set_v1(keys, slots(range(1, 6))) == [True] * 5  # nothing new: not a transfer
    assert backend.batch_get_v1(keys[:3], slots(range(10, 13))) == [True] * 3
    m = backend.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [5] and m.prefetch_pgs == [3]
    assert len(m.backup_bandwidth) == 1 and len(m.prefetch_bandwidth) == 1
    assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    again = backend.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []


def test_bad_extra_config_keys_are_named(shared_store):
    _, ns = shared_store
    pool = host_pool(False, "page_first")
    with pytest.raises(ConfigError, match="bogus_key"):
        make_backend(ns, pool, bogus_key=1)
    with pytest.raises(ConfigError, match="store_wait_s"):
        make_backend(ns, pool, store_wait_s=-1)
    with pytest.raises(ConfigError, match="staging_bytes"):
        make_backend(ns, pool, staging_bytes="lots")
    # the keys SGLang reads itself are accepted
    make_backend(ns, pool, prefetch_threshold=256, enable_metadata_cache=True, hicache_storage_pass_prefix_keys=False)


def mamba_pool(seed: int = 0, slots: int = 16):
    """SGLang's host pool of Mamba state (``MambaPoolHost``, one slot per cached prefix
    state: 3 layers of conv and temporal state), built from device buffers on the CPU and
    filled with random bits."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    layers = 3
    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, 2, 8, 8, dtype=torch.float32),
                                conv=(torch.zeros(layers, slots, 3, 24, dtype=torch.bfloat16),))
    with host_memory_budget_scope(1 << 30):
        pool = MambaPoolHost(info, host_to_device_ratio=2.0, host_size=0, device_capacity=slots, pin_memory=False,
                             layout="page_first")
    gen = torch.Generator().manual_seed(seed)
    for buf in (pool.temporal_buffer, *pool.conv_buffer):
        bits = buf.view(torch.int16)
        bits.copy_(torch.randint(-2**15, 2**15, bits.shape, dtype=torch.int16, generator=gen))
    return pool


def hybrid_backend(ns: str, model: str, seed: int = 0):
    """A backend with a hybrid model's pools, registered as SGLang's hybrid cache
    controller does: the KV (anchor) pool, then every pool through the v2 call."""
    kv, mamba = host_pool(False, "page_first", seed=seed), mamba_pool(seed=seed)
    backend = make_backend(ns, kv, model=model)
    backend.register_mem_host_pool_v2(kv, "kv")
    backend.register_mem_host_pool_v2(mamba, "mamba")
    backend.on_host_pools_registered()
    return backend, kv, mamba


def transfers(keys, kv_pages, mamba_slots, mamba_keys=None, policy="trailing_pages"):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    mk = keys[-len(mamba_slots):] if mamba_keys is None else mamba_keys
    return [PoolTransfer(PoolName.KV, host_indices=slots(kv_pages), keys=list(keys)),
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor(mamba_slots, dtype=torch.int64), keys=list(mk),
                         hit_policy=PoolHitPolicy(policy))]


def test_hybrid_pages_round_trip_every_pool_into_other_slots(shared_store, model):
    """v2 writes and reads through SGLang's real host pools: the KV pages and the Mamba
    state of the prefix's last page land byte-exact in other slots of another engine's
    pools; a page counts as a hit only with its state."""
    _, ns = shared_store
    w, wkv, wm = hybrid_backend(ns, model, seed=1)
    keys = hashes(4, seed=21)
    res = w.batch_set_v2(transfers(keys, [0, 1, 2, 3], [5]))
    assert res == {"kv": [True] * 4, "mamba": [True]}
    r, rkv, rm = hybrid_backend(ns, model, seed=2)
    hit = r.batch_exists_v2(keys, transfers(keys, [0, 1, 2, 3], [0])[1:])
    # the state is stored for page 4 only: a prefix of 4 pages is the only hit
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages, hit.extra_pool_hit_pages) == (4, [4], {"kv": 4, "mamba": 4})
    got = r.batch_get_v2(transfers(keys, [7, 8, 9, 10], [2]))
    assert got == {"kv": [True] * 4, "mamba": [True]}
    for src, dst in zip([0, 1, 2, 3], [7, 8, 9, 10]):
        assert torch.equal(page_bits(rkv, dst), page_bits(wkv, src))
    assert torch.equal(rm.get_data_page(2), wm.get_data_page(5))


def test_hybrid_hit_policies(shared_store, model):
    """trailing_pages: the last len(keys) pages before the prefix end must hold the
    pool's page (a state or a window ends there); all_pages: every page; a policy the
    backend does not know: no hit rather than part of a prefix."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    _, ns = shared_store
    b, _, _ = hybrid_backend(ns, model, seed=3)
    keys = hashes(6, seed=22)
    b.batch_set_v2(transfers(keys[:6], list(range(6)), [1, 2], mamba_keys=[keys[1], keys[3]]))  # states after 2, 4

    def ask(n_back, policy="trailing_pages"):
        t = PoolTransfer(PoolName.MAMBA, keys=list(keys[:n_back]), hit_policy=PoolHitPolicy(policy))
        return b.batch_exists_v2(keys, [t])

    one = ask(1)
    assert one.kv_hit_pages == 4 and one.restorable_prefix_pages == [2, 4]
    assert ask(2).kv_hit_pages == 0  # two pages in a row before the end: none
    assert ask(1, "all_pages").kv_hit_pages == 0  # page 1 has no state
    unknown = PoolTransfer(PoolName.MAMBA, keys=list(keys[:1]), hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert b.batch_exists_v2(keys, [unknown]).kv_hit_pages == 0
    assert b.batch_exists_v2(keys, []).kv_hit_pages == 6  # the KV pages alone


def test_hybrid_bad_calls_are_named_and_lose_nothing(shared_store, model):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    _, ns = shared_store
    b, kv, _ = hybrid_backend(ns, model, seed=4)
    keys = hashes(2, seed=23)
    b.batch_set_v2(transfers(keys, [0, 1], [3]))
    with pytest.raises(InvalidArgumentError, match="'mamba': 1 keys need 1 host indices"):
        b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 2]), keys=keys[-1:])])
    with pytest.raises(InvalidArgumentError, match="'swa' was not registered"):
        b.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=torch.tensor([1]), keys=keys[-1:])])
    with pytest.raises(ConfigError, match="'draft' .*has no get_data_page"):
        b.register_mem_host_pool_v2(object(), "draft")
    with pytest.raises(ConfigError, match="a second KV host pool"):
        b.register_mem_host_pool_v2(host_pool(False, "page_first", seed=9), "kv")
    assert b.batch_exists_v2(keys, transfers(keys, [0, 1], [3])[1:]).kv_hit_pages == 2  # still stored


def test_a_missing_state_is_a_failed_page_not_a_partial_load(shared_store, model):
    """The state vanished after the lookup: its read fails (False), the slot keeps what it
    held, and SGLang discards the prefetch."""
    _, ns = shared_store
    w, _, _ = hybrid_backend(ns, model, seed=5)
    keys = hashes(3, seed=24)
    w.batch_set_v2(transfers(keys, [0, 1, 2], [4]))
    r, _, rm = hybrid_backend(ns, model, seed=6)
    before = rm.get_data_page(6).clone()
    r.client.remove(f"{r.prefix}{keys[-1]}/mamba")
    got = r.batch_get_v2(transfers(keys, [3, 4, 5], [6]))
    assert got["kv"] == [True] * 3 and got["mamba"] == [False]
    assert torch.equal(rm.get_data_page(6), before)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])  # zero-copy and staged
def test_store_down_calls_fail_within_the_wait_never_return_none(store, layout):
    client, ns = store
    pool = host_pool(False, layout)
    backend = make_backend(ns, pool)  # store_wait_s=2
    keys = hashes(4, seed=8)
    assert backend.batch_set_v1(keys[:2], slots([1, 2])) == [True, True]
    master = ray.get_actor(MASTER_NAME, namespace=ns)
    pid = ray.get(master.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(master, no_restart=True)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True

    # ray.kill returns before the process exits (and the handle may report the actor dead
    # while it still answers over the transport): wait for the process itself
    wait_for(gone, what="the master process to exit")

    def bounded(fn):
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            assert time.monotonic() - t0 < 2 + 8, "a call outlived store_wait_s by far"

    with pytest.raises(MooncakeRayError):
        bounded(lambda: backend.batch_get_v1(keys[:2], slots([5, 6])))
    with pytest.raises(MooncakeRayError):
        bounded(lambda: backend.batch_set_v1(keys[2:], slots([3, 4])))
    assert bounded(lambda: backend.batch_exists(keys)) == 0
    assert bounded(lambda: backend.exists(keys[0])) is False
