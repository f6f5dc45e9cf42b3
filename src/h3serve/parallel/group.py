"""The ranks' process group and the collectives a render uses: NCCL between GPUs, gloo on the CPU (the tests), over
loopback, every collective bounded by the group's timeout.

Rows are split in contiguous ranges, as even as they go (`row_ranges`): rank r holds rows [start_r, end_r) of the
packed sequence, the first `S mod N` ranks one row more. Nothing is padded for the computation; where a collective
needs equal sizes (`all_gather`), only the message is padded.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def row_ranges(total: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of `n` contiguous, near-even parts of `total` rows (the first `total % n` one longer)."""
    if n < 1 or total < n:
        raise ValueError(f"cannot split {total} rows over {n} ranks (each rank needs at least one row)")
    base, extra = divmod(total, n)
    out, start = [], 0
    for r in range(n):
        end = start + base + (r < extra)
        out.append((start, end))
        start = end
    return out


def interface_of(address: str) -> str:
    """The name of the network interface that holds the IPv4 `address` (`lo` for 127.0.0.1); ValueError naming the
    address when none does (Linux: SIOCGIFADDR)."""
    import fcntl
    import struct

    wanted = socket.gethostbyname(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == wanted:
                return name
    raise ValueError(f"no network interface of this host holds {address}")


def free_port() -> int:
    """A free TCP port on loopback for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class GroupStore:
    """Where the ranks of several hosts meet (`parallel.nodes`): node 0's store at `host:port` (the rendezvous serves
    it for its whole life), under `prefix`, fresh and random for each start of the group, and the address `bind`
    this node's backend listens on (its side of the link between the nodes)."""

    host: str
    port: int
    prefix: str
    bind: str


@dataclass
class Group:
    """This process's rank in a group of `size`, and the device its tensors live on."""

    rank: int
    size: int
    device: torch.device
    # Collectives this rank has entered (point-to-point sends and receives not counted): two ranks that failed at
    # different counts left the group out of step.
    calls: int = 0

    @classmethod
    def join(
        cls, rank: int, size: int, port: int, device: torch.device, timeout_s: float, store: GroupStore | None = None
    ) -> Group:
        """Join the group at `127.0.0.1:port` (one host), or at node 0's `store` (several hosts), NCCL for a CUDA
        device, else gloo; every collective then fails after `timeout_s` instead of waiting for a rank that never
        comes."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        if store is None:
            kwargs["init_method"] = f"tcp://127.0.0.1:{port}"
        else:
            # The backend listens on this node's side of the link only: gloo and NCCL pick their interface by name.
            interface = interface_of(store.bind)
            os.environ["GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"] = interface
            client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout)
            kwargs["store"] = dist.PrefixStore(store.prefix, client)
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
        return cls(rank, size, device)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives --------------------------------------------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        """The lead's `obj` on every rank (`torch.save` bytes, its tensors placed on each rank's device); the lead
        keeps its own object."""
        self.calls += 1
        if self.lead:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(self.device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        if not self.lead:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, 0)
        if self.lead:
            return obj
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=self.device, weights_only=False)

    def agree(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set (every rank gets the same answer at the same point)."""
        self.calls += 1
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `t` over the ranks (a new tensor)."""
        self.calls += 1
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> None:
        """1-D `inp` cut into `in_sizes` parts, part r to rank r; `out` receives rank r's part at its `out_sizes[r]`."""
        self.calls += 1
        dist.all_to_all_single(out, inp, output_split_sizes=out_sizes, input_split_sizes=in_sizes)

    def all_gather(self, flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Every rank's 1-D `flat` (rank r's has `sizes[r]` elements), in rank order; the message is padded to the
        largest."""
        self.calls += 1
        width = max(sizes)
        padded = flat.new_zeros(width)
        padded[: flat.numel()] = flat
        parts = [flat.new_empty(width) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return [p[:n] for p, n in zip(parts, sizes, strict=True)]

    def send(self, t: torch.Tensor, to: int) -> None:
        dist.send(t.contiguous(), to)

    def recv(self, like: torch.Tensor, source: int) -> torch.Tensor:
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(out, source)
        return out
