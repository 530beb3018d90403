"""protocol.errors: the docstring table is the contract, codes are unique, errors pickle.

(The ``__all__`` checks of every package are in ``tests/test_layout.py``.)
"""

from __future__ import annotations

import builtins
import inspect
import pickle
import re

import pytest

from protocol import errors
from protocol.errors import MMRefError, all_error_types

# "├── AssetNotFound(MMRefError, FileNotFoundError)         404    asset_not_found"
_ROW = re.compile(r"^\s*[├└]── (\w+)\((\w+), (\w+)\)\s+(\d{3})\s+([a-z_]+)\s*$")


def _docstring_table() -> dict[str, tuple[str, str, int, str]]:
    """Rows of the hierarchy drawn in the module docstring: name -> (base, builtin, status, code)."""
    rows = {}
    for line in errors.__doc__.splitlines():
        if "──" not in line:
            continue
        m = _ROW.match(line)
        assert m, f"unparseable row in protocol.errors docstring: {line!r}"
        name, base, builtin, status, code = m.groups()
        assert name not in rows, f"{name} drawn twice"
        rows[name] = (base, builtin, int(status), code)
    return rows


def test_docstring_table_parses_and_lists_every_error_type():
    table = _docstring_table()
    assert len(table) >= 12
    assert list(table) == [cls.__name__ for cls in all_error_types()]


@pytest.mark.parametrize("cls", all_error_types(), ids=lambda c: c.__name__)
def test_error_matches_docstring_row(cls):
    base, builtin_name, status, code = _docstring_table()[cls.__name__]
    assert base == "MMRefError"
    builtin = getattr(builtins, builtin_name)
    assert isinstance(builtin, type) and issubclass(builtin, BaseException)
    assert cls.__bases__ == (MMRefError, builtin)
    assert issubclass(cls, builtin)
    assert cls.http_status == status
    assert cls.code == code
    # The class declares its own code and status (not inherited from MMRefError by accident).
    assert "code" in vars(cls) and "http_status" in vars(cls)
    assert cls.__doc__ and cls.__doc__.strip()


def test_codes_are_unique_and_distinct_from_the_base():
    codes = [cls.code for cls in all_error_types()]
    assert len(codes) == len(set(codes)), codes
    assert MMRefError.code not in codes
    assert all(re.fullmatch(r"[a-z][a-z_]*", c) for c in codes)


def test_all_error_types_has_no_duplicates_and_only_concrete_subclasses():
    types = all_error_types()
    assert len(types) == len(set(types))
    assert MMRefError not in types
    assert all(issubclass(t, MMRefError) for t in types)


def test_every_exported_error_class_is_listed():
    exported = {
        getattr(errors, name)
        for name in errors.__all__
        if inspect.isclass(getattr(errors, name)) and issubclass(getattr(errors, name), MMRefError)
    }
    assert exported - {MMRefError} == set(all_error_types())


def test_every_error_class_defined_in_the_module_is_listed():
    defined = {
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, MMRefError) and obj.__module__ == errors.__name__
    }
    assert defined - {MMRefError} == set(all_error_types())


@pytest.mark.parametrize("cls", all_error_types(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("ref", ["mmraw:eyJmYW1pbHkiOiJxd2VuMl92bCJ9", None])
def test_pickle_round_trip_keeps_ref_and_message(cls, ref):
    err = cls("the file at /x is 3 bytes, limit 2", ref=ref)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert back.ref == ref
    assert back.message == "the file at /x is 3 bytes, limit 2"
    assert str(back) == str(err) == "the file at /x is 3 bytes, limit 2"
    assert back.args == err.args
    assert back.code == cls.code and back.http_status == cls.http_status


def test_errors_are_caught_by_their_builtin():
    with pytest.raises(FileNotFoundError):
        raise errors.AssetNotFound("missing", ref="mmfile:v1:r:" + "a" * 16 + ":image:" + "b" * 32)
    with pytest.raises(PermissionError):
        raise errors.AssetOutsideRoot("outside")
    with pytest.raises(LookupError):
        raise errors.NotCached("not cached")
    with pytest.raises(ValueError) as info:
        raise errors.InvalidRef("bad", ref="mmraw:!!")
    assert info.value.ref == "mmraw:!!"


def test_ref_defaults_to_none():
    assert errors.HashMismatch("x").ref is None


@pytest.mark.parametrize("cls", all_error_types(), ids=lambda c: c.__name__)
def test_error_from_body_rebuilds_the_plugin_refusal(cls):
    """The server's body (``vllm_plugin.protocol.error_body``) back into the same typed error."""
    from vllm_plugin.protocol import error_body

    body = error_body(cls("the message", ref="mmraw:eyJ9"), "the message")
    rebuilt = errors.error_from_body(body)
    assert type(rebuilt) is cls and rebuilt.message == "the message" and rebuilt.ref == "mmraw:eyJ9"


def test_error_from_body_without_mmref_code():
    stock = {"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}}
    assert errors.error_from_body(stock) is None
    assert errors.error_from_body({"detail": "x"}) is None and errors.error_from_body(None) is None
    unknown = errors.error_from_body({"error": {"message": "m", "mmref_code": "from_the_future"}})
    assert type(unknown) is MMRefError and unknown.message == "m" and unknown.ref is None


@pytest.mark.parametrize(
    ("code", "cls", "status"),
    [("update_conflict", errors.UpdateConflict, 409), ("drain_timeout", errors.DrainTimeout, 503)],
)
def test_error_from_body_maps_the_weight_update_codes(code, cls, status):
    """Issue 26's two codes (the weight-update routes) come back as their types and statuses."""
    rebuilt = errors.error_from_body({"error": {"message": "m", "code": status, "mmref_code": code}})
    assert type(rebuilt) is cls and rebuilt.http_status == status and rebuilt.code == code
