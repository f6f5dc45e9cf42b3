"""The scaling plot: per-forward time and speed-up against GPU count at one shape, ours per profile (from
`dit_step.py --num-gpus` results), with the peers' published points marked as such (docs/parallel.md's sources:
SGLang's 4 and 8 H200 per-forward times at the default request; vLLM-Omni's 2 -> 8 GPU denoise speed-up as a note).
Drawn with Pillow (no plotting package), on the CPU.

    python bench/plot_scaling.py --out bench/results/scaling.png bench/results/<date>-h200-dit-step-split-*.json

Several result files are merged by GPU count (a later file's count replaces an earlier one's); each must be at the
same shape and block count, and the speed-ups are against the merged one-GPU row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

# Published, not measured here (docs/parallel.md names the sources): SGLang 8xH200 0.75 s and 4xH200 1.46 s per
# forward at 1344x768x124 (50 steps, BF16); vLLM-Omni 3.83x on denoise from 2 to 8 H20-3e GPUs.
PUBLISHED = {"SGLang BF16 (published)": {4: 1.46, 8: 0.75}}
PUBLISHED_NOTES = ("vLLM-Omni (published): 3.83x from 2 to 8 GPUs on denoise (H20-3e)",)
COLOURS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75))
GREY = (120, 120, 120)
SIZE = (1400, 660)


def merge(files: list[Path]) -> tuple[dict, str]:
    """Per profile, per GPU count (int): the scaling rows of every file, each row's speed-up recomputed against the
    merged one-GPU row (none without one); and what was run (every file at one shape and block count)."""
    table: dict = {}
    runs = set()
    for f in files:
        data = json.loads(f.read_text())
        if "scaling" not in data:
            raise ValueError(f"{f}: no 'scaling' table (not a dit_step.py --num-gpus result)")
        blocks = data.get("blocks")
        runs.add(data["shape"]["name"] + ("" if blocks is None else f", first {blocks} blocks"))
        suffix = " (simulated: one rank's compute)" if data.get("simulated") else ""
        for profile, rows in data["scaling"].items():
            for n, row in rows.items():
                table.setdefault(profile + suffix, {})[int(n)] = dict(row)
    if len(runs) != 1:
        raise ValueError(f"the results are of different runs: {sorted(runs)}")
    for rows in table.values():
        for row in rows.values():
            row.pop("speedup_vs_1", None)
            if 1 in rows:
                row["speedup_vs_1"] = rows[1]["ms_median"] / row["ms_median"]
    return table, runs.pop()


def plot(table: dict, shape: str, out: Path) -> None:
    published = PUBLISHED if shape == "default" else {}  # the peers' points: the whole model, the default request
    img = Image.new("RGB", SIZE, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    counts = sorted({n for rows in table.values() for n in rows} | {n for p in published.values() for n in p} | {1})
    draw.text((20, 10), f"DiT forward split over GPUs (Ulysses), shape: {shape}", fill="black", font=font)
    left = Panel(draw, font, (70, 60, 680, 540), counts, "per-forward time, s (log)", log_y=True,
                 y_values=[r["ms_median"] / 1e3 for rows in table.values() for r in rows.values()]
                 + [v for p in published.values() for v in p.values()])  # fmt: skip
    top = max(counts)
    right = Panel(draw, font, (770, 60, 1380, 540), counts, "speed-up against 1 GPU", log_y=False,
                  y_values=[1.0, float(top)])  # fmt: skip
    right.line([(n, float(n)) for n in counts], GREY, dashed=True)  # through n at each count (x is log2)
    right.label((top, float(top)), "ideal", GREY)
    legend = []
    for i, (profile, rows) in enumerate(sorted(table.items())):
        colour = COLOURS[i % len(COLOURS)]
        points = sorted((n, r["ms_median"] / 1e3) for n, r in rows.items())
        left.line(points, colour)
        speed = sorted((n, r["speedup_vs_1"]) for n, r in rows.items() if "speedup_vs_1" in r)
        right.line(speed, colour)
        for n, s in speed:
            right.label((n, s), f"{s:.2f}x", colour, row=i)
        legend.append((f"ours, {profile}", colour, False))
    for name, points in published.items():
        left.points(sorted(points.items()), GREY)
        legend.append((name, GREY, True))
    y = 584
    for text, colour, hollow in legend:
        draw.rectangle((70, y + 2, 82, y + 12), outline=colour, fill=None if hollow else colour)
        draw.text((90, y), text, fill="black", font=font)
        y += 16
    for i, note in enumerate(PUBLISHED_NOTES if published else ()):
        draw.text((770, 584 + 16 * i), note, fill=GREY, font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)


class Panel:
    """One chart: x is the GPU count on a log2 axis at `counts`, y linear or log over `y_values`."""

    def __init__(self, draw, font, box, counts, title, log_y, y_values):
        self.draw, self.font, self.box, self.log_y = draw, font, box, log_y
        x0, y0, x1, y1 = box
        self.xmin, self.xmax = math.log2(min(counts)), math.log2(max(counts))
        lo, hi = min(y_values), max(y_values)
        if log_y:
            self.ymin, self.ymax = math.log10(lo) - 0.1, math.log10(hi) + 0.1
        else:
            self.ymin, self.ymax = 0.0, hi * 1.08
        draw.rectangle(box, outline="black")
        draw.text((x0, y0 - 18), title, fill="black", font=font)
        for n in counts:
            x, _ = self.at((n, self._y_of(self.ymin)))
            draw.line((x, y1, x, y1 + 5), fill="black")
            draw.text((x - 4, y1 + 8), str(n), fill="black", font=font)
        draw.text(((x0 + x1) // 2 - 20, y1 + 24), "GPUs", fill="black", font=font)
        for v in self._ticks():
            _, y = self.at((min(counts), v))
            draw.line((x0 - 5, y, x0, y), fill="black")
            draw.line((x0, y, x1, y), fill=(230, 230, 230))
            draw.text((x0 - 45, y - 6), f"{v:g}", fill="black", font=font)

    def _y_of(self, t: float) -> float:
        return 10**t if self.log_y else t

    def _ticks(self) -> list[float]:
        if self.log_y:
            out = []
            for e in range(math.floor(self.ymin), math.ceil(self.ymax) + 1):
                out += [m * 10**e for m in (1, 2, 5) if self.ymin <= math.log10(m * 10**e) <= self.ymax]
            return out
        step = max(1, round(self.ymax / 8))
        return [float(v) for v in range(0, int(self.ymax) + 1, step)]

    def at(self, point: tuple[float, float]) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        n, v = point
        fx = (math.log2(n) - self.xmin) / ((self.xmax - self.xmin) or 1)
        t = math.log10(v) if self.log_y else v
        fy = (t - self.ymin) / ((self.ymax - self.ymin) or 1)
        return x0 + 20 + fx * (x1 - x0 - 40), y1 - fy * (y1 - y0)

    def line(self, points, colour, dashed: bool = False) -> None:
        xy = [self.at(p) for p in points]
        if dashed:
            for (ax, ay), (bx, by) in itertools.pairwise(xy):
                for k in range(0, 20, 2):
                    s, e = k / 20, (k + 1) / 20
                    self.draw.line((ax + (bx - ax) * s, ay + (by - ay) * s, ax + (bx - ax) * e, ay + (by - ay) * e),
                                   fill=colour, width=2)  # fmt: skip
            return
        if len(xy) > 1:
            self.draw.line(xy, fill=colour, width=3)
        for x, y in xy:
            self.draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)

    def points(self, points, colour) -> None:
        for x, y in (self.at(p) for p in points):
            self.draw.rectangle((x - 6, y - 6, x + 6, y + 6), outline=colour, width=2)

    def label(self, point, text: str, colour, row: int = 0) -> None:
        x, y = self.at(point)  # `row`: the n-th label at this point, drawn below the one before
        self.draw.text((x + 6, y - 16 + 12 * row), text, fill=colour, font=self.font)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("results", type=Path, nargs="+", help="dit_step.py --num-gpus result files")
    args = parser.parse_args()
    table, shape = merge(args.results)
    plot(table, shape, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
