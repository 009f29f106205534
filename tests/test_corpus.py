"""The text the project calibrates and evaluates on: deterministic, and split so that evaluation never sees
calibration text and the texts that choose what is published never score it."""

from __future__ import annotations

import pytest

from peft_kvcache.lab.corpus import prose_texts, read_texts, stdlib_files, stdlib_root, stdlib_texts


def test_calibration_and_evaluation_files_are_disjoint_and_stable():
    calibration, evaluation = set(stdlib_files("calibration")), set(stdlib_files("evaluation"))
    assert calibration and evaluation and not calibration & evaluation
    assert list(stdlib_texts("calibration", 3)) == list(stdlib_texts("calibration", 5))[:3]  # a fixed order
    assert set(stdlib_texts("calibration", 4, skip=4)).isdisjoint(stdlib_texts("calibration", 4))
    # the texts themselves, not only the file lists: evaluation text is never calibration text
    assert set(stdlib_texts("evaluation", 40)).isdisjoint(stdlib_texts("calibration", 200))
    assert set(stdlib_texts("evaluation", 40)) <= {path.relative_to(stdlib_root()).as_posix() for path in evaluation}


def test_benchmark_roles_use_disjoint_texts():
    from benchmarks.siblings import ROLES

    final, selection = ROLES["final"], ROLES["selection"]
    for kind in ("code", "prose"):
        assert final[kind][1] <= selection[kind][0]  # the ranges do not overlap


def test_prose_is_not_python_and_reading_a_folder_names_every_file(tmp_path):
    if not prose_texts.__defaults__ or not stdlib_files("evaluation"):
        pytest.skip("no corpus")
    texts = prose_texts(2)
    assert all(not name.endswith(".py") for name in texts)
    for name in ("a.py", "sub/b.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n" * 10)
    read, description = read_texts(str(tmp_path), "calibration", None)
    assert sorted(read) == ["a.py", "sub/b.txt"] and description.startswith("2 distinct files")
