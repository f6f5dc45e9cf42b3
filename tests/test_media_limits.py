"""Uploaded keyframes and Ref2VA references: the format allow-list (told from magic bytes, `media.formats`) and the
hard limits checked from the headers before anything is decoded (pixels, frame rate, sample rate, channels).

Refusals are checked on hand-made bytes and on real files that PIL and PyAV encode here; the huge inputs are cheap to
make (a 1-bit PNG, one black H.264 frame) and must be refused in well under the time decoding them would take."""

from __future__ import annotations

import io
import subprocess
import sys
import tracemalloc
import wave
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image, ImageFile

from h3serve.media import formats
from h3serve.media.formats import FormatError, FormatKind, exception_text, sniff
from h3serve.pipeline import references
from h3serve.pipeline.references import (
    AUDIO,
    IMAGE,
    MAX_REFERENCE_FPS,
    MAX_REFERENCE_SAMPLE_RATE,
    MAX_RESAMPLE_KERNEL,
    VIDEO,
    decode_references,
    resample_frames,
    resample_kernel_size,
)
from h3serve.pipeline.rules import RELEASED_RULES, CanvasRule, RequestError, RequestRules, decode_image, resolve_canvas

ACCEPTED_NAMES = "PNG, JPEG, WebP, BMP, TIFF, MP4/MOV/M4A/3GP, Matroska/WebM, AVI, WAV, MP3, FLAC, Ogg, AAC (ADTS)"
IMAGE_NAMES = "PNG, JPEG, WebP, BMP, TIFF"


# ---------------------------------------------------------------- inputs


def image_bytes(fmt: str, size: tuple[int, int] = (64, 48), mode: str = "RGB", **save) -> bytes:
    w, h = size
    pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, format=fmt, **save)
    return buf.getvalue()


PNG = image_bytes("PNG")


def bilevel_png(width: int, height: int) -> bytes:
    """A real PNG of width x height, all black, 1 bit a pixel: 13000x13000 compresses to about 20 KB."""
    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR declaring width x height, then a few bytes of IDAT: no decodable pixels at all."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"\x78\x9c") + chunk(b"IEND", b"")


def wav(rate: int = 16000, channels: int = 1, seconds: float = 0.5) -> bytes:
    n = round(rate * seconds)
    pcm = np.repeat((0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / rate) * 32767).astype("<i2")[:, None], channels, 1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except Exception:
        return False
    return True


def encode(
    container: str,
    video: str | None = None,
    audio: str | None = None,
    *,
    fps: float = 24,
    frames: int = 30,
    size: tuple[int, int] = (64, 48),
    rate: int = 44100,
    layout: str = "mono",
    seconds: float = 1.5,
    options: dict | None = None,
) -> bytes:
    """A real file of `container` with PyAV: a moving gradient in `video`, a sine in `audio`; skips without the
    encoder."""
    for codec in filter(None, (video, audio)):
        if not has_encoder(codec):
            pytest.skip(f"this PyAV build has no {codec} encoder")
    buf = io.BytesIO()
    with av.open(buf, "w", format=container, container_options=options or {}) as out:
        if video:
            vstream = out.add_stream(video, rate=Fraction(fps).limit_denominator(1001))
            vstream.width, vstream.height = size
            vstream.pix_fmt = "yuv420p"
            if video == "libx264":
                vstream.options = {"preset": "ultrafast"}
        if audio:
            astream = out.add_stream(audio, rate=rate)
            astream.layout = layout
        if video:
            w, h = size
            x, y = np.arange(w, dtype=np.uint8), np.arange(h, dtype=np.uint8)  # uint8 arithmetic wraps at 256
            rgb = np.empty((h, w, 3), np.uint8)
            for t in range(frames):
                rgb[..., 0] = x[None, :] * 4 + np.uint8(t * 9 % 256)
                rgb[..., 1] = y[:, None] * 4 + np.uint8(t % 256)
                rgb[..., 2] = t * 20 % 256
                out.mux(vstream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
            out.mux(vstream.encode(None))
        if audio:
            n = round(seconds * rate)
            channels = av.AudioLayout(layout).nb_channels
            pcm = np.tile((0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.float32), (channels, 1))
            convert = av.AudioResampler(format=astream.codec_context.format.name, layout=layout, rate=rate)
            for start in range(0, n, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start : start + 1024]), "fltp", layout)
                frame.sample_rate = rate
                for converted in convert.resample(frame):
                    out.mux(astream.encode(converted))
            out.mux(astream.encode(None))
    return buf.getvalue()


