import pytest

from oomdoc.sizes import format_bytes, parse_size, parse_tolerance


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 * 1024**2),
        ("16GiB", 16 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("1048576", 1048576),
        ("2 KiB", 2048),
        ("3kb", 3000),
        (".5GiB", 512 * 1024**2),
        ("1TiB", 1024**4),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1.2.3GB", "12XB", "-1MiB", "0", "0.1", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1024, "1.00 KiB"),
        (2 * 1024**3, "2.00 GiB"),
        (-3 * 1024**2, "-3.00 MiB"),
        (None, "?"),
    ],
)
def test_format_bytes(value, expected):
    assert format_bytes(value) == expected


def test_parse_tolerance():
    assert parse_tolerance("5%") == (0.05, 0)
    assert parse_tolerance("256MiB") == (0.0, 256 * 1024**2)
    for bad in ("five", "-1%", "%"):
        with pytest.raises(ValueError):
            parse_tolerance(bad)
