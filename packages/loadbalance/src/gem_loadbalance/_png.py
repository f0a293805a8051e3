"""A line chart written straight to PNG with numpy and zlib (no plotting library needed).

The simulator's ``--plot`` must work on machines without matplotlib, so this module rasterizes
the chart itself: a white canvas, axes with tick labels, one polyline per series (two pixels
thick) and a legend, all text drawn with a built-in 3×5 pixel font scaled up (upper case only).
The PNG is 8-bit RGB, one filter-free scanline per row, compressed by zlib.
"""

import struct
import zlib

import numpy as np

__all__ = ["write_line_chart", "encode_png"]

# 3×5 glyphs, rows top to bottom separated by '/', '#' marks a lit pixel.
_GLYPHS = {
    "A": ".#./#.#/###/#.#/#.#",
    "B": "##./#.#/##./#.#/##.",
    "C": ".##/#../#../#../.##",
    "D": "##./#.#/#.#/#.#/##.",
    "E": "###/#../##./#../###",
    "F": "###/#../##./#../#..",
    "G": ".##/#../#.#/#.#/.##",
    "H": "#.#/#.#/###/#.#/#.#",
    "I": "###/.#./.#./.#./###",
    "J": "..#/..#/..#/#.#/.#.",
    "K": "#.#/#.#/##./#.#/#.#",
    "L": "#../#../#../#../###",
    "M": "#.#/###/###/#.#/#.#",
    "N": "##./#.#/#.#/#.#/#.#",
    "O": ".#./#.#/#.#/#.#/.#.",
    "P": "##./#.#/##./#../#..",
    "Q": ".#./#.#/#.#/##./.##",
    "R": "##./#.#/##./#.#/#.#",
    "S": ".##/#../.#./..#/##.",
    "T": "###/.#./.#./.#./.#.",
    "U": "#.#/#.#/#.#/#.#/###",
    "V": "#.#/#.#/#.#/#.#/.#.",
    "W": "#.#/#.#/###/###/#.#",
    "X": "#.#/#.#/.#./#.#/#.#",
    "Y": "#.#/#.#/.#./.#./.#.",
    "Z": "###/..#/.#./#../###",
    "0": "###/#.#/#.#/#.#/###",
    "1": ".#./##./.#./.#./###",
    "2": "##./..#/.#./#../###",
    "3": "##./..#/.#./..#/##.",
    "4": "#.#/#.#/###/..#/..#",
    "5": "###/#../##./..#/##.",
    "6": ".##/#../###/#.#/###",
    "7": "###/..#/.#./.#./.#.",
    "8": "###/#.#/###/#.#/###",
    "9": "###/#.#/###/..#/##.",
    " ": ".../.../.../.../...",
    ".": ".../.../.../.../.#.",
    ",": ".../.../.../.#./#..",
    ":": ".../.#./.../.#./...",
    "-": ".../.../###/.../...",
    "/": "..#/..#/.#./#../#..",
    "(": ".#./#../#../#../.#.",
    ")": ".#./..#/..#/..#/.#.",
    "%": "#.#/..#/.#./#../#.#",
    "=": ".../###/.../###/...",
    "+": ".../.#./###/.#./...",
    "_": ".../.../.../.../###",
}

_PALETTE = [
    (214, 39, 40),
    (31, 119, 180),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (23, 190, 207),
    (140, 86, 75),
    (127, 127, 127),
]


def encode_png(rgb_HW3: np.ndarray) -> bytes:
    """PNG bytes of an ``[H, W, 3]`` uint8 image."""
    if rgb_HW3.dtype != np.uint8 or rgb_HW3.ndim != 3 or rgb_HW3.shape[2] != 3:
        raise ValueError(f"image must be uint8 [H, W, 3], got {rgb_HW3.dtype} {rgb_HW3.shape}")
    height, width, _ = rgb_HW3.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb_HW3.reshape(height, -1)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


