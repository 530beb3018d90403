"""docs/PROTOCOL.md is the contract: its tables are held to the code, and the repo points nowhere else."""

from __future__ import annotations

import re

import pytest

from helpers import REPO
from protocol import errors, features, refs, store, structs, sweep
from protocol.fingerprint import library_versions

DOC = (REPO / "docs" / "PROTOCOL.md").read_text()


def _tables() -> list[tuple[str, list[list[str]]]]:
    """Every table of the doc: (the nearest line above it that is not blank, body rows as cells)."""
    out: list[tuple[str, list[list[str]]]] = []
    lines = DOC.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        above = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        header = [c.strip() for c in lines[i].strip("|").split("|")]
        rows = []
        i += 2  # header and separator
        while i < len(lines) and lines[i].startswith("|"):
            rows.append([c.strip() for c in lines[i].strip("|").split("|")])
            i += 1
        out.append((above + " " + " ".join(header), rows))
    return out


def _table(*words: str) -> list[list[str]]:
    (rows,) = [rows for context, rows in _tables() if all(w in context for w in words)]
    return rows


def _names(rows: list[list[str]], column: int = 0) -> list[str]:
    return [row[column].strip("`") for row in rows]


@pytest.mark.parametrize(
    ("words", "struct"),
    [
        (("`RawRefBody`", "field"), refs.RawRefBody),
        (("`RawMMRef`",), structs.RawMMRef),
        (("`MMRefs`",), structs.MMRefs),
        (("envelope field",), features.FeatureEnvelope),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_map_struct_tables_list_every_field(words, struct):
    assert _names(_table(*words)) == list(struct.__struct_fields__)


@pytest.mark.parametrize("struct", [structs.TrainingSample, structs.MicroBatch], ids=lambda s: s.__name__)
def test_array_like_tables_give_the_wire_order(struct):
    rows = _table(f"`{struct.__name__}`", "#")
    assert [int(row[0]) for row in rows] == list(range(len(rows)))
    assert _names(rows, 1) == list(struct.__struct_fields__)
    assert struct.__struct_config__.array_like


def test_error_table_is_the_code():
    rows = _table("error", "builtin", "status", "code")
    want = [
        [cls.__name__, cls.__bases__[1].__name__, str(cls.http_status), cls.code]
        for cls in errors.all_error_types()
    ]
    assert [[c.strip("`") for c in row[:4]] for row in rows] == want


def test_safe_id_patterns_are_the_code():
    rows = {row[0].strip("`"): row[1].split("`")[1] for row in _table("id", "pattern")}
    assert rows == {name: getattr(refs, name).pattern for name in rows}
    assert set(rows) == {"RUN_ID_RE", "FINGERPRINT_RE", "MM_HASH_RE", "FAMILY_RE"}


def test_constants_are_the_code():
    for value in (refs.MAX_REF_CHARS, int(sweep.TEMP_GRACE_S), int(sweep.DEFAULT_TTL_S)):
        assert str(value) in DOC
    assert f"`{store.TEMP_PREFIX}<16 hex><suffix>`" in DOC
    assert str(features.FEATURES_SUBDIR) in DOC
    assert store.DEFAULT_MAX_IMAGE_BYTES == 64 << 20 and "64 MiB" in DOC
    assert features.DEFAULT_MAX_FEATURE_BYTES == 512 << 20 and "512 MiB" in DOC
    from protocol.images import DEFAULT_MAX_IMAGE_PIXELS

    assert f"{DEFAULT_MAX_IMAGE_PIXELS:,}" in DOC
    versions_row = next(row for row in _table("key", "what") if row[0] == "`versions`")
    assert all(f"`{name}`" in versions_row[1] for name in library_versions())


def test_family_table_is_the_registry():
    from protocol.adapters import ADAPTERS

    rows = _table("family", "grid field", "rope")
    documented = {
        family.strip("` "): (row[1].strip("`"), row[-1].strip("`"))
        for row in rows
        for family in row[0].split(",")
    }
    assert documented == {t: (cls.grid_field, cls.rope) for t, cls in ADAPTERS.items()}


def test_video_family_table_is_video_families():
    from protocol.adapters import VIDEO_FAMILIES

    rows = _table("video family", "loader", "token route")
    documented = {
        row[0].strip("`"): (
            row[2].strip("`"),
            row[3].startswith("one run per"),
            row[4] == "yes",
            row[5] == "served",
        )
        for row in rows
    }
    assert documented == {
        family: (spec.loader, spec.per_frame_runs, spec.second_per_grid_ts, not spec.per_frame_runs)
        for family, spec in VIDEO_FAMILIES.items()
    }


# The repo is self-contained: nothing points at notes a person who clones it does not have.
_OUTSIDE = re.compile(r"\.\./shared|NOTES-vllm|DESIGN\.md|DESIGN §|\bNOTES (\"|\(|pitfall|Lessons)")
_TEXT = {".py", ".md", ".toml", ".sh", ".txt", ".json", ".cfg", ".ini", ".yaml", ".yml", ".pth", ""}


def test_no_file_points_outside_the_repo():
    hits = []
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO)
        if any(p.startswith(".") and p != ".ci" for p in rel.parts) or "__pycache__" in rel.parts:
            continue
        if not path.is_file() or path.suffix not in _TEXT or "egg-info" in str(rel):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line) and path != REPO / "tests" / "test_protocol_doc.py":
                hits.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert hits == []
