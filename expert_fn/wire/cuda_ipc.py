"""GPU memory that two processes on one machine share (CUDA IPC): the local channel's device rows.

A caller whose rows are on a GPU (a serving replica on a GPU) gives the host one device buffer;
the host maps the same memory, reads the call's rows from it and writes z into it, so nothing
is staged through host memory or the socket. On one GPU that is no copy at all; between two GPUs
of a node, the host's reads and writes cross NVLink or PCIe peer to peer.

The description of a buffer is the one torch.multiprocessing sends (the storage's IPC handle,
its size and offset in the CUDA allocation, torch's reference counter and its IPC event), packed
here as plain fields instead of a pickle, since the host must never unpickle what a peer sends:

    DESCRIPTION, then the handle, the counter's handle and the event handle (bytes)

Both sides must see the same GPU numbering, and pods need the node's IPC namespace (hostIPC)
and a shared /dev/shm for torch's reference counter. Two processes that take turns on one GPU
pay a context switch each time unless the node runs MPS (docs/serving.md has the figures).
"""

from __future__ import annotations

import struct

import torch

# b"MLCG", buffer bytes, device index, storage bytes, storage offset, counter offset, event sync,
# then the lengths of the three handles that follow the struct.
DESCRIPTION = struct.Struct("<4sqiqqqBHHH")
DESCRIPTION_MAGIC = b"MLCG"
MAX_DESCRIPTION_BYTES = 4096  # the handles are ~100 bytes each


class DeviceBufferError(Exception):
    """A shared device buffer could not be described or opened (the message says why)."""


def describe(buffer: torch.Tensor) -> bytes:
    """The message that lets another process on this machine map `buffer` (a contiguous uint8
    CUDA tensor that owns its storage from offset 0); the caller keeps `buffer` alive meanwhile."""
    from torch.multiprocessing.reductions import reduce_tensor  # CUDA-only path: kept off a CPU host's imports

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.storage_offset() or not buffer.is_contiguous():
        raise DeviceBufferError(f"only a contiguous uint8 CUDA buffer from offset 0 can be shared, not "
                                f"{buffer.dtype} on {buffer.device}")
    # reduce_tensor's arguments for rebuild_cuda_tensor: (tensor type, size, stride, offset, storage type, dtype,
    # device, handle, storage bytes, storage offset, requires_grad, counter handle, counter offset, event, sync).
    _, args = reduce_tensor(buffer)
    device, handle, size, offset, _, counter, counter_offset, event, sync = args[6:15]
    event = event or b""
    return DESCRIPTION.pack(DESCRIPTION_MAGIC, buffer.numel(), device, size, offset, counter_offset, bool(sync),
                            len(handle), len(counter), len(event)) + handle + counter + event


def open_described(msg: bytes) -> torch.Tensor:
    """The buffer that `describe` described, mapped into this process (uint8 [bytes], on its GPU);
    DeviceBufferError says why it cannot be (a malformed message, no CUDA here, another machine)."""
    if len(msg) < DESCRIPTION.size or msg[:4] != DESCRIPTION_MAGIC:
        raise DeviceBufferError("a malformed device buffer message: client and host versions differ?")
    _, nbytes, device, size, offset, counter_offset, sync, n_handle, n_counter, n_event = DESCRIPTION.unpack_from(msg)
    if len(msg) != DESCRIPTION.size + n_handle + n_counter + n_event or nbytes > size or min(nbytes, offset) < 0:
        raise DeviceBufferError(f"a device buffer message of {len(msg)} bytes does not hold what its head says")
    at = DESCRIPTION.size
    handle, counter, event = msg[at:at + n_handle], msg[at + n_handle:at + n_handle + n_counter], msg[at + n_handle + n_counter:]
    if not torch.cuda.is_available():
        raise DeviceBufferError("this host has no CUDA, so it cannot map the caller's GPU memory; "
                                "send the rows in host memory (a tensor on the CPU)")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # CUDA-only path, as in describe

    try:
        return rebuild_cuda_tensor(torch.Tensor, (nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, device,
                                   handle, size, offset, False, counter, counter_offset, event or None, bool(sync))
    except (RuntimeError, OSError) as err:
        raise DeviceBufferError(f"cannot map the caller's GPU memory (is the caller on this machine and its "
                                f"GPU {device} visible here?): {err}") from None
