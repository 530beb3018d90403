"""The generated inventory of ``docs/VLLM-SURFACE.md``: one table per side of the project, from
the door's rows and the compatibility check of the installed and the newest release."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_compat_check import Result, check
from vllm_compat_source import SourceTree

from upstream import HF_SURFACE, STDLIB_SURFACE, Touchpoint

__all__ = [
    "INVENTORY_BEGIN",
    "INVENTORY_END",
    "call_shape",
    "generated_inventory",
    "markdown_inventory",
    "markdown_other",
    "status_text",
]

INVENTORY_BEGIN = "<!-- BEGIN GENERATED: python scripts/vllm_compat.py --markdown -->"
INVENTORY_END = "<!-- END GENERATED -->"
_SIDE_TITLES = {
    "plugin": "vllm_plugin/ (the endpoint plugin)",
    "protocol": "protocol/ (adapters shared with the trainer)",
    "scripts": "scripts/",
    "bench": "bench/",
    "tests": "tests/ (oracles and fixtures)",
    "trainer": "trainer_lib/",
}


def call_shape(tp: Touchpoint) -> str:
    """How the project uses a touchpoint, for the inventory: ``(3: a, b, c; kw=, kw=)`` or a use."""
    if tp.kind == "assigned":
        return f"read `{tp.reached_as or tp.attr}`"
    if tp.positional is None and not tp.keywords:
        return {"class": "isinstance / subclass / import", "module": "import / run"}.get(tp.kind, "read")
    positional = f"{tp.positional or 0} positional"
    if tp.positional_names:
        positional += f" ({', '.join(tp.positional_names)})"
    keywords = ", ".join(f"{k}=" for k in tp.keywords)
    named = f"; named: {', '.join(tp.named)}" if tp.named else ""
    return "call: " + positional + (f"; {keywords}" if keywords else "") + named


def status_text(result: Result) -> str:
    """A touchpoint's status in a newer release, for the inventory."""
    if not result.ok:
        return f"**{result.status}**: {result.detail}"
    if result.status == "OK" and result.touchpoint.since:
        return f"used here ({result.touchpoint.since}): {result.detail}".rstrip(": ")
    if result.status == "OK":
        return "same"
    if result.status == "SKIP":
        return "not used"
    note = "; ".join(result.notes)
    if result.status == "MOVED":
        return f"moved: `{result.where}` ({note})"
    return f"signature changed ({note})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_inventory(base: Sequence[Result], newer: Sequence[Result] | None, newer_version: str) -> str:
    """The generated part of ``docs/VLLM-SURFACE.md``: one table per side of the project.

    Args:
        base: the check of the installed release (0.32): where each name is defined.
        newer: the check of ``newer_version`` (None: not available).
    """
    by_key = {r.touchpoint.key: r for r in newer or ()}
    out: list[str] = []
    for side, title in _SIDE_TITLES.items():
        rows = [r for r in base if r.touchpoint.side == side]
        if not rows:
            continue
        out += [
            f"### {title}",
            "",
            "| name (`module:qualname`, 0.32) | kind | used in | defined in (0.32) | private "
            f"| project's use | {newer_version} |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            tp = r.touchpoint
            name = f"`{tp.module}:{tp.qualname}`" + (f" `.{tp.attr}`" if tp.attr else "")
            if tp.reached_as:
                name += f"<br>as `{tp.reached_as}`"
            private = f"yes: {tp.why}" if tp.private else ("optional" if tp.optional else "")
            newer_status = status_text(by_key[tp.key]) if tp.key in by_key else "not checked"
            defined_in = r.defined_in
            if r.status == "SKIP":  # not in the installed release: where the newer one has it
                newer_at = by_key[tp.key].defined_in if tp.key in by_key else tp.upstream
                defined_in = f"({tp.since}) {newer_at}"
            cells = [
                name,
                tp.kind,
                "<br>".join(tp.used_in),
                defined_in,
                private,
                call_shape(tp),
                newer_status,
            ]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def markdown_other(touchpoints: Sequence[Touchpoint]) -> str:
    """The transformers and stdlib rows (checked at run time against what is installed)."""
    out = [
        "| name (`module:qualname`) | kind | used in | defined in | private | project's use |",
        "|---|---|---|---|---|---|",
    ]
    for tp in touchpoints:
        name = f"`{tp.module}:{tp.qualname}`" + (f"<br>as `{tp.reached_as}`" if tp.reached_as else "")
        private = f"yes: {tp.why}" if tp.private else ""
        cells = [name, tp.kind, "<br>".join(tp.used_in), tp.upstream, private, call_shape(tp)]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def generated_inventory(installed: SourceTree, newer: SourceTree, newer_version: str) -> str:
    """The whole generated section of ``docs/VLLM-SURFACE.md`` (markers included)."""
    base = check(installed, variants=False)
    parts = [
        INVENTORY_BEGIN,
        "",
        f"## vLLM names (checked: {installed.version()} installed, {newer_version} from its wheel)",
        "",
        markdown_inventory(base, check(newer), newer_version),
        "## transformers-internal names (checked against the installed transformers)",
        "",
        markdown_other(HF_SURFACE),
        "## Standard-library private names",
        "",
        markdown_other(STDLIB_SURFACE),
        INVENTORY_END,
    ]
    return "\n".join(parts)
