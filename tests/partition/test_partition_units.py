import numpy as np
import pytest

from partition import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20),
    ("2GB", 2 * 10**9),
    ("1.5GiB", 3 * 2**29),
    ("1.5 GiB", 3 * 2**29),
    ("4096", 4096),
    ("4096B", 4096),
    ("10kb", 10_000),
    ("1e9", 10**9),
    ("2e3KiB", 2000 * 1024),
    (".5KiB", 512),
    ("0.0001KiB", 0),  # 0.1024 bytes, rounded down
    ("  3 TiB ", 3 * 2**40),
    ("123456789012345678901234567890", 123456789012345678901234567890),  # exact, no float
])
def test_parse_bytes_strings(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_numbers():
    assert parse_bytes(0) == 0
    assert parse_bytes(np.int64(7)) == 7
    assert parse_bytes(2.0**20) == 2**20
    assert type(parse_bytes(np.int32(3))) is int


@pytest.mark.parametrize("bad", ["", "MiB", "12 apples", "1.2.3GB", "-5MB", "5 M B", "0x10"])
def test_parse_bytes_rejects_bad_strings(bad):
    with pytest.raises(ValueError, match=r"cannot parse memory size .*'512MiB'"):
        parse_bytes(bad)


def test_parse_bytes_ambiguous_prefix_names_both_spellings():
    with pytest.raises(ValueError, match=r"'M' is ambiguous: write 'MB' or 'MiB'"):
        parse_bytes("512M")


@pytest.mark.parametrize("bad, err", [(-1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                      (True, TypeError), (None, TypeError), ([1], TypeError)])
def test_parse_bytes_rejects_bad_values(bad, err):
    with pytest.raises(err, match="memory size"):
        parse_bytes(bad)


def test_parse_bytes_overflow():
    with pytest.raises(ValueError, match="too large"):
        parse_bytes("1e400GB")


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(2**50) == "1.00 PiB"
