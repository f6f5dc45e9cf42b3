"""Previews of a render in progress (`pipeline.preview`): the sampler's clean estimate's first latents decoded as one
window, as a PNG strip, at chosen forwards; a render with previews is bitwise the render without; the request's field
and `h3serve render --preview-dir`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.pipeline.context import RenderContext
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.preview import PREVIEW_LATENTS, STRIP_FRAMES, due, make_preview
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RequestError
from h3serve.pipeline.schedule import clean_estimate
from h3serve.pipeline.video_decode import decode, decode_window

PROMPT = "a lighthouse at dusk, waves on the rocks"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None, Profile.for_device("cpu"))


def test_previews_come_every_n_forwards_before_the_last_and_leave_the_render_bitwise_the_same(engine):
    plain = engine.render(engine.validate(RequestFields(PROMPT, steps=8, seed=5)))
    previews = []
    request = engine.validate(RequestFields(PROMPT, steps=8, seed=5, preview_every=2))
    result = engine.render(request, RenderContext(on_preview=previews.append))
    assert np.array_equal(plain.frames, result.frames) and np.array_equal(plain.audio, result.audio)
    assert [(p.forward, p.forwards) for p in previews] == [(1, 7), (3, 7), (5, 7)]
    assert result.timings["previews"] == pytest.approx(sum(p.seconds for p in previews))
    image = Image.open(io.BytesIO(previews[-1].png))
    assert image.format == "PNG" and image.size == (previews[-1].width, previews[-1].height)
    assert image.size == (4 * 224, 128)  # four frames of the tiny 224x128 canvas, side by side
    # Nobody takes previews: none are made, even when asked for.
    assert "previews" not in engine.render(request).timings


def test_a_preview_is_the_first_window_of_the_clean_estimate_it_was_made_from(engine, monkeypatch):
    """By hand: the denoise loop's estimate after forward 4, decoded again by `make_preview` alone, is the preview the
    render handed on (the loop wrapped to keep the estimate it offered)."""
    import h3serve.pipeline.engine as engine_module

    seen = {}
    denoise = engine_module.denoise

    def keeping(model, video, audio, layout, schedule, on_step=None, on_estimate=None):
        def keep(done, total, estimate):
            seen[done] = (estimate(), layout)
            on_estimate(done, total, estimate)

        return denoise(model, video, audio, layout, schedule, on_step, keep)

    monkeypatch.setattr(engine_module, "denoise", keeping)
    previews = []
    request = engine.validate(RequestFields(PROMPT, steps=6, seed=2, preview_every=4))
    engine.render(request, RenderContext(on_preview=previews.append))
    assert [p.forward for p in previews] == [2]  # half an interval in; the next, 6, is past the 5 forwards
    rows, layout = seen[2]
    assert make_preview(engine.components.video_vae, rows, layout, None, 2, 5).png == previews[0].png


def test_a_preview_decodes_the_first_latents_as_one_window_and_a_window_is_what_the_decode_runs(engine, monkeypatch):
    """`decode_window` on a decode window's latents is bitwise what the decode makes of that window (a one-window
    decode: its frames after the pre-padding), and a preview is the first `PREVIEW_LATENTS` latents through it: the
    strip's first tile is the first frame after the pre-padding."""
    vae = engine.components.video_vae
    cfg = vae.cfg
    z = torch.randn(1, cfg.latent_channels, 9, 4, 6, generator=torch.Generator().manual_seed(3))
    one = z[:, :, : cfg.tokens_chunk_size + cfg.token_overlap]
    assert cfg.decode_plan(one.shape[2])[:2] == (0, 1)
    span = cfg.tokens_chunk_size * cfg.temporal_ratio
    window = decode_window(vae, one)[:, :, cfg.frame_pre_padding : span]
    assert torch.equal(window, decode(vae, one)[:, :, : window.shape[2]])
    head = decode_window(vae, z[:, :, :PREVIEW_LATENTS])
    assert head.shape[2] == PREVIEW_LATENTS * cfg.temporal_ratio
    with pytest.raises(ValueError, match="expected latents"):
        decode_window(vae, z[0])

    import h3serve.pipeline.preview as preview_module

    monkeypatch.setattr(preview_module, "video_latents", lambda vae_, rows, layout: z)  # the rows read back as `z`
    preview = make_preview(vae, torch.empty(0), None, None, 1, 3)
    strip = np.asarray(Image.open(io.BytesIO(preview.png)))
    frames = vae.output_to_rgb(head[:, :, cfg.frame_pre_padding :])[0].numpy()
    assert preview.width == STRIP_FRAMES * min(256, frames.shape[2])
    first = np.asarray(Image.fromarray(frames[0]).resize((preview.width // STRIP_FRAMES, preview.height),
                                                          Image.Resampling.BILINEAR))  # fmt: skip
    np.testing.assert_array_equal(strip[:, : preview.width // STRIP_FRAMES], first)


def test_due_and_the_clean_estimate():
    assert [f for f in range(1, 10) if due(f, 9, 3)] == [1, 4, 7]
    assert [f for f in range(1, 50) if due(f, 49, 5)] == [2, 7, 12, 17, 22, 27, 32, 37, 42, 47]
    assert [f for f in range(1, 50) if due(f, 49, 1)] == list(range(1, 49))  # never after the last forward
    assert [f for f in range(1, 8) if due(f, 7, 6)] == [3]
    assert not any(due(f, 9, 0) for f in range(1, 10))
    x, v, t = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), torch.tensor(0.25)
    assert torch.equal(clean_estimate(x, v, t), torch.tensor([1.375, 1.25]))  # x + 0.75 v
    assert torch.equal(x, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(("steps", "every", "allowed"), [(8, 7, "1..6"), (8, -1, "1..6"), (2, 1, "nothing to preview")])
def test_a_preview_interval_out_of_range_is_refused_naming_what_is_allowed(engine, steps, every, allowed):
    with pytest.raises(RequestError) as err:
        engine.validate(RequestFields(PROMPT, steps=steps, preview_every=every))
    assert err.value.field == "preview_every" and allowed in str(err.value)


def test_render_writes_the_previews_as_files(tmp_path, capsys):
    from h3serve.cli import main

    out, previews = tmp_path / "a.mp4", tmp_path / "previews"
    code = main(["render", PROMPT, "--steps", "8", "--preview-dir", str(previews), "--preview-every", "3", "-o",
                 str(out), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert sorted(p.name for p in previews.iterdir()) == ["preview-001-of-007.png", "preview-004-of-007.png"]
    assert "preview after forward 1/7" in err and "previews" in err.splitlines()[-1]
    code = main(["render", PROMPT, "--steps", "3", "--preview-dir", str(previews), "-o", str(out)])
    assert (
        code != 0
        and "--preview-every 5 (the default): preview_every must be 0 (none) or 1..1" in capsys.readouterr().err
    )


def test_previews_of_a_split_render_are_refused_by_its_admission_before_any_weight_loads(tmp_path, capsys):
    """One rule, one home: `Admission.check_previews` (the engine's shape: its ranks) refuses previews of a split
    render; the command line reaches it through the start-up plan's admission, before any worker starts."""
    from h3serve.cli import main
    from h3serve.config import TINY_DIT
    from h3serve.pipeline.admission import Admission
    from h3serve.pipeline.rules import TINY_RULES

    split = Admission.build("fl2va", TINY_RULES, TINY_DIT, step_cache=False, ranks=2)
    assert not split.previews and not split.frames_stream
    with pytest.raises(RequestError) as err:
        split.validate(RequestFields(PROMPT, steps=8, preview_every=3))
    assert err.value.field == "preview_every" and "split over 2 GPUs" in err.value.message
    split.validate(RequestFields(PROMPT, steps=8, preview_every=0))  # none asked: admitted
    one = Admission.build("fl2va", TINY_RULES, TINY_DIT, step_cache=False)
    assert one.previews and one.validate(RequestFields(PROMPT, steps=8, preview_every=3)).preview_every == 3

    out, previews = tmp_path / "a.mp4", tmp_path / "previews"
    code = main(["render", PROMPT, "--steps", "8", "--preview-dir", str(previews), "--num-gpus", "2", "--device",
                 "cpu", "-o", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "--preview-every 5 (the default): previews come from a render in one process" in err, err
    assert not out.exists() and "split over 2 GPUs" in err
