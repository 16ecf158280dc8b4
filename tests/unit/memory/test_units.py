import pytest

from pipeline.memory import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("2GB", 2 * 10**9),
        ("1.5G", 1_500_000_000),
        ("100", 100),
        (4096, 4096),
        ("64 mib", 64 * 2**20),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4GB2", "lots", "-1GiB", "12 parsecs", ""])
def test_parse_size_rejects_with_a_hint(text):
    with pytest.raises(ValueError, match="512MiB"):
        parse_size(text)


@pytest.mark.parametrize(
    "text,expected", [("30s", 30), ("2h", 7200), ("1h30m", 5400), ("500ms", 0.5), ("10m", 600), (5, 5.0)]
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["soon", "30", "1x", "h", "0"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text if text != "0" else 0)


@pytest.mark.parametrize("text", ["0s", "0m", "0h0m", "0ms", "0.0s"])
def test_parse_duration_rejects_a_zero_written_with_units(text):
    # a zero timeout would stop every attempt at once
    with pytest.raises(ValueError, match="must be positive"):
        parse_duration(text)


def test_format_size():
    assert format_size(None) == "-"
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30 // 2) == "1.50 GiB"


def test_format_size_in_a_unit_given():
    assert format_size(512 * 2**20, "GiB") == "0.50 GiB"
    assert format_size(int(6.64 * 2**30), "GiB") == "6.64 GiB"
    assert format_size(3 * 2**40, "GiB") == "3072.00 GiB"
    assert format_size(None, "GiB") == "-"