def id3_tag(body: bytes = b"TIT2\x00\x00\x00\x04\x00\x00\x03hi\x00") -> bytes:
    """An ID3v2.4 tag around `body` (one frame), its size written 7 bits a byte ("syncsafe")."""
    n = len(body)
    return b"ID3\x04\x00\x00" + bytes((n >> 21 & 0x7F, n >> 14 & 0x7F, n >> 7 & 0x7F, n & 0x7F)) + body


def refusal(call) -> RequestError:
    with pytest.raises(RequestError) as excinfo:
        call()
    return excinfo.value


# ---------------------------------------------------------------- sniffing hand-made bytes


RIFF = b"RIFF\x24\x00\x00\x00"


@pytest.mark.parametrize(
    ("head", "accepted"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", formats.PNG),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", formats.JPEG),
        (b"\xff\xd8\xff\xe1\x00\x10Exif\x00", formats.JPEG),
        (RIFF + b"WEBPVP8 ", formats.WEBP),
        (b"BM\xf6\x00\x00\x00\x00\x00\x00\x006\x00\x00\x00(\x00\x00\x00", formats.BMP),  # BITMAPINFOHEADER (40)
        (b"BM\xf6\x00\x00\x00\x00\x00\x00\x00\x1a\x00\x00\x00\x0c\x00\x00\x00", formats.BMP),  # OS/2 core header (12)
        (b"II*\x00\x08\x00\x00\x00", formats.TIFF),
        (b"MM\x00*\x00\x00\x00\x08", formats.TIFF),
        (b"II+\x00\x08\x00\x00\x00", formats.TIFF),  # BigTIFF
        (b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00", formats.MP4),
        (b"\x00\x00\x00\x14ftypqt  \x00\x00\x02\x00", formats.MP4),
        (b"\x00\x00\x00\x1cftypM4A \x00\x00\x02\x00", formats.MP4),
        (b"\x00\x00\x00\x1cftyp3gp4\x00\x00\x02\x00", formats.MP4),
        (b"\x1a\x45\xdf\xa3\x9fB\x86\x81\x01", formats.MATROSKA),
        (RIFF + b"AVI LIST", formats.AVI),
        (RIFF + b"WAVEfmt ", formats.WAV),
        (b"RF64\xff\xff\xff\xffWAVEds64", formats.WAV),
        (b"fLaC\x00\x00\x00\x22", formats.FLAC),
        (b"OggS\x00\x02\x00\x00", formats.OGG),
        (b"\xff\xfb\x90\x64\x00\x00", formats.MP3),  # MPEG-1 layer III, 128 kbit/s, 44.1 kHz
        (b"\xff\xf3\x48\xc4\x00\x00", formats.MP3),  # MPEG-2 layer III
        (b"\xff\xfd\x90\x04\x00\x00", formats.MP3),  # MPEG-1 layer II
        (id3_tag() + b"\xff\xfb\x90\x64\x00\x00", formats.MP3),
        (id3_tag() + b"\x00" * 100 + b"\xff\xfb\x90\x64\x00\x00", formats.MP3),  # zero padding after the tag
        (b"\xff\xf1\x50\x80\x02\x1f\xfc", formats.AAC),  # ADTS, MPEG-4, no CRC: layer bits 00
        (b"\xff\xf9\x50\x80\x02\x1f\xfc", formats.AAC),  # ADTS, MPEG-2
        (id3_tag() + b"\xff\xf1\x50\x80\x02\x1f\xfc", formats.AAC),
        (id3_tag() + b"fLaC\x00\x00\x00\x22", formats.FLAC),
    ],
)
def test_each_accepted_format_is_told_from_its_magic_bytes(head, accepted):
    found = sniff(head + bytes(32))
    assert found is accepted
    assert (found.pil_format is None) == (found.kind == FormatKind.CONTAINER)
    assert (found.demuxer is None) == (found.kind == FormatKind.IMAGE)


