"""`h3serve render` speaks in the flags the user typed: notes and errors name `--seconds`/`--frames`/`--width`, a side
given alone is told what is wrong with it, an unknown flag gets the subcommand's usage, and one forward is singular.
Each case is refused (or noted) before any weight loads."""

from __future__ import annotations

import pytest

from h3serve.cli import main


def render(capsys, tmp_path, *flags: str) -> tuple[int, str]:
    code = main(["render", "a fox; then snow", "-o", str(tmp_path / "fox.mp4"), "--no-progress", *flags])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--width", "250"), "h3serve: error: --width 250: width must be a positive multiple of 32, got 250"),
        (("--height", "100000"), "h3serve: error: --height 100000: height 100000 is above the canvas area cap"),
        (("--width", "256"), "h3serve: error: --width 256: width and height must be given together"),
        (("--frames", "400"), "h3serve: error: --frames 400: num_frames must be 22..362"),
        (("--seconds", "30"), "h3serve: error: --seconds 30: num_frames must be 22..362"),
        (("--steps", "1"), "h3serve: error: --steps 1: "),
        (("--video-shift", "-1"), "h3serve: error: --video-shift -1.0: video_shift must be a finite number > 0"),
    ],
)
def test_a_refused_request_value_names_the_flag_typed(capsys, tmp_path, flags, expected):
    code, err = render(capsys, tmp_path, *flags)
    assert code == 1 and expected in err, err
    assert not list(tmp_path.iterdir())


def test_a_snapped_length_is_noted_under_the_flag_typed(capsys, tmp_path):
    # --steps 1 stops it after the notes: the length was read, the request refused before anything loads
    _, err = render(capsys, tmp_path, "--seconds", "0.5", "--steps", "1")
    assert "note: --seconds 0.5 is 12 frames at 24 fps, snapped up to 22 (17n+5)" in err, err
    _, err = render(capsys, tmp_path, "--frames", "30", "--steps", "1")
    assert "note: --frames 30 snapped up to 39 (17n+5)" in err, err
    assert "num_frames" not in err


def test_an_unknown_flag_is_refused_by_the_subcommand_in_one_line(capsys, tmp_path):
    # One line, not render's 40 lines of usage (issue 54): the subcommand's name, and where its flags are listed.
    with pytest.raises(SystemExit) as exit_:
        render(capsys, tmp_path, "--bogus")
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err == "h3serve render: error: --bogus is not a flag of h3serve render (h3serve render --help lists them)\n"


def test_one_forward_is_singular(capsys, tmp_path):
    code, err = render(capsys, tmp_path, "--steps", "2", "--width", "64", "--height", "64")
    assert code == 0, err
    assert "2 grid points (1 DiT forward)," in err, err
