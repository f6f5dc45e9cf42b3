"""What a split over N GPUs needs of the model and the profile, checked from configs alone (no torch): every command's
start checks it (`h3serve.startup`, the settings' rules) without touching the hardware; how many GPUs are visible is
the settings' rule."""

from __future__ import annotations

from h3serve.accel.profile import Attention, Linear, Profile
from h3serve.config import DiTConfig
from h3serve.errors import SettingError


def check_split(config: DiTConfig, profile: Profile, num_gpus: int) -> None:
    """SettingError("num_gpus") saying what is allowed: heads that do not divide, HUMMING, CUDNN_FP8, one named GPU."""
    check_heads(config, num_gpus)
    for message in split_refusals(profile.linear, profile.device, num_gpus, profile.attention):
        raise SettingError("num_gpus", f"{num_gpus} GPUs: {message}")


def split_refusals(linear: str | None, device: str | None, num_gpus: int, attention: str | None = None) -> list[str]:
    """Why these linears, attention and device cannot be split over `num_gpus` (the settings' rule and
    `check_split`)."""
    out = []
    if num_gpus > 1 and attention == Attention.CUDNN_FP8:
        out.append("attention CUDNN_FP8 runs on one GPU only (its Q and K scales are shared by all the heads, which a "
                   "split deals out); use CUDNN_ATTN, or one GPU")  # fmt: skip
    if num_gpus > 1 and linear == Linear.HUMMING:
        out.append("linear HUMMING runs on one GPU only (its kernels are not shown to give a row block's bits alone); "
                   "use BF16 or CUTLASS, or one GPU")  # fmt: skip
    if num_gpus > 1 and device is not None and device.startswith("cuda:"):
        out.append(f"device {device} names one GPU; set device cuda (rank r runs on cuda:r)")
    return out


def check_heads(config: DiTConfig, num_gpus: int) -> None:
    """SettingError("num_gpus") unless the DiT's attention heads divide by `num_gpus` (each rank attends over its
    own heads)."""
    if num_gpus < 1:
        raise SettingError("num_gpus", f"must be at least 1, got {num_gpus}")
    heads = config.num_attention_heads
    if heads % num_gpus:
        allowed = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise SettingError(
            "num_gpus", f"{num_gpus}: the DiT's {heads} attention heads do not divide by it (allowed: {allowed})"
        )


def split_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port): an IPv4 address or a host name, and a port of 1 to 65534 (PORT+1 is the group's
    store); ValueError saying what is allowed otherwise. IPv6 is refused: the ranks' interface is looked up by its
    IPv4 address (`group.interface_of`)."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") or ":" in host:
        raise ValueError(f"{text!r}: an IPv6 address is not supported; give node 0's IPv4 address or host name")
    if not colon or not host or not port.isdigit() or not HOST_CHARS.issuperset(host):
        raise ValueError(f"{text!r}: write HOST:PORT, e.g. 192.168.100.1:29500")
    if not 1 <= int(port) <= 65534:
        raise ValueError(f"{text!r}: the port must be 1 to 65534 (PORT+1 is the process group's store)")
    return host, int(port)


HOST_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