@pytest.mark.parametrize(
    ("data", "detected"),
    [
        (b"GIF89a\x01\x00\x01\x00\x80\x00\x00", "GIF"),
        (b"GIF87a\x01\x00\x01\x00\x80\x00\x00", "GIF"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "PostScript/EPS"),
        (b"\xc5\xd0\xd3\xc6\x1e\x00\x00\x00", "EPS"),
        (b"8BPS\x00\x01\x00\x00\x00\x00\x00\x00", "PSD"),
        (b"\x00\x00\x01\x00\x01\x00\x10\x10\x00\x00", "ICO"),
        (b"%PDF-1.7\n", "PDF"),
        (b"#EXTM3U\n#EXT-X-VERSION:3\n#EXTINF:10,\nhttp://example.invalid/a.ts\n", "M3U/HLS playlist"),
        (b"ffconcat version 1.0\nfile '/etc/passwd'\n", "FFmpeg concat script"),
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "HEIF/AVIF image"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1", "HEIF/AVIF image"),
        (b"\x47\x40\x00\x10" + bytes(184) + b"\x47\x40\x00\x11" + bytes(200), "MPEG transport stream"),
        (b"not a media file at all", None),
        (b"BM" + bytes(30), None),  # "BM" without a BMP info header size
        (RIFF + b"CDXA", None),  # a RIFF form that is none of WebP, AVI, WAVE
        (b"\xff\xe0\x00\x00\x00\x00", None),  # MPEG audio sync with the reserved layer
        (b"\xff\xfb\xf0\x64\x00\x00", None),  # MPEG audio with the invalid bitrate index 15
        (id3_tag() + b"just text after the tag", "an ID3 tag without MPEG audio after it"),
        (b"ID3\x04\x00\x00\x80\x80\x80\x80", None),  # an ID3 size that is not syncsafe
        (b"", None),
    ],
)
def test_other_formats_are_refused_naming_the_accepted_ones(data, detected):
    with pytest.raises(FormatError) as excinfo:
        sniff(data)
    err = excinfo.value
    assert err.detected == detected
    assert str(err).endswith(f"accepted: {ACCEPTED_NAMES}"), str(err)
    assert (detected or "its format is not recognised") in str(err)


def test_an_accepted_format_of_another_kind_is_named():
    mp4 = b"\x00\x00\x00\x20ftypisom" + bytes(32)
    with pytest.raises(FormatError) as excinfo:
        sniff(mp4, (FormatKind.IMAGE,))
    assert excinfo.value.detected == "MP4/MOV/M4A/3GP" and excinfo.value.accepted == tuple(IMAGE_NAMES.split(", "))
    assert sniff(mp4, (FormatKind.CONTAINER,)) is formats.MP4


def test_the_format_module_is_import_light():
    """Identification reads bytes only: importing it loads none of numpy, PIL, av, torch."""
    code = "import sys, h3serve.media.formats; print(sorted({'numpy', 'PIL', 'av', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- exception texts


def test_exception_text_drops_reprs_and_is_bounded():
    err = Image.UnidentifiedImageError(f"cannot identify image file {io.BytesIO()!r}")
    assert "0x" in str(err)  # the check can fail: PIL's text carries the repr
    assert exception_text(err) == "UnidentifiedImageError: cannot identify image file"
    pyav = "[Errno 1094995529] Invalid data found when processing input: '<none>'"
    assert exception_text(av.error.InvalidDataError(1094995529, pyav)).endswith("when processing input")
    long = exception_text(OSError("x" * 5000))
    assert len(long) == 200 and long.startswith("OSError: xxx") and long.endswith("...")
    assert exception_text(ValueError()) == "ValueError"


