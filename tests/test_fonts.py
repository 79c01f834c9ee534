"""Labels OpenCV's ASCII-only font cannot draw come out in an installed font that has their characters."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from utils import fonts
from utils.drawing import Annotator, draw_box_label


def drawn(label: str) -> np.ndarray:
    image = np.zeros((120, 200, 3), np.uint8)
    return draw_box_label(image, [20, 60, 180, 110], label, color=(0, 0, 255), line_width=3)


def test_a_cyrillic_label_is_drawn_in_a_font_that_has_it_not_as_question_marks():
    import cv2
    from matplotlib.ft2font import FT2Font

    path = fonts.font_file(frozenset("кошка"))
    assert path is not None and all(FT2Font(path).get_char_index(ord(c)) for c in "кошка")
    (_, text_h), _ = cv2.getTextSize("A", cv2.FONT_HERSHEY_SIMPLEX, 1.0, 2)  # the label's height at width 3
    width = fonts.text_width("кошка 0.91", text_h + 3)
    patch = np.zeros((text_h + 3, width, 3), np.uint8)
    patch[:] = (0, 0, 255)
    fonts.draw_text(patch, 0, 0, "кошка 0.91", text_h + 3, (255, 255, 255))
    assert (patch != (0, 0, 255)).any(axis=2).sum() > 50  # white text on the label's red
    image = drawn("кошка 0.91")
    assert np.array_equal(image[60 - text_h - 3:60, 21:20 + width], patch[:, 1:])  # above the box, as ASCII's
    ascii_image = drawn("cat 0.91")  # ASCII: OpenCV's font, as before
    assert (ascii_image[60 - text_h - 3:60, 20:60] == (255, 255, 255)).all(axis=2).any()


def test_a_label_no_installed_font_covers_is_drawn_and_said_once(caplog, monkeypatch):
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    dejavu = font_manager.findfont("DejaVu Sans")  # matplotlib's own: no emoji, no Thai
    text = "\U0001F600\u0e01"
    assert not all(FT2Font(dejavu).get_char_index(ord(c)) for c in text)
    monkeypatch.setattr(fonts, "_candidates", lambda: (dejavu,))
    fonts.font_file.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="utils.fonts"):
            assert fonts.font_file(frozenset(text)) == dejavu  # the one with most of them
            fonts.font_file(frozenset(text))
        patch = np.zeros((20, 60, 3), np.uint8)
        fonts.draw_text(patch, 50, -5, text, 20, (255, 255, 255))  # partly outside: cut, not an error
    finally:
        fonts.font_file.cache_clear()
    assert patch[:, 50:].any() and not patch[:, :50].any()
    assert sum("no installed font has every character" in message for message in caplog.messages) == 1
    calls = []
    monkeypatch.setattr(fonts, "_candidates", lambda: calls.append(1) or (dejavu,))
    fonts.font_file.cache_clear()
    for score in ("0.91", "0.87", "0.50"):  # one search for a class's labels, whatever their scores
        fonts.label_font(f"кошка {score}", 20)
    assert len(calls) == 1
    fonts.font_file.cache_clear()


@pytest.mark.parametrize("pil", [False, True])
def test_annotator_draws_a_non_ascii_label(pil):
    image = np.zeros((120, 200, 3), np.uint8)
    annotator = Annotator(image, line_width=3, pil=pil)
    assert annotator.pil == pil and Annotator(image.copy(), example="кошка").pil  # YOLOv5's rule
    annotator.box_label([20, 60, 180, 110], "кошка", color=(0, 0, 255))
    annotator.text((100, 92) if pil else (100, 115), "пёс", txt_color=(0, 255, 0))  # PIL: top-left; OpenCV: baseline
    result = annotator.result()
    assert (result[20:60, 20:120] != 0).any() and tuple(result[85, 20]) == (0, 0, 255)
    assert (result[90:120, 100:160, 1] > 128).sum() > 20  # the text, green


def test_the_metric_plots_take_a_font_that_has_the_class_names(monkeypatch, tmp_path):
    from matplotlib import font_manager

    import utils.plots as plots
    from utils.data import plots as data_plots

    serif = font_manager.findfont("DejaVu Serif")  # stands for the font found for the names
    monkeypatch.setattr(fonts, "font_file", lambda characters: serif)
    figures = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(Path(path).name, fig))
    names = ["кошка", "собака"]
    plots.plot_confusion_matrix(np.eye(3), tmp_path / "cm.png", names)
    plots.plot_pr_curve(np.linspace(0, 1, 5), np.ones((2, 5)), np.ones((2, 10)), tmp_path / "pr.png", names)
    ticks = figures["cm.png"].axes[0].get_xticklabels()
    assert [t.get_text() for t in ticks] == [*names, "background"]
    assert {t.get_fontproperties().get_file() for t in ticks} == {serif} and ticks[0].get_fontsize() == 10
    legend = figures["pr.png"].axes[0].get_legend().get_texts()
    assert legend[0].get_text().startswith("кошка") and legend[0].get_fontproperties().get_file() == serif
    assert fonts.names_font(["cat", "dog"]) is None  # ASCII: matplotlib's own font
    labels = data_plots.plot_labels(np.array([[0, 0.5, 0.5, 0.2, 0.2], [1, 0.3, 0.3, 0.1, 0.1]]), names, tmp_path)
    assert labels.is_file()
