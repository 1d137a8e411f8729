"""The KV layer: KV-cache pages in the store, keyed by the tokens they cover.

A page holds the K and V of ``page_size`` consecutive tokens for every layer. Its key is a
chained hash: page *i*'s hash covers the previous page's hash and its own token ids, so
it names the whole prefix up to and including the page (the scheme SGLang's HiCache
uses: SHA-256 over the prior hex digest, then each token as 4-byte little-endian). Two
prompts share a page key exactly when they share every token up to the end of that page.

Keys are namespaced by model, KV geometry, layout and tensor-parallel rank, so two
models, two layouts or two ranks never read each other's pages::

    kv/<model>/<layout>/<dtype>/L<layers>H<kv heads>D<head dim>/P<page size>/tp<rank>of<size>/<hash>

Only full pages are stored; a prompt's partial tail page is recomputed.

Layouts of the engine's page pool (the L1 cache this layer loads into):

- ``page_first``: ``[pages, layers, 2, page_size, kv_heads, head_dim]``: each page is one
  contiguous block, stored as one object, moved zero-copy (the pool is registered).
- ``layer_first``: ``[layers, 2, pages, page_size, kv_heads, head_dim]`` (the layout of a
  GPU KV cache): a page is strided, so it is gathered into (and scattered from) a staging
  block: one extra copy, the same stored bytes layout as page_first.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from mooncake_ray._private.checks import check_ttl
from mooncake_ray.errors import InvalidArgumentError, MooncakeRayError, ObjectExistsError, ObjectNotFoundError

__all__ = ["KVGeometry", "PagePool", "KVStore", "ConversationHint", "page_hashes", "key_prefix"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one model's KV cache (per tensor-parallel rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 64

    def __post_init__(self):
        if self.dtype not in _DTYPE_BYTES:
            raise InvalidArgumentError(f"dtype {self.dtype!r} not supported; allowed: {sorted(_DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers (e.g. Qwen3-8B: 36*8*128*2*2 = 144 KiB)."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * _DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ConversationHint:
    """What a request says about its conversation, for the store to keep its KV.

    ``priority > 0``: the newest stored page of the conversation's chain is soft-pinned
    for ``keep_s`` seconds; with chain-aware eviction a pinned page holds every page
    before it, so the whole conversation stays while the pin does. Each save moves the
    conversation's pin forward to its new newest page. ``priority <= 0``: no pin (plain
    eviction order). Limits: a soft pin yields when nothing unpinned is left to evict;
    the conversation's earlier pin is moved only by the same ``KVStore`` (another engine
    replica's pin of it lapses at its TTL); pins hold a chain only within one master shard.
    """

    conversation_id: str
    priority: int = 0
    keep_s: float = 600.0

    def __post_init__(self):
        if not isinstance(self.conversation_id, str) or not self.conversation_id:
            raise InvalidArgumentError(f"conversation_id must be a non-empty str, got {self.conversation_id!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidArgumentError(f"priority must be an int, got {self.priority!r}")
        if not isinstance(self.keep_s, (int, float)) or not 0 < self.keep_s <= 86400 * 365:
            raise InvalidArgumentError(f"keep_s must be a positive number of seconds, got {self.keep_s!r}")

    @classmethod
    def from_request(cls, fields: dict | None) -> "ConversationHint | None":
        """The hint a request carries (``conversation_id``, ``priority``, ``keep_s``), or
        None without a conversation id. Raises InvalidArgumentError naming a bad field."""
        if not fields or fields.get("conversation_id") is None:
            return None
        return cls(fields["conversation_id"], fields.get("priority", 0), fields.get("keep_s", 600.0))


class ConversationPins:
    """One soft pin per conversation, on its newest stored page (``ConversationHint``)."""

    MAX = 65536  # conversations remembered; an older one's pin lapses at its TTL

    def __init__(self, client) -> None:
        self.client = client
        self._pinned: dict[str, str] = {}  # conversation id -> the page pinned

    def keep(self, conversation_id: str, newest: str, keep_s: float) -> bool:
        """Soft-pin ``newest`` for ``keep_s`` and unpin the conversation's page pinned
        before (an ancestor: ``newest`` holds it now). False if ``newest`` is not stored."""
        old = self._pinned.pop(conversation_id, None)
        try:
            self.client.pin(newest, ttl_s=keep_s)
        except ObjectNotFoundError:  # its put failed: the old pin stays
            if old is not None:
                self._pinned[conversation_id] = old
            return False
        self._pinned[conversation_id] = newest
        if len(self._pinned) > self.MAX:
            self._pinned.pop(next(iter(self._pinned)))
        if old is not None and old != newest:
            try:
                self.client.unpin(old)
            except ObjectNotFoundError:
                pass
        return True


def page_hashes(tokens: Sequence[int], page_size: int, prior: str = "") -> list[str]:
    """Chained SHA-256 hex digests of each full page of ``tokens``."""
    out, h = [], prior
    for start in range(0, len(tokens) - page_size + 1, page_size):
        d = hashlib.sha256(h.encode())
        d.update(struct.pack(f"<{page_size}I", *tokens[start:start + page_size]))
        h = d.hexdigest()
        out.append(h)
    return out


def key_prefix(model: str, geometry: KVGeometry, layout: str, tp_rank: int = 0, tp_size: int = 1,
               pp_rank: int = 0, pp_size: int = 1) -> str:
    """The namespace of one model's pages: two models, geometries, dtypes, layouts or
    parallel ranks never share a key. (The pipeline rank is named only when there is one.)"""
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if not 0 <= pp_rank < pp_size:
        raise InvalidArgumentError(f"pp_rank {pp_rank} outside pp_size {pp_size}")
    g = geometry
    pp = f"pp{pp_rank}of{pp_size}/" if pp_size > 1 else ""
    return (f"kv/{model}/{layout}/{g.dtype}/L{g.num_layers}H{g.num_kv_heads}D{g.head_dim}/"
            f"P{g.page_size}/tp{tp_rank}of{tp_size}/{pp}")


class PagePool:
    """An engine's page pool (its L1 KV cache) as one torch tensor on the CPU."""

    def __init__(self, geometry: KVGeometry, num_pages: int, layout: str = "page_first"):
        import torch

        g = geometry
        self.geometry, self.num_pages, self.layout = g, num_pages, layout
        shape_page = (g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)
        if layout == "page_first":
            self.tensor = torch.zeros((num_pages, *shape_page), dtype=g.torch_dtype())
        elif layout == "layer_first":
            self.tensor = torch.zeros((g.num_layers, 2, num_pages, g.page_size, g.num_kv_heads, g.head_dim),
                                      dtype=g.torch_dtype())
            self._staging = torch.empty((num_pages, *shape_page), dtype=g.torch_dtype())
        else:
            raise InvalidArgumentError(f"layout {layout!r} not supported; allowed: page_first, layer_first")

    def page(self, page_id: int):
        """A contiguous tensor holding the page's bytes (a view for page_first)."""
        if self.layout == "page_first":
            return self.tensor[page_id]
        st = self._staging[page_id]
        st.copy_(self.tensor[:, :, page_id])
        return st

    def load_target(self, page_id: int):
        """Where a page's stored bytes should land (call ``commit`` afterwards)."""
        return self.tensor[page_id] if self.layout == "page_first" else self._staging[page_id]

    def commit(self, page_id: int) -> None:
        if self.layout == "layer_first":
            self.tensor[:, :, page_id].copy_(self._staging[page_id])

    def layer_kv(self, layer: int, page_ids: Sequence[int]):
        """K and V of one layer for the given pages: ``(k, v)`` of shape
        ``[len(page_ids) * page_size, kv_heads, head_dim]``."""
        import torch

        idx = torch.as_tensor(list(page_ids), dtype=torch.long)
        g = self.geometry
        if self.layout == "page_first":
            sel = self.tensor.index_select(0, idx)[:, layer]  # [n, 2, P, H, D]
            k, v = sel[:, 0], sel[:, 1]
        else:
            k = self.tensor[layer, 0].index_select(0, idx)
            v = self.tensor[layer, 1].index_select(0, idx)
        return k.reshape(-1, g.num_kv_heads, g.head_dim), v.reshape(-1, g.num_kv_heads, g.head_dim)

    def write_layer_kv(self, layer: int, page_id: int, offset: int, k, v) -> None:
        """Store K/V of ``len(k)`` tokens of one layer at token ``offset`` of a page."""
        n = k.shape[0]
        if self.layout == "page_first":
            self.tensor[page_id, layer, 0, offset:offset + n] = k
            self.tensor[page_id, layer, 1, offset:offset + n] = v
        else:
            self.tensor[layer, 0, page_id, offset:offset + n] = k
            self.tensor[layer, 1, page_id, offset:offset + n] = v


