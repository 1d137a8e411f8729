"""SGLang's own hybrid cache controller moving a hybrid model's cache through the backend.

A Mamba-hybrid engine's ``HybridCacheController`` is built by its own constructor on the
CPU, as SGLang's hybrid pool assembler builds it (``build_hybrid_mamba_stack``): a
``HostPoolGroup`` of SGLang's host KV pool (``MHATokenToKVPoolHost``, the anchor, over a
real ``MHATokenToKVPool`` and ``PagedTokenToKVPoolAllocator`` on the CPU) and its Mamba
state pool (``MambaPoolHost``), with ``storage_backend="dynamic"`` and our loader config,
so the controller creates the backend through SGLang's factory and registers every pool
(``register_mem_pool_host``, ``register_mem_host_pool_v2``, ``on_host_pools_registered``).
The backend talks to a real store on a real Ray cluster.

The controller's own storage threads do the work: ``write_storage`` goes through the
backup thread (``batch_set_v2`` for the state, ``batch_set_v1`` for the KV pages);
``prefetch`` through the prefetch thread's hit query (``batch_exists_v2``) and the
rank-agreement step, then the IO thread (``batch_get_v1``, then ``batch_get_v2`` for the
state) and the sync thread, which publishes the acks. Torch's CPU ``Stream``/``Event``
(SGLang's device module on a CPU build) stand in for CUDA's; nothing is mocked.

What is not SGLang's running server, and why:

* The parallel topology is stated with SGLang's own seam,
  ``get_parallel().override(...)`` (one rank, no pipeline or decode context parallel),
  because no server launch publishes it in a test process.
* ``tp_group`` is None: with one rank SGLang creates no rank-agreement groups (it skips
  groups of world size 1), so the MIN reductions are over no group either way.
* The scheduler's part (``UnifiedRadixCache``) is played by the test, without a radix
  tree: it passes the Mamba transfers the Mamba component builds (a backup names the
  node's last page hash; a prefetch carries one placeholder key, trailing pages),
  allocates the hit-sized host buffers with the controller's ``allocate_storage_hit``
  and the Mamba pool's ``alloc``, hands the operation to ``prefetch_buffer`` and reads
  ``ack_backup_queue`` / ``prefetch_hit_queue`` / ``ack_prefetch_queue``.
* The Mamba entry has no device pool: the storage path moves host memory to and from
  the store only; device-host copies (CUDA kernels) are not part of it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from mooncake_ray.integrations.sglang import MooncakeRayHiCacheStorage
from tests.sglang.test_hicache import LAYERS, LOADER, PS, _close_joined_client, host_pool, mamba_pool, page_bits
from tests.sglang.test_hicache import model, shared_store  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(300)

WAIT_S = 30.0  # for one ack of the controller's threads


@pytest.fixture(scope="module")
def namespace(shared_store):
    """The shared store's namespace. At the end the process-wide client the backends
    joined with is closed before the store goes, so the read leases it still holds are
    given back while the master runs (its release timer would otherwise call a master
    that is gone, after Ray has shut down)."""
    _, ns = shared_store
    yield ns
    _close_joined_client(ns)


@pytest.fixture
def engine(namespace, model):
    """Makes engines of one hybrid model sharing the test's store: each a controller
    built by SGLang with our backend attached; detached (threads stopped, backend
    closed) at the end."""
    ns = namespace
    made = []

    def make(seed: int):
        dev = MHATokenToKVPool(size=256, page_size=PS, dtype=torch.bfloat16, head_num=2, head_dim=32,
                               layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        allocator = PagedTokenToKVPoolAllocator(dev.size, PS, torch.bfloat16, "cpu", dev, need_sort=False)
        kv, mamba = host_pool(False, "page_first", seed=seed), mamba_pool(seed=seed)
        group = HostPoolGroup([PoolEntry(PoolName.KV, kv, dev, lambda layer: layer, is_primary_index_anchor=True),
                               PoolEntry(PoolName.MAMBA, mamba, None, lambda layer: layer)])
        with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
            cc = HybridCacheController(allocator, group, PS, None, threading.Event(), io_backend="direct",
                                       storage_backend="dynamic", model_name=model,
                                       storage_backend_extra_config={**LOADER, "namespace": ns})
        made.append(cc)
        assert type(cc.storage_backend) is MooncakeRayHiCacheStorage
        assert cc.page_set_func == cc._page_set_zero_copy  # "interface_v1": the zero-copy calls
        return cc, kv, mamba

    yield make
    for cc in made:
        cc.detach_storage_backend()


def chain(n_pages: int, seed: int) -> tuple[list[int], list[str]]:
    """Tokens of ``n_pages`` pages and their chained page hashes, as SGLang computes them."""
    tokens = torch.randint(0, 50_000, (n_pages * PS,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tokens, get_storage_hash_str(tokens, None, page_size=PS)


def back_up(cc, kv_host: torch.Tensor, tokens, keys, state_slot: int | None):
    """A node's storage backup as the tree cache issues it: its KV host slots, and the
    Mamba state held for the node's end (keyed by its last page), if it has one.
    Returns the acknowledged operation."""
    extra = None
    if state_slot is not None:
        extra = [PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([state_slot]), keys=[keys[-1]],
                              hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    ident = cc.write_storage(kv_host, tokens, hash_value=list(keys), extra_pools=extra)
    op = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert op.id == ident
    return op


def query(cc, rid: str, tokens, last_hash=None):
    """Starts a prefetch as the tree cache does for a hybrid Mamba model; returns the
    operation once the prefetch thread's hit query (rank-agreed) is done."""
    mamba = PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    op = cc.prefetch(CacheRequestHandle(rid, 0), tokens, last_hash, extra_pools=[mamba])
    assert cc.prefetch_hit_queue.get(timeout=WAIT_S) is op
    return op


