"""Uploaded media: which format a file is, told from its magic bytes, and the allow-list of formats accepted.

    sniff           encoded bytes -> the `MediaFormat` they are, or FormatError naming the accepted formats
    ACCEPTED        the allow-list: images PNG, JPEG, WebP, BMP, TIFF; containers MP4/MOV/M4A/3GP, Matroska/WebM,
                    AVI, WAV, MP3, FLAC, Ogg, AAC (ADTS)
    exception_text  a decoder's exception as text a client may see: Python reprs removed, length bounded

A file is identified by its leading bytes alone, never by trying decoders on it, and is then opened with that one
decoder: PIL with `formats=[pil_format]`, PyAV with `format=demuxer`. Letting either library probe instead would
reach every format it knows: PIL's EPS plugin runs Ghostscript where one is installed, and FFmpeg's probe picks
playlist demuxers (hls, concat, ...) that open further files or URLs named inside the upload.

Nothing here imports numpy, PIL or av: identification reads bytes only.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum


class FormatKind(StrEnum):
    IMAGE = "image"
    CONTAINER = "container"  # video and/or audio: which, its streams tell once it is opened


@dataclass(frozen=True)
class MediaFormat:
    """One accepted format: what it is called, and the one decoder that opens it."""

    name: str  # for messages: "PNG", "Matroska/WebM"
    kind: FormatKind
    pil_format: str | None = None  # an image's PIL format, for `Image.open(fp, formats=[pil_format])`
    demuxer: str | None = None  # a container's FFmpeg demuxer, for `av.open(fp, format=demuxer)`
    video: bool = False  # a container format that can carry video (False: audio only)


PNG = MediaFormat("PNG", FormatKind.IMAGE, pil_format="PNG")
JPEG = MediaFormat("JPEG", FormatKind.IMAGE, pil_format="JPEG")
WEBP = MediaFormat("WebP", FormatKind.IMAGE, pil_format="WEBP")
BMP = MediaFormat("BMP", FormatKind.IMAGE, pil_format="BMP")
TIFF = MediaFormat("TIFF", FormatKind.IMAGE, pil_format="TIFF")
MP4 = MediaFormat("MP4/MOV/M4A/3GP", FormatKind.CONTAINER, demuxer="mov", video=True)
MATROSKA = MediaFormat("Matroska/WebM", FormatKind.CONTAINER, demuxer="matroska", video=True)
AVI = MediaFormat("AVI", FormatKind.CONTAINER, demuxer="avi", video=True)
WAV = MediaFormat("WAV", FormatKind.CONTAINER, demuxer="wav")
MP3 = MediaFormat("MP3", FormatKind.CONTAINER, demuxer="mp3")
FLAC = MediaFormat("FLAC", FormatKind.CONTAINER, demuxer="flac")
OGG = MediaFormat("Ogg", FormatKind.CONTAINER, demuxer="ogg", video=True)  # Theora video, or Vorbis/Opus/FLAC audio
AAC = MediaFormat("AAC (ADTS)", FormatKind.CONTAINER, demuxer="aac")
ACCEPTED = (PNG, JPEG, WEBP, BMP, TIFF, MP4, MATROSKA, AVI, WAV, MP3, FLAC, OGG, AAC)

# ISO-BMFF major brands of still images (HEIF, AVIF): an `ftyp` box, but not a movie. FFmpeg's mov demuxer would
# open some of them; they are refused by name instead.
_IMAGE_BRANDS = frozenset(b"heic heix heim heis hevc hevx hevm hevs mif1 mif2 msf1 avif avis avio jpgs".split()) | {
    b"crx "
}
# The BMP info header sizes PIL reads (BITMAPCOREHEADER 12 ... BITMAPV5HEADER 124): "BM" alone is a weak signature.
_BMP_HEADER_SIZES = frozenset({12, 40, 52, 56, 64, 108, 124})
# Formats told apart only to name them in a refusal: (leading bytes, name).
_REFUSED = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"%!PS", "PostScript/EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),  # DOS EPS binary header
    (b"%PDF-", "PDF"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x02\x00", "CUR"),
    (b"#EXTM3U", "M3U/HLS playlist"),
    (b"ffconcat", "FFmpeg concat script"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"),
    (b"qoif", "QOI"),
)
_ID3_HEADER = 10
_MAX_ID3_PADDING = 4096  # zero bytes tolerated between an ID3 tag and the first audio frame


class FormatError(ValueError):
    """Bytes of no accepted format (of the kinds asked for). `detected`: the format's name where it is recognised
    (a refused one, such as GIF, or an accepted one of another kind), None otherwise; `accepted`: the names of the
    formats that would have been accepted."""

    def __init__(self, detected: str | None, accepted: tuple[str, ...]):
        self.detected = detected
        self.accepted = accepted
        what = "its format is not recognised" if detected is None else f"{detected} is not an accepted format here"
        super().__init__(f"{what}; accepted: {', '.join(accepted)}")


def sniff(data: bytes, kinds: Collection[FormatKind] = tuple(FormatKind)) -> MediaFormat:
    """The accepted format of `data`, from its leading bytes; FormatError unless it is one of `kinds`."""
    found = _identify(bytes(data[:64]), data)
    if isinstance(found, MediaFormat) and found.kind in kinds:
        return found
    detected = found.name if isinstance(found, MediaFormat) else found
    raise FormatError(detected, tuple(f.name for f in ACCEPTED if f.kind in kinds))


def _identify(head: bytes, data: bytes) -> MediaFormat | str | None:
    """An accepted format, the name of a refused one, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head[:4] in (b"RIFF", b"RF64", b"BW64") and len(head) >= 12:
        form = head[8:12]
        if head[:4] == b"RIFF" and form == b"WEBP":
            return WEBP
        if head[:4] == b"RIFF" and form == b"AVI ":
            return AVI
        if form == b"WAVE":
            return WAV
        return None
    if head.startswith(b"BM") and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_HEADER_SIZES:
        return BMP
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):  # classic TIFF and BigTIFF, either byte order
        return TIFF
    if head[4:8] == b"ftyp" and len(head) >= 12:
        return "HEIF/AVIF image" if head[8:12] in _IMAGE_BRANDS else MP4
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # EBML, the header of Matroska and WebM
        return MATROSKA
    if head.startswith(b"OggS\x00"):
        return OGG
    if head.startswith(b"fLaC"):
        return FLAC
    if head.startswith(b"ID3"):
        return _after_id3(data)
    audio = _audio_frame(head)
    if audio is not None:
        return audio
    for magic, name in _REFUSED:
        if head.startswith(magic):
            return name
    if len(data) > 188 and data[0] == data[188] == 0x47:  # a sync byte every 188 bytes
        return "MPEG transport stream"
    return None


