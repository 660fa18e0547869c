"""The fault-injection harness itself: each outcome is seen and attributed to its fault."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fuzzutil

THIS = Path(__file__).resolve()


_VALUES = list(range(100, 140))
_CLEAN = "\n".join(map(str, _VALUES)) + f"\nsum {sum(_VALUES)}\n"


class _Numbers:
    """A toy format: one integer a line, with a final checksum line (their sum)."""

    errors = (ValueError,)

    def make(self, directory: Path) -> list[str]:
        (directory / "numbers.txt").write_text(_CLEAN)
        return ["numbers.txt"]


class Checked(_Numbers):
    def load(self, directory: Path):
        path = directory / "numbers.txt"
        try:
            *lines, last = path.read_bytes().decode("ascii").strip().split("\n")
            values = [int(v) for v in lines]
            word, total = last.split(" ")
            ok = word == "sum" and int(total) == sum(values)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path}: not a numbers file ({e})") from e
        if not ok:
            raise ValueError(f"{path}: checksum mismatch")
        return values


class Unchecked(_Numbers):
    """Ignores the checksum: corrupted digits load silently changed."""

    def load(self, directory: Path):
        text = (directory / "numbers.txt").read_bytes().decode("latin1")
        return text


class UncheckedWithReference(Unchecked):
    """Any text is a valid file of this format: the reference reads it the same way."""

    def reference(self, directory: Path):
        return (directory / "numbers.txt").read_bytes().decode("latin1")


class UncheckedWrongReference(Unchecked):
    """The reference (the format's rule: the last line is the sum) refuses what load accepts."""

    def reference(self, directory: Path):
        return Checked().load(directory)


class Crashing(_Numbers):
    """Dies by a signal on anything but the clean file."""

    def load(self, directory: Path):
        text = (directory / "numbers.txt").read_text(errors="replace")
        if text != _CLEAN:
            os.abort()
        return text


class Anonymous(_Numbers):
    """Refuses corrupted files with the right type but without naming the file."""

    def load(self, directory: Path):
        text = (directory / "numbers.txt").read_text(errors="replace")
        if text != _CLEAN:
            raise ValueError("bad input")
        return text


class Broken(_Numbers):
    def load(self, directory: Path):
        raise ValueError("cannot even load the clean file")


def test_checked_format_is_refused_or_identical():
    report = fuzzutil.check(f"{THIS}::Checked", count=60, seed=1)
    assert report.counts["refused"] > 40
    assert report.counts["crashed"] == report.counts["changed"] == 0


@pytest.mark.slow
def test_silent_change_is_reported():
    report = fuzzutil.run(f"{THIS}::Unchecked", count=20, seed=2)
    assert report.counts["changed"] == 20
    with pytest.raises(AssertionError, match="accepted wrongly"):
        fuzzutil.check(f"{THIS}::Unchecked", count=5, seed=2)


def test_reference_separates_valid_changes_from_silent_ones():
    report = fuzzutil.check(f"{THIS}::UncheckedWithReference", count=20, seed=2)
    assert report.counts["valid-change"] == 20 and "20 loaded a different valid file" in str(report)
    report = fuzzutil.run(f"{THIS}::UncheckedWrongReference", count=20, seed=2)
    assert report.counts["changed"] == 20, report
    assert all("the reference refuses these bytes: ValueError" in f for f in report.failures)


@pytest.mark.slow
def test_crash_is_attributed_and_the_run_goes_on():
    report = fuzzutil.run(f"{THIS}::Crashing", count=4, seed=3)
    assert report.counts["crashed"] == 4, report
    assert all("crashed (died with exit status" in f for f in report.failures)
    assert {f.split(":")[0] for f in report.failures} == {f"fault {i}" for i in range(4)}


def test_unnamed_file_is_a_wrong_error():
    report = fuzzutil.run(f"{THIS}::Anonymous", count=3, seed=4)
    assert report.counts["wrong-error"] == 3, report


def test_target_that_cannot_load_its_clean_files_is_an_error():
    with pytest.raises(RuntimeError, match="failed before any fault"):
        fuzzutil.run(f"{THIS}::Broken", count=2, seed=4)


def test_mutations_always_change_the_bytes():
    data = bytes(range(256)) * 4
    for fault in fuzzutil.plan({"f": len(data)}, 300, seed=5):
        assert fuzzutil.mutate(data, fault) != data, fault
    assert fuzzutil.mutate(b"", fuzzutil.Fault(0, "f", "truncate", 0, 7)) != b""
