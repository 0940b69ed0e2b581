"""The settings table of docs/running.md is the one the settings' declarations make
(proxy/core/config.py): one row per setting, with its flag, variable and default. `make
settings-table` writes it."""

from __future__ import annotations

from dataclasses import fields

from docblocks import DOCS

from stepguard.proxy.core.config import TABLE_END, TABLE_START, Settings, settings_table

PAGE = DOCS / "running.md"


def committed() -> str:
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1, \
        f"{PAGE} needs the settings table's markers once each"
    return text.split(TABLE_START + "\n", 1)[1].split(TABLE_END, 1)[0]


def test_the_committed_settings_table_is_the_one_the_declarations_make() -> None:
    assert committed() == settings_table(), \
        "docs/running.md's settings table differs from proxy/core/config.py: run `make settings-table`"


def test_the_table_has_one_row_per_setting_naming_its_variable() -> None:
    rows = [line for line in committed().splitlines() if line.startswith("| ")][1:]
    variables = [row.split(" | ")[1].split("`")[1] for row in rows]

    assert len(rows) == len(fields(Settings))
    assert len(set(variables)) == len(rows)
    assert "STEPGUARD_MAX_REQUEST_BYTES" in variables
    assert "STEPGUARD_VAR_<NAME>" in variables


def test_a_size_default_is_shown_in_mib_and_a_setting_without_a_flag_as_a_dash() -> None:
    rows = {row.split(" | ")[1].strip("`"): row for row in committed().splitlines()
            if row.startswith("| ")}

    assert rows["STEPGUARD_MAX_REQUEST_BYTES"].startswith(
        "| `--max-request-bytes` | `STEPGUARD_MAX_REQUEST_BYTES` | 10 MiB | ")
    assert rows["STEPGUARD_SQLITE_SYNCHRONOUS"].startswith(
        "| — | `STEPGUARD_SQLITE_SYNCHRONOUS` | `NORMAL` | ")