class KVStore:
    """KV pages of one model (and TP rank) in the distributed store.

    Args:
        client: a :class:`mooncake_ray.Client`.
        model: model id (any string; ``/`` is kept, it only namespaces keys).
        geometry: the KV shape; pages of different geometries never share keys.
        layout: the engine pool's layout (also part of the namespace).
        tp_rank, tp_size: tensor-parallel rank and size of this engine.
    """

    def __init__(self, client, model: str, geometry: KVGeometry, layout: str = "page_first",
                 tp_rank: int = 0, tp_size: int = 1):
        self.client, self.geometry = client, geometry
        self.prefix = key_prefix(model, geometry, layout, tp_rank, tp_size)
        self._registered: set[int] = set()
        self._pins = ConversationPins(client)
        # pages a batch call answered with an error, by error type ("put:..."/"get:..."):
        # a batch reports per key, so these do not raise; they are counted here
        self.failures: dict[str, int] = {}

    def _count(self, op: str, res) -> None:
        for r in res:
            if isinstance(r, Exception) and not isinstance(r, ObjectExistsError):
                k = f"{op}:{type(r).__name__}"
                self.failures[k] = self.failures.get(k, 0) + 1

    def keys(self, tokens: Sequence[int]) -> list[str]:
        return [self.prefix + h for h in page_hashes(tokens, self.geometry.page_size)]

    def register_pool(self, pool: PagePool) -> None:
        """Register the pool's memory so loads and saves are zero-copy."""
        for t in ([pool.tensor] + ([pool._staging] if pool.layout == "layer_first" else [])):
            if t.data_ptr() not in self._registered:
                self.client.register_buffer(t)
                self._registered.add(t.data_ptr())

    def lookup(self, tokens: Sequence[int], keys: list[str] | None = None) -> int:
        """How many leading tokens of ``tokens`` have their pages in the store."""
        keys = self.keys(tokens) if keys is None else keys
        if not keys:
            return 0
        n = 0
        for hit in self.client.batch_exists(keys):
            if not hit:
                break
            n += 1
        return n * self.geometry.page_size

    def save(self, tokens: Sequence[int], pool: PagePool, page_ids: Sequence[int], start_page: int = 0,
             hint: ConversationHint | None = None, handoff_s: float | None = None) -> int:
        """Store the pages ``start_page..`` of ``tokens`` held in ``pool`` at ``page_ids``
        (one pool page per full token page from ``start_page``). Pages already stored are
        skipped. Each page names the previous one as its parent, so the store evicts a
        chain from its tail (``master.chain_eviction``). ``hint``: the request's
        conversation (``ConversationHint``).

        ``handoff_s``: the pages are saved for a reader that loads them soon (a decode
        engine after this prefill): each page this call stores is held from the master call
        that publishes it, and each it found stored from one call before the put, until a
        ``load(..., handoff=True)`` of them, or ``handoff_s`` seconds, whatever the eviction
        policy learned (a soft pin: it yields only when nothing else is left to evict).

        Returns how many pages were newly stored. Raises InvalidArgumentError for a
        ``handoff_s`` that is not a positive number of seconds (before anything is stored)."""
        if handoff_s is not None:
            handoff_s = check_ttl(handoff_s, "handoff_s")
        every = self.keys(tokens)
        keys = every[start_page:start_page + len(page_ids)]
        if not keys:
            return 0
        present = self.client.batch_exists(keys)
        if handoff_s is not None and any(present):  # stored already: held before the put may evict them
            found = [j for j, p in enumerate(present) if p]
            for j, r in zip(found, self.client.batch_pin([keys[j] for j in found], ttl_s=handoff_s)):
                if isinstance(r, ObjectNotFoundError):  # gone since: put it again
                    present[j] = False
        todo = [(start_page + j, pid) for j, (pid, p) in enumerate(zip(page_ids, present)) if not p]
        hold = {} if handoff_s is None else {"hold_s": handoff_s}
        res = self.client.batch_put_from([every[i] for i, _ in todo], [pool.page(pid) for _, pid in todo],
                                         parents=[every[i - 1] if i else None for i, _ in todo], **hold) if todo else []
        self._count("put", res)
        if hint is not None and hint.priority > 0:
            self._pins.keep(hint.conversation_id, keys[-1], hint.keep_s)
        return sum(1 for r in res if r is None or isinstance(r, ObjectExistsError))

    def load(self, tokens: Sequence[int], pool: PagePool, page_ids: Sequence[int], start_page: int = 0,
             handoff: bool = False, hint: ConversationHint | None = None) -> int:
        """Read stored pages ``start_page..`` of ``tokens`` into ``pool`` at ``page_ids``, in
        one batched call. Returns the number of leading pages loaded (stops at the first
        miss: later pages are useless without it).

        ``handoff=True``: this is the read a ``save(..., handoff_s=...)`` of the same pages
        waited for; the range's holds are released (one call), so the pages are evicted
        like any other from now on (unless ``hint`` has a priority: the conversation's own
        pin on its newest page stays). A release that fails (no master answered) leaves the
        read as it is and is counted in ``failures`` ("unpin:..."); the holds then lapse
        after their ``handoff_s``."""
        keys = self.keys(tokens)[start_page:start_page + len(page_ids)]
        if not keys:
            return 0
        targets = [pool.load_target(pid) for pid in page_ids[:len(keys)]]
        sizes = self.client.batch_get_into(keys, targets)
        self._count("get", sizes)
        n = 0
        for pid, size in zip(page_ids, sizes):
            if isinstance(size, MooncakeRayError) or size != self.geometry.page_bytes:
                break
            pool.commit(pid)
            n += 1
        if handoff:  # (a page evicted or never stored answers ObjectNotFoundError: nothing held)
            try:
                res = self.client.batch_unpin(keys[:-1] if hint is not None and hint.priority > 0 else keys)
            except MooncakeRayError as e:  # the read stands; the holds lapse at their handoff_s
                res = [e]
            self._count("unpin", [r for r in res if not isinstance(r, ObjectNotFoundError)])
        return n
