"""Tensor-parallel process state: this rank, the group size, and the two collectives.

One process per rank; ``init_tensor_parallel`` joins the group through torch.distributed
(gloo on CPU, nccl on CUDA). At world size 1 nothing is initialised and the collectives
return their input untouched, so a single-process engine pays nothing for TP-readiness.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
# torch.distributed's default rendezvous timeout.
_RENDEZVOUS_TIMEOUT_S = 1800


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         backend: str | None = None) -> None:
    """Join the TP group. ``init_method`` is a torch.distributed URL
    (``tcp://127.0.0.1:PORT`` or ``file:///tmp/...``) shared by all ranks."""
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}.")
    if world_size > 1 and not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        url = urlsplit(init_method)
        if url.scheme == "tcp":
            host, port = url.hostname or "127.0.0.1", int(url.port or 0)
            if _is_loopback(host):
                # gloo/NCCL pick their listening interface from the hostname, which
                # may resolve to a routable address; pin them to loopback like the store.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            store = _tcp_store(host, port, rank, world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _TP_RANK, _TP_SIZE = rank, world_size


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _tcp_store(host: str, port: int, rank: int, world_size: int) -> dist.TCPStore:
    """The rendezvous store. torch's ``tcp://`` init makes rank 0's TCPStore listen on
    every interface ([::]) whatever host the URL names; here rank 0 binds exactly the
    address the other ranks are told to dial (127.0.0.1 on one node) and hands the
    listening socket to the store (``master_listen_fd``)."""
    timeout = timedelta(seconds=_RENDEZVOUS_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    # The store owns the fd from here on (it closes it on destruction); keep the Python
    # object from closing it too when it is collected.
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())


def destroy_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over ranks, in place; the identity at world size 1."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); the identity at world size 1."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


@contextmanager
def tp_rank_override(rank: int, world_size: int) -> Iterator[None]:
    """Build one rank's shard of a model in this process without a process group
    (loading and inspecting weights only; running a TP>1 forward needs the real group)."""
    global _TP_RANK, _TP_SIZE
    saved = _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = saved