def _text(canvas, x: int, y: int, text: str, *, scale: int = 2, color=(0, 0, 0)) -> int:
    """Draw ``text`` with its top-left corner at (x, y); returns the x after the last glyph."""
    for char in text.upper():
        rows = _GLYPHS.get(char, _GLYPHS[" "]).split("/")
        for row, bits in enumerate(rows):
            for col, bit in enumerate(bits):
                if bit == "#":
                    y0, x0 = y + row * scale, x + col * scale
                    canvas[max(y0, 0) : y0 + scale, max(x0, 0) : x0 + scale] = color
        x += 4 * scale
    return x


def _polyline(canvas, xs: np.ndarray, ys: np.ndarray, color) -> None:
    height, width, _ = canvas.shape
    for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:], strict=True):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        px = np.rint(np.linspace(x0, x1, n)).astype(int)
        py = np.rint(np.linspace(y0, y1, n)).astype(int)
        for dx in (0, 1):
            for dy in (0, 1):
                cx, cy = np.clip(px + dx, 0, width - 1), np.clip(py + dy, 0, height - 1)
                canvas[cy, cx] = color
    if len(xs) == 1:
        x, y = int(xs[0]), int(ys[0])
        canvas[max(y - 1, 0) : y + 2, max(x - 1, 0) : x + 2] = color


def write_line_chart(
    path: str, series: dict[str, np.ndarray], *, title: str, x_label: str, width: int = 1000
) -> None:
    """Draw each series (values per step) as a line against its index and save a PNG."""
    if not series:
        raise ValueError("series must hold at least one named sequence of values")
    values = [np.asarray(v, dtype=np.float64) for v in series.values()]
    if any(v.ndim != 1 or v.size == 0 for v in values):
        raise ValueError("every series must be a non-empty 1-D sequence")
    height = 560
    left, right, top, bottom = 90, 30, 50, 70 + 22 * ((len(series) + 1) // 2)
    canvas = np.full((height + bottom - 70, width, 3), 255, dtype=np.uint8)
    plot_h = height - top - 70
    plot_w = width - left - right
    lo = min(float(v.min()) for v in values)
    hi = max(float(v.max()) for v in values)
    pad = max((hi - lo) * 0.05, 1e-3)
    lo, hi = lo - pad, hi + pad
    n_steps = max(v.size for v in values)

    def to_x(i):
        return left + (np.asarray(i, dtype=np.float64) / max(n_steps - 1, 1)) * plot_w

    def to_y(v):
        return top + (1.0 - (np.asarray(v, dtype=np.float64) - lo) / (hi - lo)) * plot_h

    _text(canvas, left, 14, title, scale=3)
    for tick in np.linspace(lo, hi, 6):
        y = int(round(float(to_y(tick))))
        canvas[y, left : left + plot_w] = (225, 225, 225)
        _text(canvas, 8, y - 5, f"{tick:.3f}")
    for tick in np.unique(np.linspace(0, n_steps - 1, min(n_steps, 6)).round().astype(int)):
        x = int(round(float(to_x(tick))))
        canvas[top + plot_h : top + plot_h + 6, x] = (0, 0, 0)
        _text(canvas, x - 6, top + plot_h + 10, str(tick))
    canvas[top : top + plot_h + 1, left] = (0, 0, 0)
    canvas[top + plot_h, left : left + plot_w + 1] = (0, 0, 0)
    _text(canvas, left + plot_w // 2 - 20, top + plot_h + 30, x_label)
    for i, (name, v) in enumerate(zip(series, values, strict=True)):
        color = _PALETTE[i % len(_PALETTE)]
        _polyline(canvas, to_x(np.arange(v.size)), to_y(v), color)
        lx = left + (i % 2) * (plot_w // 2)
        ly = top + plot_h + 52 + 22 * (i // 2)
        canvas[ly : ly + 10, lx : lx + 24] = color
        _text(canvas, lx + 32, ly, name)
    with open(path, "wb") as f:
        f.write(encode_png(canvas))
