"""The store client's internals; ``mooncake_ray/client.py`` is its API.

One concern a module, each a small class handed what it needs (the transport engine, the
master channel, the configuration) rather than sharing the client's attributes:

- ``nodes``: the table of store nodes (their connections and arenas) and failure reports.
- ``locations``: the location cache, where values this client wrote or read live.
- ``releases``: read leases given back in batches, piggybacked on the next GET.
- ``slabs``: the put slab this client carves single-call puts from.
- ``writes``: the put paths (one-call into the slab, two-call put_start / put_end).
- ``reads``: the get paths (single, early from a remembered location, batched, promotions).
- ``args``: checking what callers pass (keys, sized buffers); ``backoff``: waiting to retry.
"""
