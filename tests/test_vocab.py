"""The shared vocabulary: the frame grid against hand-computed values, the task -> DiT mapping, `vocab` as a leaf."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3serve.vocab import (
    BASE_TASKS,
    SMOKE_REQUEST,
    TASK_ANCHORS,
    DiTKind,
    ReferenceKind,
    Task,
    TaskType,
    dit_kind,
    latent_frames,
    on_grid,
    seconds_to_frames,
    snap_down,
    snap_up,
)

# 17n + 5 with n >= 1: 22, 39, 56, 73, 90, 107, 124, ..., 362 (n = 21); 5n + 2 latent frames each.
GRID = {22: 7, 39: 12, 56: 17, 73: 22, 124: 37, 362: 107}


@pytest.mark.parametrize(
    "asked,up", [(1, 22), (5, 22), (21, 22), (22, 22), (23, 39), (38, 39), (39, 39), (40, 56), (120, 124), (362, 362)]
)
def test_snap_up(asked, up):
    assert snap_up(asked) == up


@pytest.mark.parametrize("frames,down", [(22, 22), (23, 22), (38, 22), (39, 39), (55, 39), (56, 56), (400, 396)])
def test_snap_down(frames, down):
    assert snap_down(frames) == down


def test_snap_down_below_one_clip_is_refused():
    with pytest.raises(ValueError, match="21 frames hold no 17n"):
        snap_down(21)


@pytest.mark.parametrize("frames,latents", GRID.items())
def test_latent_frames(frames, latents):
    assert on_grid(frames) and latent_frames(frames) == latents


@pytest.mark.parametrize("frames", [5, 21, 23, 123, 125])
def test_latent_frames_off_the_grid_is_refused(frames):
    assert not on_grid(frames)
    with pytest.raises(ValueError, match=r"17n\+5 \(n >= 1\)"):
        latent_frames(frames)


def test_the_grid_helpers_agree():
    for n in range(1, 400):
        up = snap_up(n)
        assert on_grid(up) and up >= n and (up - n < 17 or up == 22)
        if n >= 22:
            down = snap_down(n)
            assert on_grid(down) and n - 17 < down <= n


def test_smoke_request_is_the_production_shape():
    assert (SMOKE_REQUEST.width, SMOKE_REQUEST.height, SMOKE_REQUEST.seconds) == (768, 448, 2.0)
    assert seconds_to_frames(2.0) == 48 and SMOKE_REQUEST.num_frames == 56
    assert seconds_to_frames(0.01) == 1


def test_tasks_and_dits():
    assert [str(t) for t in Task] == ["t2va", "i2va", "l2va", "fl2va", "ref2va"]
    assert BASE_TASKS == (Task.T2VA, Task.I2VA, Task.L2VA, Task.FL2VA) == tuple(TASK_ANCHORS)
    assert TASK_ANCHORS["fl2va"] == ("first", "last")  # a plain string looks an enum key up
    assert [dit_kind(t) for t in Task] == [DiTKind.FL2VA] * 4 + [DiTKind.REF2VA]
    assert dit_kind("ref2va") is DiTKind.REF2VA
    with pytest.raises(ValueError):
        dit_kind("v2va")
    assert TaskType("both").kinds == (DiTKind.FL2VA, DiTKind.REF2VA)
    assert TaskType.REF2VA.kinds == (DiTKind.REF2VA,)
    assert [str(k) for k in ReferenceKind] == ["image", "video", "audio"]
    assert repr(Task.T2VA) == "'t2va'" and f"{ReferenceKind.VIDEO!r}" == "'video'"  # messages read as the string


def test_vocab_is_a_leaf():
    """Importing the vocabulary loads no other layer: only `config` of h3serve, and neither torch nor transformers."""
    code = (
        "import sys, h3serve.vocab; "
        "print(sorted(m for m in sys.modules if m.startswith('h3serve') or m in ('torch', 'transformers', 'PIL')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['h3serve', 'h3serve.config', 'h3serve.vocab']"