def fetch(cc, op) -> list:
    """Allocates the hit's host buffers as the scheduler does, hands the operation to
    the IO thread and returns the acks the sync thread publishes, the last one closing
    the request."""
    hit = op.storage_hit_count
    host, got = cc.allocate_storage_hit(op, hit, allow_partial=False, min_tokens=PS, evict_host=lambda n: 0)
    assert host is not None and got == hit
    for t in op.pool_transfers:
        t.host_indices = cc.mem_pool_host.alloc(1, pool=t.name)  # one state: the Mamba pool's page is 1
    op.host_indices = host
    cc.prefetch_buffer.put(op)
    acks = [cc.ack_prefetch_queue.get(timeout=WAIT_S)]
    while not acks[-1].completed_req:
        acks.append(cc.ack_prefetch_queue.get(timeout=WAIT_S))
    return acks


def kv_pages(host: torch.Tensor) -> list[int]:
    """The KV pool pages of host slots (one per page)."""
    return (host[::PS] // PS).tolist()


# --------------------------------------------------------------------- tests ----
def test_sglang_controller_backs_up_and_prefetches_kv_pages_and_mamba_state_byte_exact(engine):
    """A node's 4 KV pages and its Mamba state go out through the controller's backup
    thread and come back through its prefetch threads, into other slots of another
    engine's pools, byte for byte; the acks report the whole prefix and the state."""
    writer, wkv, wmamba = engine(seed=1)
    tokens, keys = chain(4, seed=31)
    src = writer.mem_pool_host.alloc(4 * PS)
    src_state = int(writer.mem_pool_host.alloc(1, pool=PoolName.MAMBA)[0])
    done = back_up(writer, src, tokens, keys, src_state)
    assert done.completed_tokens == 4 * PS
    assert done.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1}

    reader, rkv, rmamba = engine(seed=2)
    reader.mem_pool_host.alloc(4 * PS)  # the reader's first slots are taken: data lands elsewhere
    reader.mem_pool_host.alloc(2, pool=PoolName.MAMBA)
    op = query(reader, "req-whole", tokens)
    assert op.storage_hit_count == 4 * PS and op.hash_value == keys
    assert op.pool_storage_result.restorable_prefix_pages == [4]
    before = rmamba.get_data_page(src_state).clone()
    acks = fetch(reader, op)

    assert [a.completed_tokens for a in acks if a.completed_tokens is not None] == [4 * PS]
    assert [a.pool_hits[PoolName.MAMBA.value] for a in acks if a.pool_hits is not None] == [1]
    dst, dst_state = kv_pages(op.host_indices), int(op.pool_transfers[0].host_indices[0])
    assert set(dst).isdisjoint(kv_pages(src)) and dst_state != src_state
    for s, d in zip(kv_pages(src), dst):
        assert torch.equal(page_bits(rkv, d), page_bits(wkv, s)), (s, d)
    assert torch.equal(rmamba.get_data_page(dst_state), wmamba.get_data_page(src_state))
    assert torch.equal(rmamba.get_data_page(src_state), before)  # the reader's other slots untouched


def test_sglang_controller_counts_a_prefix_only_where_its_mamba_state_is_stored(engine):
    """Two nodes backed up: pages 1-2 with the state at their end, pages 3-4 without
    one (all KV pages stored). A prefetch of all 4 pages hits the 2 pages whose state
    exists and loads exactly those and that state; a prefix with no state at all is
    no hit."""
    writer, wkv, wmamba = engine(seed=3)
    tokens, keys = chain(4, seed=32)
    src = writer.mem_pool_host.alloc(4 * PS)
    state = int(writer.mem_pool_host.alloc(1, pool=PoolName.MAMBA)[0])
    assert back_up(writer, src[:2 * PS], tokens[:2 * PS], keys[:2], state).completed_tokens == 2 * PS
    assert back_up(writer, src[2 * PS:], tokens[2 * PS:], keys[2:], None).completed_tokens == 2 * PS
    kv_only = writer.storage_backend.batch_exists_v2(keys, [])
    assert kv_only.kv_hit_pages == 4  # every KV page is in the store

    reader, rkv, rmamba = engine(seed=4)
    op = query(reader, "req-partial", tokens)
    assert op.storage_hit_count == 2 * PS and op.hash_value == keys[:2]
    acks = fetch(reader, op)
    assert [a.completed_tokens for a in acks if a.completed_tokens is not None] == [2 * PS]
    assert [a.pool_hits[PoolName.MAMBA.value] for a in acks if a.pool_hits is not None] == [1]
    for s, d in zip(kv_pages(src[:2 * PS]), kv_pages(op.host_indices)):
        assert torch.equal(page_bits(rkv, d), page_bits(wkv, s)), (s, d)
    assert torch.equal(rmamba.get_data_page(int(op.pool_transfers[0].host_indices[0])), wmamba.get_data_page(state))

    # the second node alone (its pages continue the first's chain): KV stored, no state
    tail = query(reader, "req-tail", tokens[2 * PS:], last_hash=keys[1])
    assert tail.storage_hit_count == 0 and tail.hash_value == []
