"""torch.distributed set-up for one TP rank (no Ray here: the executor does the rendezvous)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def dist_backend(device_type: str) -> str:
    """NCCL on GPU, gloo on CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port that is free on this node right now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def local_device(device_type: str) -> torch.device:
    """The device this rank computes on: Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU."""
    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        return device
    return torch.device(device_type)


def init_distributed(
    init_method: str, rank: int, world_size: int, device_type: str, timeout_s: float
) -> None:
    """Join the TP group; blocks until every rank has called it (or `timeout_s` passes).

    NOTE: the timeout also bounds every later collective, so a rank whose peer died is stuck at
    most that long even when nobody kills it (the executor normally kills it first).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this worker process")
    dist.init_process_group(
        backend=dist_backend(device_type),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
