"""Process groups over NCCL (through CuPy's `cupy.cuda.nccl`): one process per GPU, set up from the environment.

The environment is torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; `python -m
cuflash.distributed.launch` sets the same), or an MPI launcher's (Open MPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK,
MPICH/Slurm PMI_RANK/PMI_SIZE with MPI_LOCALRANKID) with MASTER_ADDR and MASTER_PORT given by the user.
Rank 0 makes the NCCL unique id and hands it to the others over TCP at MASTER_ADDR:MASTER_PORT + 1 (torchrun's own
rendezvous store holds MASTER_PORT itself).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

_RANK_VARS = (  # (rank, world size, local rank) variables of the launchers we read, first match wins
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_env(environ=None) -> LaunchEnv:
    """This process's place in the job, from the launcher's environment variables (module docstring)."""
    env = os.environ if environ is None else environ
    for rank_var, size_var, local_var in _RANK_VARS:
        if rank_var in env and size_var in env:
            break
    else:
        raise RuntimeError("no launcher environment found: RANK and WORLD_SIZE (torchrun, python -m "
                           "cuflash.distributed.launch) or an MPI launcher's OMPI_COMM_WORLD_* / PMI_* variables "
                           "must be set; start the processes with python -m cuflash.distributed.launch "
                           "--nproc-per-node N script.py")
    rank, world_size = _int_var(env, rank_var), _int_var(env, size_var)
    local_rank = _int_var(env, local_var) if local_var in env else rank
    if world_size < 1 or not 0 <= rank < world_size:
        raise RuntimeError(f"{rank_var}={rank} and {size_var}={world_size}: need 0 <= rank < world size")
    addr = env.get("MASTER_ADDR", "127.0.0.1" if world_size == 1 else None)
    if addr is None:
        raise RuntimeError(f"MASTER_ADDR is not set: the address where rank 0 listens (with {rank_var})")
    port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500
    if not 0 < port < 65535:
        raise RuntimeError(f"MASTER_PORT={port} must be in 1 .. 65534 (cuflash listens on MASTER_PORT + 1)")
    return LaunchEnv(rank, world_size, local_rank, addr, port)


def _int_var(env, name) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise RuntimeError(f"{name}={env[name]!r} is not an integer") from None


def exchange_unique_id(env: LaunchEnv, make_id, timeout_s: float = 300.0) -> bytes:
    """Rank 0 makes the 128-byte NCCL id (make_id()) and sends it to every other rank over TCP."""
    if env.world_size == 1:
        return make_id()
    address = (env.master_addr, env.master_port + 1)
    if env.rank == 0:
        uid = bytes(make_id())
        with socket.create_server(address, reuse_port=False) as server:
            server.settimeout(timeout_s)
            for _ in range(env.world_size - 1):
                conn, _ = server.accept()
                with conn:
                    conn.sendall(len(uid).to_bytes(4, "big") + uid)
        return uid
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(address, timeout=10) as conn:
                size = int.from_bytes(_recv_exactly(conn, 4), "big")
                return _recv_exactly(conn, size)
        except (ConnectionRefusedError, ConnectionResetError, socket.timeout, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {env.rank}: rank 0 did not hand out the NCCL id at "
                                   f"{address[0]}:{address[1]} within {timeout_s:.0f} s") from None
            time.sleep(0.2)


def _recv_exactly(conn, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("rendezvous connection closed early")
        data += chunk
    return data


class ProcessGroup:
    """The ranks of one job, one GPU each, joined by an NCCL communicator.

    Attributes: rank, world_size, local_rank, device (the CuPy device this process computes on), comm (the
    `cupy.cuda.nccl.NcclCommunicator`), stream (the stream ring transfers run on, beside the compute stream)."""

    def __init__(self, env: LaunchEnv, device_id: int | None = None):
        import cupy as cp
        from cupy.cuda import nccl

        if not nccl.available:
            raise RuntimeError("CuPy cannot load NCCL: pip install 'cuflash[distributed]' (nvidia-nccl-cu13; "
                               "'cuflash[distributed-cuda12]' for CUDA 12)")
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        count = cp.cuda.runtime.getDeviceCount()
        device_id = env.local_rank if device_id is None else device_id
        if not 0 <= device_id < count:
            raise RuntimeError(f"rank {env.rank}: device {device_id} (LOCAL_RANK) does not exist; this node has "
                               f"{count} GPU{'s' if count != 1 else ''}")
        self.device = cp.cuda.Device(device_id)
        self.device.use()
        uid = exchange_unique_id(env, nccl.get_unique_id)
        self.comm = nccl.NcclCommunicator(env.world_size, uid, env.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def barrier(self) -> None:
        """Every rank reaches this point (a one-element all-reduce on the current stream, then a host wait)."""
        import cupy as cp
        from cupy.cuda import nccl

        x = cp.zeros(1, cp.int32)
        stream = cp.cuda.get_current_stream()
        self.comm.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_INT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()

    def all_gather(self, x):
        """(world_size, *x.shape): every rank's x, on every rank (on the current stream)."""
        import cupy as cp
        from cupy.cuda import nccl

        x = _contiguous(x)
        out = cp.empty((self.world_size,) + x.shape, x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, nccl.NCCL_UINT8, cp.cuda.get_current_stream().ptr)
        return out

    def all_gather_host(self, values):
        """(world_size, len(values)) int64 NumPy array: every rank's values (host in, host out; all ranks pass the
        same number of values)."""
        import cupy as cp
        import numpy as np

        return cp.asnumpy(self.all_gather(cp.asarray(np.asarray(values, dtype=np.int64))))

    def all_reduce_max(self, values):
        """Element-wise maximum over the ranks of a float64 array (host in, host out)."""
        import cupy as cp
        import numpy as np
        from cupy.cuda import nccl

        x = cp.asarray(np.asarray(values, dtype=np.float64))
        stream = cp.cuda.get_current_stream()
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT64, nccl.NCCL_MAX, stream.ptr)
        return cp.asnumpy(x)

    def destroy(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def init_process_group(device_id: int | None = None) -> ProcessGroup:
    """This process's ProcessGroup, from the launcher's environment; selects its GPU (LOCAL_RANK unless device_id)
    as CuPy's current device. Blocks until every rank has joined."""
    return ProcessGroup(launch_env(), device_id)


def _contiguous(x):
    """x itself if C-contiguous, else a contiguous copy."""
    return x if x.flags.c_contiguous else copy_bits(x)


def copy_bits(x):
    """A C-contiguous copy of x made by its bits (no element-wise kernel of x's dtype, e.g. bfloat16, needed)."""
    import cupy as cp

    from ._sharding import bits_dtype

    return cp.array(x.view(bits_dtype(cp, x.dtype)), order="C", copy=True).view(x.dtype)


class _Pending:
    __slots__ = ("sends", "receives", "done")

    def __init__(self, sends, receives, done):
        self.sends, self.receives, self.done = sends, receives, done


class NcclTransport:
    """The ring's exchanges over NCCL: send to rank + 1, receive from rank - 1, on the group's stream.

    start() makes the transfer wait for the work queued so far on the current (compute) stream and returns at once;
    wait() makes the compute stream wait for the transfer. Sent and received buffers stay referenced until then,
    so CuPy's pool cannot hand their memory to new work while NCCL still reads or writes it."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.next = (group.rank + 1) % group.world_size
        self.prev = (group.rank - 1) % group.world_size
        self.sent_bytes = 0

    def start(self, arrays):
        import cupy as cp
        from cupy.cuda import nccl

        sends = tuple(_contiguous(a) for a in arrays)
        receives = tuple(cp.empty(a.shape, a.dtype) for a in sends)
        self.group.stream.wait_event(cp.cuda.get_current_stream().record())
        stream = self.group.stream.ptr
        nccl.groupStart()
        for s, r in zip(sends, receives):
            self.group.comm.send(s.data.ptr, s.nbytes, nccl.NCCL_UINT8, self.next, stream)
            self.group.comm.recv(r.data.ptr, r.nbytes, nccl.NCCL_UINT8, self.prev, stream)
        nccl.groupEnd()
        self.sent_bytes += sum(s.nbytes for s in sends)
        return _Pending(sends, receives, self.group.stream.record())

    def wait(self, pending: _Pending):
        import cupy as cp

        cp.cuda.get_current_stream().wait_event(pending.done)
        return pending.receives
