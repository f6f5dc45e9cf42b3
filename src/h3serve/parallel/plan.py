"""What a split over N GPUs needs of the model and the profile, checked from configs alone (no torch): every command's
start checks it (`h3serve.startup`, the settings' rules) without touching the hardware; how many GPUs are visible is
the settings' rule."""

from __future__ import annotations

from h3serve.accel.profile import Attention, Linear, Profile
from h3serve.config import DiTConfig
from h3serve.errors import SettingError, whole_number


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


def check_heads(config: DiTConfig, num_gpus: int, nnodes: int = 1) -> None:
    """SettingError unless the DiT's attention heads divide by the ranks, `num_gpus` on each of `nnodes` nodes (each
    rank attends over its own heads). It names H3_NNODES where this node's GPUs alone divide them (the nodes are what
    does not fit), else H3_NUM_GPUS."""
    if num_gpus < 1:
        raise SettingError("num_gpus", f"must be at least 1, got {num_gpus}")
    heads, ranks = config.num_attention_heads, num_gpus * nnodes
    if heads % ranks:
        allowed = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        setting = "nnodes" if nnodes > 1 and heads % num_gpus == 0 else "num_gpus"
        given = f"{num_gpus}" if nnodes == 1 else ranks_text(num_gpus, nnodes)
        raise SettingError(
            setting, f"{given}: the DiT's {heads} attention heads do not divide by it (allowed: {allowed})"
        )


def split_setting(num_gpus: int, nnodes: int) -> str:
    """The setting a refused split names: H3_NNODES where this node has one GPU (the nodes make the split), else
    H3_NUM_GPUS."""
    return "nnodes" if num_gpus == 1 and nnodes > 1 else "num_gpus"


def ranks_text(num_gpus: int, nnodes: int) -> str:
    """`4 GPUs`, or with several nodes `8 ranks (2 nodes x 4 GPUs)`."""
    if nnodes == 1:
        return f"{num_gpus} GPUs"
    return f"{num_gpus * nnodes} ranks ({nnodes} nodes x {num_gpus} GPU{'s' if num_gpus > 1 else ''})"


def split_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port): an IPv4 address or a host name, and a port of 1 to 65534 (PORT+1 is the group's
    store); ValueError saying what is allowed otherwise. IPv6 is refused: the ranks' interface is looked up by its
    IPv4 address (`group.interface_of`)."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") or ":" in host:
        raise ValueError(f"{text!r}: an IPv6 address is not supported; give node 0's IPv4 address or host name")
    if not colon or not host or not HOST_CHARS.issuperset(host):
        raise ValueError(f"{text!r}: write HOST:PORT, e.g. 192.168.100.1:29500")
    try:
        number = whole_number(port)
    except ValueError as err:
        raise ValueError(f"{text!r}: the port {err}, got {port!r}") from None
    if not 1 <= number <= 65534:
        raise ValueError(f"{text!r}: the port must be 1 to 65534 (PORT+1 is the process group's store)")
    return host, number


HOST_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