# ---------------------------------------------------------------- real files: accepted


@pytest.mark.parametrize(
    ("fmt", "save"),
    [("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {"quality": 90}), ("BMP", {}), ("TIFF", {})],
)
def test_real_images_of_each_accepted_format_decode(fmt, save):
    data = image_bytes(fmt, (64, 48), **save)
    assert sniff(data).pil_format == fmt
    image = decode_image("keyframes", 0, data)
    assert image.mode == "RGB" and image.size == (64, 48)
    (ref,) = decode_references([("x", data), encode("mp4", "libx264", frames=24)])[:1]
    assert ref.kind == IMAGE and ref.source_size == (64, 48)


def test_a_palette_or_grey_tiff_is_converted_to_rgb():
    for mode in ("P", "L", "RGBA"):
        assert decode_image("keyframes", 0, image_bytes("TIFF", mode=mode)).mode == "RGB"


@pytest.mark.parametrize(
    ("container", "video", "audio", "name", "kw"),
    [
        ("mp4", "libx264", "aac", "MP4/MOV/M4A/3GP", {}),
        ("mov", "mpeg4", None, "MP4/MOV/M4A/3GP", {}),
        ("3gp", "mpeg4", None, "MP4/MOV/M4A/3GP", {"size": (176, 144)}),
        ("matroska", "libx264", "aac", "Matroska/WebM", {}),
        ("webm", "libvpx-vp9", "libopus", "Matroska/WebM", {"rate": 48000}),
        ("avi", "mpeg4", "libmp3lame", "AVI", {}),
    ],
)
def test_real_videos_of_each_accepted_container_decode(container, video, audio, name, kw):
    data = encode(container, video, audio, **kw)
    assert sniff(data).name == name
    (ref,) = decode_references([data], num_frames=22)
    assert ref.kind == VIDEO and ref.pixels.shape[0] == 22 and ref.source_size == kw.get("size", (64, 48))
    assert (ref.audio is not None) == (audio is not None)


@pytest.mark.parametrize(
    ("container", "audio", "name", "kw"),
    [
        ("wav", "pcm_s16le", "WAV", {}),
        ("flac", "flac", "FLAC", {}),
        ("mp3", "libmp3lame", "MP3", {}),  # FFmpeg's muxer writes an ID3v2 tag first
        ("mp3", "libmp3lame", "MP3", {"options": {"id3v2_version": "0"}}),  # bare MPEG audio frames
        ("adts", "aac", "AAC (ADTS)", {}),
        ("ipod", "aac", "MP4/MOV/M4A/3GP", {}),  # M4A
        ("ogg", "libopus", "Ogg", {"rate": 48000}),
    ],
)
def test_real_audio_of_each_accepted_container_decodes(container, audio, name, kw):
    data = encode(container, None, audio, layout="stereo", **kw)
    assert sniff(data).name == name
    if "options" in kw:
        assert data[:2] == b"\xff\xfb"  # the check can fail: no tag, the first frame's sync at byte 0
    _, ref = decode_references([PNG, data], num_frames=22)
    assert ref.kind == AUDIO and ref.source_channels == 2 and ref.audio.shape[0] == 2
    assert abs(ref.audio.shape[1] - 22 / 24 * 32000) <= 2  # truncated at its own rate, then resampled


def test_an_id3_tagged_adts_file_is_aac():
    data = id3_tag() + encode("adts", None, "aac")
    assert sniff(data) is formats.AAC
    assert decode_references([PNG, data])[1].kind == AUDIO


# ---------------------------------------------------------------- real files: refused formats


@pytest.mark.parametrize(
    ("data", "detected"),
    [
        (image_bytes("GIF"), "GIF"),
        (image_bytes("ICO", (32, 32)), "ICO"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 48\n0 0 moveto 64 48 lineto stroke\nshowpage\n", "EPS"),
        (b"8BPS\x00\x01" + bytes(6) + b"\x00\x03\x00\x00\x00\x30\x00\x00\x00\x40\x00\x08\x00\x03", "PSD"),
    ],
)
def test_refused_image_formats_as_keyframes_and_references(data, detected):
    err = refusal(lambda: decode_image("keyframes", 1, data, name="in.bin"))
    assert (err.field, err.index, err.name) == ("keyframes", 1, "in.bin")
    assert err.message.startswith("could not be decoded as an image: "), err.message
    assert f"{detected} is not an accepted format" in err.message and err.message.endswith(f"accepted: {IMAGE_NAMES}")
    err = refusal(lambda: decode_references([PNG, ("in.bin", data)]))
    assert (err.field, err.index, err.name) == ("references", 1, "in.bin")
    assert str(err).startswith("references[1] (in.bin) could not be decoded as an image, a video or an audio file")
    assert detected in err.message and err.message.endswith(f"accepted: {ACCEPTED_NAMES}")


def test_a_playlist_is_refused_without_opening_anything(monkeypatch, tmp_path):
    """An HLS playlist (or an FFmpeg concat script) names other files; FFmpeg's probe would pick the demuxer that opens
    them. Here it is refused by its bytes: neither PyAV nor PIL is ever asked to open it."""
    target = tmp_path / "secret.ts"
    target.write_bytes(encode("mpegts", "mpeg4", frames=24))
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:1.0,\nfile://{target}\n#EXT-X-ENDLIST\n".encode()
    concat = f"ffconcat version 1.0\nfile '{target}'\n".encode()

    def forbidden(*args, **kwargs):
        raise AssertionError("a refused upload was handed to a decoder")

    monkeypatch.setattr(av, "open", forbidden)
    monkeypatch.setattr(Image, "open", forbidden)
    for data, detected in ((playlist, "M3U/HLS playlist"), (concat, "FFmpeg concat script")):
        err = refusal(lambda data=data: decode_references([PNG, ("list.m3u8", data)]))
        assert (err.field, err.index) == ("references", 1) and detected in err.message, err.message


# ---------------------------------------------------------------- pixel limits


def test_the_input_pixel_limit_is_16_canvases():
    assert CanvasRule().max_input_pixels == 16 * 768 * 1344 == 16_515_072
    assert CanvasRule(max_pixels=512 * 512).max_input_pixels == 16 * 512 * 512
    assert RELEASED_RULES.canvas.max_input_pixels == 16_515_072


@pytest.fixture
def image_loads(monkeypatch) -> list[tuple[int, int]]:
    """The size of every image whose pixels PIL decodes (`ImageFile.load`, where a lazily opened file is read)."""
    loads: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def counted(self):
        if self.tile:  # pixels still to decode (after the first load the tiles are gone and load returns at once)
            loads.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return loads


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns above 89 MP as it opens
def test_a_huge_png_is_refused_from_its_header_without_its_pixels(image_loads):
    data = bilevel_png(13000, 13000)
    assert len(data) < 100_000  # cheap to send
    limit_before = Image.MAX_IMAGE_PIXELS
    tracemalloc.start()
    try:
        err = refusal(lambda: decode_image("keyframes", 0, data, name="big.png"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (err.field, err.index, err.name) == ("keyframes", 0, "big.png")
    assert err.message == (
        "is a 13000x13000 image (169.0 MP); the limit for an input image is 16.5 MP (16x the largest canvas); "
        "scale it down"
    )
    # Decoding it takes ~0.9 s and 0.5 GB as RGB (21 MB at 1 bit): the header alone was read, no pixel decoded (PIL's
    # own pixel buffers are not Python allocations, so the count says it; the peak says no array was made of them).
    assert image_loads == []
    assert peak < 5_000_000, peak
    assert limit_before == Image.MAX_IMAGE_PIXELS  # PIL's process-wide limit untouched
    err = refusal(lambda: decode_references([("big.png", data)]))
    assert (err.field, err.index, err.name) == ("references", 0, "big.png") and "169.0 MP" in err.message
    assert image_loads == []
    # The count can fail: an image within the limit is decoded, once.
    decode_image("keyframes", 0, bilevel_png(64, 48))
    assert image_loads == [(64, 48)]


def test_an_image_just_over_the_limit_is_refused_and_one_at_it_decodes():
    rule = CanvasRule(max_pixels=128 * 128)  # 16 canvases: 262144 pixels = 512x512
    assert decode_image("keyframes", 0, bilevel_png(512, 512), rule=rule).size == (512, 512)
    err = refusal(lambda: decode_image("keyframes", 0, bilevel_png(513, 512), rule=rule))
    assert "513x512 image (0.3 MP)" in err.message and "the limit for an input image is 0.3 MP" in err.message
    # The rule follows the model: with the released canvas the same image is far within bounds.
    assert decode_image("keyframes", 0, bilevel_png(513, 512)).size == (513, 512)
    # An in-process PIL image is held to the same limit.
    err = refusal(lambda: decode_image("keyframes", 0, Image.new("RGB", (513, 512)), rule=rule))
    assert "513x512" in err.message


def test_a_reference_image_follows_the_request_rules():
    rules = RequestRules(canvas=CanvasRule(max_pixels=128 * 128), reference_short_edge=128)
    err = refusal(lambda: decode_references([("a.png", bilevel_png(600, 600))], rules=rules))
    assert (err.field, err.index, err.name) == ("references", 0, "a.png") and "600x600 image" in err.message


def test_a_header_that_declares_a_bomb_is_refused_before_any_pixel():
    """PIL itself refuses above 2 * MAX_IMAGE_PIXELS (179 MP) without saying the size; below that it only warns. Both
    come out as our limit, from the header of a file that has no pixels to decode."""
    err = refusal(lambda: decode_image("keyframes", 0, png_header_only(100_000, 100_000)))
    assert "the limit for an input image is 16.5 MP" in err.message and "more than 179.0 MP" in err.message
    with pytest.warns(Image.DecompressionBombWarning):
        err = refusal(lambda: decode_image("keyframes", 0, png_header_only(10_000, 10_000)))
    assert err.message.startswith("is a 10000x10000 image (100.0 MP); the limit")
    err = refusal(lambda: decode_image("keyframes", 0, png_header_only(5000, 4000)))
    assert err.message.startswith("is a 5000x4000 image (20.0 MP); the limit")
    # Within the limit, the same kind of file reaches the decoder and fails there, cleanly.
    err = refusal(lambda: decode_image("keyframes", 0, png_header_only(64, 48)))
    assert err.message.startswith("could not be decoded as an image (PNG: ")


def huge_h264(width: int = 4224, height: int = 4224, *, keep_frame: bool = True) -> bytes:
    """One black H.264 frame of width x height in MP4 (~50 KB). Without `keep_frame`, the same stream header with a
    16-byte packet instead of the frame: nothing in it decodes."""
    data = encode("mp4", "libx264", frames=1, size=(width, height))
    if keep_frame:
        return data
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, "w", format="mp4") as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                fake = av.Packet(bytes(16))
                fake.pts, fake.dts, fake.time_base, fake.stream = packet.pts, packet.dts, packet.time_base, stream
                dst.mux(fake)
    return out.getvalue()


class DecodeCounting:
    """An opened container whose `decode` calls are counted in `decodes` (the rest is the container's own)."""

    def __init__(self, container, decodes: list[int]):
        self._container, self._decodes = container, decodes

    def __enter__(self):
        self._container.__enter__()
        return self

    def __exit__(self, *exc):
        return self._container.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._container, name)

    def decode(self, *args, **kwargs):
        self._decodes.append(1)
        return self._container.decode(*args, **kwargs)


@pytest.fixture
def video_decodes(monkeypatch) -> list[int]:
    """One entry for each time a reference video's frames start to be decoded (after the header checks)."""
    decodes: list[int] = []
    open_container = references._open_container
    monkeypatch.setattr(references, "_open_container", lambda *a: DecodeCounting(open_container(*a), decodes))
    return decodes


def test_a_huge_video_frame_is_refused_from_the_stream_header_before_decoding(video_decodes):
    message = (
        "is a video of 4224x4224 frames (17.8 MP); the limit for an input video frame is 16.5 MP (16x the largest "
        "canvas); scale it down"
    )
    data = huge_h264()
    err = refusal(lambda: decode_references([("v.mp4", data)]))
    assert err.message == message and video_decodes == []  # the header said it: no frame was decoded
    # The limit is the request rules': a modest video is over a tiny model's.
    small = RequestRules(canvas=CanvasRule(max_pixels=32 * 32), reference_short_edge=32)  # 16384 pixels
    err = refusal(lambda: decode_references([encode("mp4", "libx264", size=(160, 128))], rules=small))
    assert err.message.startswith("is a video of 160x128 frames (0.0 MP)") and video_decodes == []
    # The count can fail: a video within the limit is decoded.
    decode_references([encode("mp4", "libx264", size=(160, 128))], num_frames=22)
    assert video_decodes == [1]


def test_a_huge_frame_size_whose_frames_do_not_decode_is_refused_by_the_limit():
    """The stream header says 4224x4224, but its one packet holds 16 zero bytes: a refusal that comes from decoding
    would say so. FFmpeg's own probe decode stops at `max_pixels` (and then gives up the size), so the refusal names
    the limit."""
    err = refusal(lambda: decode_references([("v.mp4", huge_h264(keep_frame=False))]))
    assert (err.field, err.index, err.name) == ("references", 0, "v.mp4")
    assert err.message == (
        "has a video stream without a usable frame size (none in its header, or above the 16.5 MP limit for an input "
        "video frame)"
    )


# ---------------------------------------------------------------- frame and sample rates


def test_a_video_above_240_fps_is_refused():
    assert MAX_REFERENCE_FPS == 240
    err = refusal(lambda: decode_references([("fast.mp4", encode("mp4", "libx264", fps=300, frames=30))]))
    assert err.message == "has a video stream at 300 fps; the limit for a reference video is 240 fps"
    (ok,) = decode_references([encode("mp4", "libx264", fps=240, frames=240)], num_frames=22)
    assert ok.source_fps == 240 and ok.pixels.shape[0] == 22


def test_frames_a_high_rate_drops_are_never_kept_and_the_result_is_resample_frames():
    """At 60 fps, 3 in 5 source frames fall on no 24 fps slot. They are decoded (the stream is sequential) but not
    converted or kept; the result equals `resample_frames` over every decoded frame, converted."""
    data = encode("mp4", "libx264", fps=60, frames=90, size=(64, 36))
    (ref,) = decode_references([data], num_frames=22)
    canvas = resolve_canvas(64, 36)
    everything = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            rgb = frame.to_ndarray(format="rgb24")
            everything.append(np.asarray(Image.fromarray(rgb).resize(canvas, Image.Resampling.LANCZOS)))
            if len(everything) == ref.source_frames:
                break
    expected = resample_frames(np.stack(everything), 60.0, 22)
    assert ref.source_frames == 55  # frame 54 starts at slot 22, past the 22 generated: decoding stops there
    assert ref.pixels.shape == expected.shape == (22, 36 * 768 // 36, canvas[0], 3)
    assert np.array_equal(ref.pixels, expected)
    assert not np.array_equal(ref.pixels, np.stack(everything)[:22])  # the check can fail: frames were dropped


def test_audio_sample_rate_and_channel_limits():
    assert MAX_REFERENCE_SAMPLE_RATE == 192_000
    err = refusal(lambda: decode_references([PNG, ("hi.wav", wav(rate=384_000))]))
    assert (err.field, err.index, err.name) == ("references", 1, "hi.wav")
    assert err.message == "has audio at 384000 Hz; the limit for reference audio is 192000 Hz"
    assert decode_references([PNG, wav(rate=192_000, seconds=0.2)])[1].source_sample_rate == 192_000
    err = refusal(lambda: decode_references([PNG, wav(channels=9)]))
    assert err.message == "has audio of 9 channels; mono or stereo is accepted"


def test_an_odd_sample_rate_that_would_need_a_huge_resampler_is_refused_before_any_filter(monkeypatch):
    """44101 Hz reduces with 32 kHz to 44101:32000: a polyphase filter of 32000 phases x 44119 taps (11 GB as float64).
    It is refused from the stream header: no filter is built, no sample decoded. Common rates stay far below the
    bound; 37800 Hz (a CD-ROM XA rate) passes."""
    for rate in (8000, 11025, 16000, 22050, 24000, 32000, 37800, 44100, 48000, 88200, 96000, 176400, 192000):
        assert resample_kernel_size(rate) <= MAX_RESAMPLE_KERNEL, rate
    assert resample_kernel_size(44101) == 32000 * 44119
    filters: list[tuple[int, int]] = []
    sinc_kernel = references._sinc_kernel
    monkeypatch.setattr(
        references, "_sinc_kernel", lambda orig, new: filters.append((orig, new)) or sinc_kernel(orig, new)
    )
    err = refusal(lambda: decode_references([PNG, wav(rate=44101)]))
    assert err.message.startswith("has audio at 44101 Hz, a rate that resamples to 32000 Hz only through a filter")
    assert filters == []
    assert decode_references([PNG, wav(rate=37800)])[1].source_sample_rate == 37800
    assert filters == [(189, 160)]  # the count can fail: 37800:32000 reduces to 189:160, and that filter is built


def test_a_soundtrack_is_held_to_the_audio_limits_unless_muted():
    data = encode("matroska", "libx264", "pcm_s16le", rate=44101, frames=24, seconds=1.0)
    err = refusal(lambda: decode_references([("v.mkv", data)], num_frames=22))
    assert err.message.startswith("has a soundtrack at 44101 Hz")
    (muted,) = decode_references([data], num_frames=22, mute={0})
    assert muted.kind == VIDEO and muted.audio is None


# ---------------------------------------------------------------- messages carry no reprs


@pytest.mark.parametrize(
    "data",
    [
        b"\x89PNG\r\n\x1a\n" + b"garbage" * 10,  # PIL: "cannot identify image file <_io.BytesIO object at 0x...>"
        PNG[: len(PNG) // 2],  # truncated
        image_bytes("JPEG")[:200],
        b"\xff\xd8\xff" + bytes(50),
    ],
)
def test_a_broken_image_message_has_no_python_repr(data):
    for call in (lambda: decode_image("keyframes", 0, data), lambda: decode_references([("a.png", data)])):
        err = refusal(call)
        assert "could not be decoded as an image" in err.message, err.message
        assert "BytesIO" not in str(err) and " at 0x" not in str(err) and "<" not in str(err), str(err)
        assert len(err.message) < 300


@pytest.mark.parametrize(
    "data",
    [
        b"\x1a\x45\xdf\xa3" + b"garbage" * 30,
        b"\x00\x00\x00\x20ftypisom" + bytes(200),
        b"OggS\x00" + bytes(100),
        b"RIFF\x24\x00\x00\x00WAVE" + b"junk" * 10,
        b"\xff\xfb\x90\x64" + bytes(30),
    ],
)
def test_a_broken_container_message_has_no_python_repr(data):
    err = refusal(lambda: decode_references([PNG, ("x.bin", data)]))
    assert (err.field, err.index, err.name) == ("references", 1, "x.bin")
    assert "<" not in str(err) and " at 0x" not in str(err), str(err)
    assert len(err.message) < 300
