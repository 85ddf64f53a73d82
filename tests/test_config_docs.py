"""The documented table of "sdp4bit" keys (docs/config.md) is the one generated from the config's field descriptions."""

from __future__ import annotations

from pathlib import Path

from deepspeed_sdp4bit.config import GuardConfig, SDP4BitConfig, key_table

CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def documented_key_table() -> str:
    """The markdown table under docs/config.md's '## The "sdp4bit" block' heading."""
    section = CONFIG_DOC.read_text().split('## The "sdp4bit" block', 1)[1]
    lines = section[section.index("| key | default |") :].splitlines()
    return "\n".join(lines[: next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))])


def test_every_key_is_described():
    for name, field in SDP4BitConfig.model_fields.items():
        assert field.description and len(field.description) > 20, name


def test_documented_key_table_matches_the_field_descriptions():
    table = documented_key_table()
    assert table == key_table(), (
        "docs/config.md's key table differs from the config's field descriptions; paste the "
        "output of `python -c 'from deepspeed_sdp4bit.config import key_table; "
        "print(key_table())'` into docs/config.md"
    )
    assert len(table.splitlines()) == 2 + len(SDP4BitConfig.model_fields) + len(GuardConfig.model_fields)
