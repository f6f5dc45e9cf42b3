"""Weights that wait in page-locked host memory and come to the device when they run (`pipeline.placement` says
which).

    Streamer   modules of one structure (DiT blocks, text-encoder layers), each packed into its own page-locked host
               buffer, bound for good to one of a ring of device slots (module i to slot i mod slots). Before module i
               runs, its copy is waited for on the compute stream; the next modules' copies are issued on a copy
               stream, each after the event that marks the end of its slot's last compute. Ordered by CUDA events
               only: no host synchronisation. A module whose copy was not prefetched (a step cache skipped blocks)
               is copied when it is needed.
    Visitor    one module (the video VAE) kept in host memory and given device copies of its tensors while it runs.
    OffloadHook a load hook that sends the tensors bound for host memory there as they are read, so a load never holds
               them on the device together.

What runs is unchanged: the kernels see tensors of the same shapes, strides, dtypes and alignment in the same order,
so a streamed render is bitwise equal to a resident one. Regional compile keeps one graph: a streamed block's
tensors are the slot's tensors, of the same metadata as a resident block's.

Host buffers are anonymous mappings (page-aligned, pages of their own) registered with CUDA
(`cudaHostRegister`), so they take exactly their size, not the pinned allocator's next power of two.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 512  # bytes: every tensor in a host buffer starts on this boundary (the CUDA allocator's own alignment)


@dataclass(frozen=True)
class _Entry:
    """One tensor of a streamed module: where it sits in the module and in the module's host buffer."""

    owner: str  # the submodule's path in the module ("" for the module itself)
    attr: str
    param: bool  # a parameter (else a buffer)
    requires_grad: bool
    shape: torch.Size
    stride: tuple[int, ...]  # kept: a compiled block guards on strides (an FP8 scale's (1, N) has strides (1, 1))
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attr}" if self.owner else self.attr


def _entries(module: nn.Module, skip: Callable[[str], bool]) -> list[_Entry]:
    """The layout of `module`'s parameters and buffers that stream (not `skip(name)`), each once, ALIGN-aligned."""
    out, seen, offset = [], set(), 0
    for owner, sub in module.named_modules():
        for kind, tensors in (("param", sub._parameters), ("buffer", sub._buffers)):
            for attr, t in tensors.items():
                name = f"{owner}.{attr}" if owner else attr
                if t is None or skip(name):
                    continue
                if id(t) in seen:
                    raise ValueError(f"{name}: a tensor shared within one module cannot stream")
                seen.add(id(t))
                if not t.is_contiguous():
                    raise ValueError(f"{name}: only contiguous tensors stream (strides {t.stride()})")
                nbytes = t.numel() * t.element_size()
                entry = _Entry(
                    owner, attr, kind == "param", t.requires_grad, t.shape, t.stride(), t.dtype, offset, nbytes
                )
                out.append(entry)
                offset += _aligned(nbytes)
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _size(entries: Sequence[_Entry]) -> int:
    return max((e.offset + _aligned(e.nbytes) for e in entries), default=0)


def _view(buffer: torch.Tensor, entry: _Entry) -> torch.Tensor:
    flat = buffer[entry.offset : entry.offset + entry.nbytes].view(entry.dtype)
    return flat.as_strided(entry.shape, entry.stride)


def _bind(module: nn.Module, entry: _Entry, tensor: torch.Tensor) -> None:
    owner = module.get_submodule(entry.owner)
    if entry.param:
        owner._parameters[entry.attr] = tensor if isinstance(tensor, nn.Parameter) else _param(tensor, entry)
    else:
        owner._buffers[entry.attr] = tensor


def _param(tensor: torch.Tensor, entry: _Entry) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=entry.requires_grad)


class HostBuffer:
    """`size` bytes of host memory in a mapping of their own, page-locked for CUDA when `pin` (unregistered when the
    buffer is collected)."""

    def __init__(self, size: int, pin: bool):
        self.size = size
        # Private: anonymous shared pages would count as shared memory (RSS, a container's shmem accounting).
        self._map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        empty = torch.empty(0, dtype=torch.uint8)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=size) if size else empty
        self.pinned = False
        if pin and size:
            ptr = self.tensor.data_ptr()
            status = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed ({status}): page-locked host memory "
                                   "is exhausted or limited (ulimit -l)")  # fmt: skip
            self.pinned = True
            weakref.finalize(self, _unregister, ptr)


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _pack(module: nn.Module, entries: Sequence[_Entry], pin: bool) -> HostBuffer:
    """A host buffer holding `module`'s streamed tensors as they are now (wherever they are)."""
    host = HostBuffer(_size(entries), pin)
    for entry in entries:
        tensor = getattr(module.get_submodule(entry.owner), entry.attr)
        _view(host.tensor, entry).copy_(tensor)
    return host


