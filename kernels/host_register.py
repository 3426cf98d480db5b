"""Host memory page-locked for CUDA's copy engines (``cudaHostRegister``), in place.

Memory already mapped (the Store's host pool, the daemon's shared memory mapped by a
client) becomes a source a host -> device copy reads by DMA, as from a buffer allocated
pinned: no staging copy first. A range unmapped while registered would stay pinned under an
address a later map may take, and a copy from there would read the old pages; so a
registered buffer is held here (an exported view: its map can be neither closed nor
collected) until ``unregister``.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)
READ_ONLY = 0x08  # cudaHostRegisterReadOnly: a map this process may only read
_held: dict[int, np.ndarray] = {}  # address -> a view of each registered buffer


def register(buf, what: str, read_only: bool = False) -> int | None:
    """Register ``buf``'s bytes; its address, or None (no CUDA, or the driver refused: logged,
    and the CUDA error the refusal leaves pending on this thread is taken)."""
    import torch  # here: a process that never registers (the daemon, fsck) needs no torch for this

    if not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()
    view = np.frombuffer(buf, dtype=np.uint8)
    address = view.ctypes.data
    rc = cudart.cudaHostRegister(address, view.nbytes, READ_ONLY if read_only else 0)
    if rc == cudart.cudaError.success:
        _held[address] = view
        return address
    _take_cuda_error()
    log.warning("CUDA refused to register %s (%d bytes, error %d; a shared map must be of tmpfs, like "
                "/dev/shm): chunks go to the GPU through pinned staging buffers", what, view.nbytes, int(rc))
    return None


def unregister(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)
    del _held[address]


def _take_cuda_error() -> None:
    """A failed CUDA runtime call stays this thread's 'last error' until something asks for
    it, and torch asks after its next kernel launch on the thread, which then fails in its
    stead (the engine's forward, say); a launch of our own takes it here."""
    import torch

    try:
        torch.ones(1, device="cuda").add_(1)
    except RuntimeError:
        pass
