"""The table's row types: :class:`Touchpoint` (one name the project relies on) and :class:`Variant`
(its form from some release on). Imports nothing from vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CHECKED_VLLM", "Kind", "Located", "Side", "Touchpoint", "Variant", "row"]

CHECKED_VLLM = ("0.32.0", "0.33.0")
"""vLLM releases the whole table is checked against (0.32 installed, 0.33 statically); the declared
range (``vllm_plugin.preflight.SUPPORTED_VLLM``, pyproject.toml) covers exactly their minor series."""

Kind = Literal["module", "class", "function", "method", "attribute", "constant", "assigned"]
"""``assigned``: an attribute upstream code assigns on another object (``state.X = ...`` in the
function ``qualname``); the project reads it there (``app.state.X``)."""

Side = Literal["plugin", "protocol", "scripts", "bench", "tests", "trainer"]
"""Which part of the project uses a touchpoint (the folder of its first user outside ``upstream/``,
whose accessors only pass a name on)."""


def _in(versions: str, version: str) -> bool:
    """Whether ``version`` (local tags and rc/dev suffixes ignored) is in the specifier set."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(versions).contains(Version(Version(version).base_version), prereleases=True)


@dataclass(frozen=True)
class Variant:
    """A touchpoint's form from some release on (fields left None keep the 0.32 form).

    Attributes:
        versions: PEP 440 specifiers the variant applies to, e.g. ``">=0.33"``.
        module: where the name lives there.
        qualname: its name there.
        keywords: the keyword names a call must pass there (replaces :attr:`Touchpoint.keywords`).
        note: what changed upstream.
    """

    versions: str
    module: str | None = None
    qualname: str | None = None
    keywords: tuple[str, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class Touchpoint:
    """One vLLM (or transformers, or stdlib) name the project relies on.

    Attributes:
        key: short unique name, for :func:`~upstream.load`.
        module: the module the project imports it from (vLLM 0.32).
        qualname: the name within the module (``Class.method``); ``""`` for the module itself.
        kind: what it is (see :data:`Kind`).
        upstream: the file that defines it in vLLM 0.32 (``vllm/...py``).
        used_in: the project files that use it (files only: line numbers drift); each mentions it
            (its name, :attr:`accessor` or :attr:`spelled`; a test checks).
        side: which part of the project uses it (the first of ``used_in``).
        reached_as: how the project's code reaches it, when not by import
            (``engine_client.renderer.mm_processor_cache``).
        accessor: the door's function plugin code reaches it through, where not ``load(key)``
            (the private names, the version-keyed branches).
        spelled: how a user file spells it where neither the name nor an accessor appears
            (``pyproject.toml``'s entry-point group).
        positional: positional arguments the project passes (None: not called).
        positional_names: the parameter names the project's positional arguments bind to, where
            it relies on their order (``generate(prompt, sampling_params, request_id)``).
        keywords: keyword names the project passes.
        named: those of ``keywords`` that must be named parameters of the callable: where it also
            takes ``**kwargs``, a renamed parameter would otherwise swallow the keyword silently.
        attr: for ``assigned``: the attribute assigned in ``qualname``.
        private: a ``_`` name (or one outside any documented API the project may use).
        why: for private ones: why no public name serves.
        optional: read with a fallback (``getattr(x, name, None)``): its absence changes nothing.
        since: PEP 440 specifiers of the releases the name exists in and is used (empty: every
            checked release): a branch of the door taken on those releases only.
        variants: its form in later releases (:class:`Variant`).
        package: the distribution the name belongs to.
    """

    key: str
    module: str
    qualname: str
    kind: Kind
    upstream: str
    used_in: tuple[str, ...]
    side: Side
    reached_as: str = ""
    accessor: str = ""
    spelled: str = ""
    positional: int | None = None
    positional_names: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    named: tuple[str, ...] = ()
    attr: str = ""
    private: bool = False
    why: str = ""
    optional: bool = False
    since: str = ""
    variants: tuple[Variant, ...] = ()
    package: Literal["vllm", "transformers", "stdlib"] = "vllm"

    @property
    def id(self) -> str:
        """``module:qualname`` (``.attr`` for ``assigned``)."""
        name = f"{self.module}:{self.qualname}"
        return f"{name}.{self.attr}" if self.attr else name

    @property
    def mentions(self) -> tuple[str, ...]:
        """What a user file must contain to be a user: the name (its class for ``__init__``), the
        module for a module, the accessor, the spelling."""
        parts = [p for p in self.qualname.split(".") if p and not (p.startswith("__") and p.endswith("__"))]
        name = self.attr or (parts[-1] if parts else self.module)
        if self.qualname == "__version__":
            name = "__version__"
        return tuple(m for m in (name, self.accessor, self.spelled) if m)

    def exists_in(self, version: str | None) -> bool:
        """Whether the name is used with ``version`` (None: the 0.32 form, where ``since`` rows
        do not exist)."""
        if not self.since:
            return True
        return version is not None and _in(self.since, version)

    def variant_for(self, version: str) -> Variant | None:
        """The variant that applies to ``version`` (the first that does), or None."""
        for variant in self.variants:
            if _in(variant.versions, version):
                return variant
        return None

    def at(self, version: str | None) -> Located:
        """This touchpoint's form in vLLM ``version`` (None: the 0.32 form)."""
        variant = self.variant_for(version) if version is not None else None
        if variant is None:
            return Located(self.module, self.qualname, self.keywords, None)
        return Located(
            variant.module or self.module,
            variant.qualname if variant.qualname is not None else self.qualname,
            variant.keywords if variant.keywords is not None else self.keywords,
            variant,
        )


@dataclass(frozen=True)
class Located:
    """A touchpoint's form in one release: where it lives and the keywords a call passes."""

    module: str
    qualname: str
    keywords: tuple[str, ...]
    variant: Variant | None


_SIDES: dict[str, Side] = {
    "vllm_plugin": "plugin",
    "protocol": "protocol",
    "scripts": "scripts",
    "bench": "bench",
    "tests": "tests",
    "trainer_lib": "trainer",
}


def _side(key: str, used_in: tuple[str, ...]) -> Side:
    """The folder of the first user outside ``upstream/``."""
    for where in used_in:
        folder = where.split("/", 1)[0]
        if folder != "upstream":
            return _SIDES[folder]
    raise ValueError(f"{key}: used in upstream/ only; list the files that call its accessor")


def row(ref: str, kind: Kind, upstream: str, *used_in: str, **fields: Any) -> Touchpoint:
    """A table row: ``ref`` is ``module:qualname``; the key defaults to the qualname (the module
    for a module, ``state.<attr>`` for an ``assigned`` one), the package to the module's root
    package, the side to the folder of the first user outside ``upstream/``.

    Raises:
        ValueError: no ``side`` and no user outside ``upstream/`` (an accessor nobody calls).
    """
    module, _, qualname = ref.partition(":")
    root = module.split(".", 1)[0]
    package = root if root in ("vllm", "transformers") else "stdlib"
    attr = fields.get("attr", "")
    key = fields.pop("key", None) or (f"state.{attr}" if attr else qualname or module)
    side = fields.pop("side", None) or _side(key, used_in)
    users = tuple(dict.fromkeys(used_in))
    return Touchpoint(key, module, qualname, kind, upstream, users, side, package=package, **fields)