def _audio_frame(head: bytes) -> MediaFormat | None:
    """MP3 or AAC from a frame header at the start of `head`. Both begin with a run of 1 bits (MPEG audio 11, ADTS
    12); ADTS has layer bits 00, which MPEG audio reserves, so the layer tells them apart."""
    if len(head) < 4 or head[0] != 0xFF:
        return None
    b1, b2 = head[1], head[2]
    if b1 & 0xF6 == 0xF0:  # ADTS: 12 sync bits, MPEG version bit, layer 00
        return AAC if (b2 >> 2) & 0x0F < 13 else None  # sampling frequency index 13-15: reserved/escape
    version, layer = (b1 >> 3) & 0x03, (b1 >> 1) & 0x03
    bitrate, sampling = b2 >> 4, (b2 >> 2) & 0x03
    if b1 & 0xE0 == 0xE0 and version != 0b01 and layer != 0b00 and bitrate != 0x0F and sampling != 0b11:
        return MP3  # MPEG-1/2/2.5 audio, layer I-III: FFmpeg's mp3 demuxer reads them all
    return None


def _after_id3(data: bytes) -> MediaFormat | str | None:
    """What follows an ID3v2 tag: MPEG audio (MP3), or ADTS (AAC) or FLAC, which some taggers prefix with one."""
    if len(data) < _ID3_HEADER or data[3] not in (2, 3, 4) or any(b & 0x80 for b in data[6:10]):
        return None
    start = _ID3_HEADER + ((data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9])  # a "syncsafe" size
    if data[3] == 4 and data[5] & 0x10:  # an ID3v2.4 footer
        start += _ID3_HEADER
    end = min(len(data), start + _MAX_ID3_PADDING)
    while start < end and data[start] == 0:
        start += 1
    head = bytes(data[start : start + 16])
    if head.startswith(b"fLaC"):
        return FLAC
    found = _audio_frame(head)
    return found if found is not None else "an ID3 tag without MPEG audio after it"


# A Python object's default repr, as exception texts carry them ("<_io.BytesIO object at 0x7f...>"), and PyAV's
# placeholder for a file without a name ("'<none>'").
_REPR = re.compile(r"'?<[^<>\n]{0,200} at 0x[0-9a-fA-F]+>'?|'<none>'")
EXCEPTION_TEXT_LIMIT = 200


def exception_text(exc: BaseException, limit: int = EXCEPTION_TEXT_LIMIT) -> str:
    """`exc` as "Type: message" for a client: object reprs removed, whitespace folded, at most `limit` characters."""
    text = " ".join(_REPR.sub("", str(exc)).split()).rstrip(" :;,")
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."
