"""What the Ray Direct Transport plug-in (``ray_rdt``) hands Ray: the metadata a reader
needs to fetch an object's tensors, and the state of a fetch in progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportMetadata,
)


@dataclass
class MooncakeCommunicatorMetadata(CommunicatorMetadata):
    """Nothing to agree on beforehand: the source's address travels in the tensor metadata."""


@dataclass
class MooncakeTransportMetadata(TensorTransportMetadata):
    """Tensor metadata plus what a reader needs to fetch them.

    Args:
        engine_address: the source engine's address (``Engine.address``).
        engine_name: the source engine's name (for error messages).
        regions: one (rkey, base address, length) per registered storage.
        placements: one (region index, offset in the region, nbytes) per tensor; region
            index -1 for empty tensors.
    """

    engine_address: Optional[bytes] = None
    engine_name: str = ""
    regions: List[Tuple[bytes, int, int]] = field(default_factory=list)
    placements: List[Tuple[int, int, int]] = field(default_factory=list)

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class SourceReg:
    region: Any  # Region, or an arena Region we do not own
    owned: bool
    storage: Any  # keeps the memory alive while registered
    count: int


@dataclass
class MooncakeFetchRequest(FetchRequest):
    """State of a read started by ``fetch_multiple_tensors``."""

    handle: Any = None
    source: str = ""
    nbytes: int = 0
    started: float = 0.0
    temp_regions: List[Any] = field(default_factory=list)
    transport: Any = None
    finished: bool = False

    def __del__(self):
        t = self.transport
        if t is not None and not self.finished:
            try:
                t._abandon(self)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def raise_rdt(msg: str, cause: Optional[BaseException] = None):
    from ray.exceptions import RayDirectTransportError

    if cause is not None:
        msg = f"{msg}: {type(cause).__name__}: {cause}"
    raise RayDirectTransportError(msg) from cause