class Streamer:
    """Modules of one structure streamed through a ring of `slots` device slots (see the module docstring). Built from
    modules that are loaded (anywhere: the device or host memory); afterwards each module's streamed tensors are its
    slot's, and its own copies are gone. `skip(name)`: tensors that stay as they are (the DiT blocks' AdaLN weights,
    which live where the profile puts them)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        device: torch.device,
        slots: int = 2,
        skip: Callable[[str], bool] = lambda name: False,
    ):
        if not modules:
            raise ValueError("nothing to stream")
        if slots < 1:
            raise ValueError(f"a streamer needs at least one slot, got {slots}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.entries = _entries(modules[0], skip)
        for i, module in enumerate(modules[1:], 1):
            if [(e.name, e.shape, e.stride, e.dtype) for e in _entries(module, skip)] != [
                (e.name, e.shape, e.stride, e.dtype) for e in self.entries
            ]:
                raise ValueError(f"streamed module {i} differs in structure from module 0")
        self.num_slots = min(slots, len(modules))
        self.bytes_per_module = sum(e.nbytes for e in self.entries)
        self.hosts: list[HostBuffer] = []
        for module in modules:  # one module at a time: its tensors are dropped as it is packed
            self.hosts.append(_pack(module, self.entries, pin=self.cuda))
            for entry in self.entries:
                _bind(module, entry, torch.empty(0, dtype=entry.dtype))
        self.slots = [
            {e.name: self._slot_tensor(e) for e in self.entries} for _ in range(self.num_slots)
        ]  # fmt: skip
        for i, module in enumerate(modules):
            for entry in self.entries:
                _bind(module, entry, self.slots[i % self.num_slots][entry.name])
        self.num_modules = len(modules)
        self.handles: list = []  # forward hooks (`hook`)
        self.loaded: list[int | None] = [None] * self.num_slots
        self.copies = 0  # module copies issued (tests: what was prefetched, what was waited for)
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in range(self.num_slots)]
            self.freed = [torch.cuda.Event() for _ in range(self.num_slots)]

    def _slot_tensor(self, entry: _Entry) -> torch.Tensor:
        tensor = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=self.device)
        return _param(tensor, entry) if entry.param else tensor

    @property
    def host_bytes(self) -> int:
        return sum(h.size for h in self.hosts)

    def _copy(self, i: int) -> None:
        slot = i % self.num_slots
        host, tensors = self.hosts[i].tensor, self.slots[slot]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.freed[slot])  # the slot's last compute is done
                for entry in self.entries:
                    tensors[entry.name].copy_(_view(host, entry), non_blocking=True)
                self.copied[slot].record(self.stream)
        else:
            for entry in self.entries:
                tensors[entry.name].copy_(_view(host, entry))
        self.loaded[slot] = i
        self.copies += 1

    def before(self, i: int) -> None:
        """Module i is about to run: its tensors are in its slot (the compute stream waits for them), and the next
        modules' copies are under way in the other slots."""
        slot = i % self.num_slots
        if self.loaded[slot] != i:
            self._copy(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        busy = {slot}
        for ahead in range(1, self.num_slots):
            j = (i + ahead) % self.num_modules  # after the last, the first (the next forward's)
            if j % self.num_slots in busy:  # the ring wraps onto a slot still to be used first (modules % slots)
                break
            busy.add(j % self.num_slots)
            if self.loaded[j % self.num_slots] != j:
                self._copy(j)

    def after(self, i: int) -> None:
        """Module i's kernels are issued: its slot may be refilled once they are done."""
        if self.cuda:
            self.freed[i % self.num_slots].record(torch.cuda.current_stream(self.device))

    def hook(self, modules: Sequence[nn.Module]) -> list:
        """Forward hooks that stream `modules` (the ones this streamer was built from, in order) around their forward:
        for layers whose caller is not ours (the text encoder's). Returns the hooks' handles."""
        handles = []
        for i, module in enumerate(modules):
            handles.append(module.register_forward_pre_hook(lambda m, args, i=i: self.before(i)))
            handles.append(module.register_forward_hook(lambda m, args, out, i=i: self.after(i)))
        self.handles += handles
        return handles

    def close(self) -> None:
        """Remove the hooks and drop the host buffers (page-locked memory is released with them): for modules that
        will not run again (a rank that never encodes a prompt)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.hosts = [], []


class StreamedBlocks:
    """A `BlockWrapper` (`accel.blocks`): the DiT's streamed blocks wait for their weights before they run. Innermost
    of the wrappers, so a block a step cache skips is neither waited for nor counted."""

    def __init__(self, streamer: Streamer, indices: Sequence[int]):
        self.streamer = streamer
        self.ordinal = {index: m for m, index in enumerate(indices)}

    def wrap(self, index: int, block: nn.Module, inner: Callable) -> Callable:
        m = self.ordinal.get(index)
        if m is None:
            return inner
        streamer = self.streamer

        def forward(*args, **kwargs):
            streamer.before(m)
            out = inner(*args, **kwargs)
            streamer.after(m)
            return out

        return forward


class Visitor:
    """One module kept in (page-locked) host memory that visits the device while it runs (`visit()`): its tensors are
    copied in, and dropped when it leaves (the allocator keeps the memory for the next request's activations)."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module = module
        self.device = device
        self.entries = _entries(module, lambda name: False)
        self.host = _pack(module, self.entries, pin=device.type == "cuda")
        self.bytes = sum(e.nbytes for e in self.entries)
        self._bind_host()
        self.visits = 0

    def _bind_host(self) -> None:
        for entry in self.entries:
            view = _view(self.host.tensor, entry)
            _bind(self.module, entry, _param(view, entry) if entry.param else view)

    @contextlib.contextmanager
    def visit(self) -> Iterator[nn.Module]:
        for entry in self.entries:
            tensor = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=self.device)
            tensor.copy_(_view(self.host.tensor, entry), non_blocking=True)
            _bind(self.module, entry, _param(tensor, entry) if entry.param else tensor)
        self.visits += 1
        try:
            yield self.module
        finally:
            self._bind_host()  # the device copies are dropped; the stream's order keeps them until their last use


class OffloadHook:
    """A load hook (`checkpoint.safetensors.LoadHook`) that sends the tensors `host(name)` names to host memory as they
    are read (after the hooks before it in the chain: quantized, merged), so a load holds at most one of them on the
    device at a time."""

    def __init__(self, host: Callable[[str], bool]):
        self.host = host

    def transform(self, name: str, tensor: torch.Tensor) -> Mapping[str, torch.Tensor]:
        if tensor.device.type == "cpu" or not self.host(name):
            return {name: tensor}
        return {name: tensor.to("cpu")}

    def prepare(self, module: nn.Module) -> None:
        pass


class Offloaded:
    """What `attach` put in place on one set of components: the DiTs' block streamers, the text encoder's layer
    streamer, the video VAE's visitor (each None where that part is resident)."""

    def __init__(self) -> None:
        self.dits: dict[str, Streamer] = {}
        self.text: Streamer | None = None
        self.video: Visitor | None = None

    @property
    def host_bytes(self) -> int:
        """Page-locked host bytes the streamed parts take."""
        streamers = [*self.dits.values(), *([self.text] if self.text else [])]
        return sum(s.host_bytes for s in streamers) + (self.video.host.size if self.video else 0)

    def drop_text(self) -> None:
        """The text encoder will not run here again (a split's rank other than 0): its host copies go."""
        if self.text is not None:
            self.text.close()
            self.text = None

    def visiting(self) -> contextlib.AbstractContextManager:
        """The video VAE on the device for the duration (nothing to do where it is resident)."""
        return self.video.visit() if self.video is not None else contextlib.nullcontext()


def attach(
    components,
    device: torch.device,
    dit_streamed: Sequence[int] = (),
    text_streamed: bool = False,
    video_vae_visits: bool = False,
    slots: int = 2,
) -> Offloaded:
    """Stream `dit_streamed` blocks of each DiT (their AdaLN weights and adapter buffers apart), the text encoder's
    decoder layers, and let the video VAE visit, on loaded components (`model.components.Components`), after every
    transform of their weights (`accel.apply`). The DiT's streamer is the innermost layer of its block stack
    (`accel.blocks`)."""
    from h3serve.accel.blocks import BlockStack
    from h3serve.accel.lora import BUFFERS as LORA_BUFFERS
    from h3serve.checkpoint.adapters.read import is_block_adaln

    out = Offloaded()
    blocks_of = {len(dit.blocks) for dit in components.dits.values()}
    if any(not 0 <= i < min(blocks_of) for i in dit_streamed) or len(set(dit_streamed)) != len(dit_streamed):
        raise ValueError(f"streamed blocks {list(dit_streamed)}: each once, of the DiT's {min(blocks_of)} blocks")
    if dit_streamed:
        for kind, dit in components.dits.items():
            blocks = [dit.blocks[i] for i in dit_streamed]
            # AdaLN weights make tables, not forwards; run-time adapters' buffers stay on the device (`accel.lora`).
            skip = lambda name: is_block_adaln(f"blocks.0.{name}") or name.rpartition(".")[2] in LORA_BUFFERS  # noqa: E731
            streamer = Streamer(blocks, device, slots, skip=skip)
            out.dits[kind] = streamer
            stack = BlockStack.of(dit)
            stack.wrappers.insert(0, StreamedBlocks(streamer, dit_streamed))
            stack.install(dit)
    if text_streamed:
        layers = list(components.text_encoder.model.language_model.layers)
        out.text = Streamer(layers, device, slots)
        out.text.hook(layers)
    if video_vae_visits:
        out.video = Visitor(components.video_vae, device)
    return out
