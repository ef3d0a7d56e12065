"""Draft heads shipped in the package: `builtin:NAME` -> eagleserve/assets/NAME."""

from __future__ import annotations

from eagleserve.models.loader import resolve_draft_path


def resolve_head_path(path: str) -> str:
    """`builtin:smollm2-135m-eagle` -> the packaged head folder; any other path is checked to
    hold a config.json and returned unchanged. (Same rule as the scheduler's
    `eagleserve.models.loader.resolve_draft_path`, which already understands `builtin:`.)"""
    return resolve_draft_path(path)
