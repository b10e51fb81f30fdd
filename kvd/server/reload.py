"""SIGHUP: apply what a re-read config may change on a running daemon, report the rest.

Which keys apply is declared on the config fields (``metadata=RELOAD``, see
`kvd.config.reload_keys`): a changed reloadable key is applied at once, a
changed key without it keeps its running value and is reported as needing
a restart, and so is a changed section that has no reloadable key at all
(``server``, ``pools``, ...), by its name. Applied at once: the session
quota (to sessions opened from now on: the engine fixes a session's quota
when it opens), pressure thresholds (next maintenance tick), per-namespace
quotas and minimums (to every pool's engine), runtime-pool limits and the
budget they are checked against; ``log`` is applied by the daemon's own
hook. Namespace limits are checked against every pool's usage first: a
quota below a namespace's usage refuses ``admission.namespaces`` as a
whole and keeps the old limits.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from kvd.config import Config
from kvd.server.context import ServerState

__all__ = ["ReloadReport", "reload_config"]


@dataclass(frozen=True, slots=True)
class ReloadReport:
    """What `reload_config` did: the config now in force and the changed keys by fate."""

    config: Config
    #: Changed keys now in force (dotted names).
    applied: list[str]
    #: Changed keys or whole sections that take effect only after a restart.
    needs_restart: list[str]
    #: Changed reloadable keys that were refused, with why (the old value stays).
    refused: dict[str, str]


def reload_config(state: ServerState, fresh: Config) -> ReloadReport:
    """Make ``fresh``'s reloadable changes the running config of ``state`` (under the lock)."""
    running = state.config
    hints = typing.get_type_hints(Config)
    wanted: list[str] = []
    sections: list[str] = []
    keys: list[str] = []
    merged: dict[str, Any] = {}
    for section in dataclasses.fields(Config):
        old, new = getattr(running, section.name), getattr(fresh, section.name)
        if old == new:
            continue
        tp = hints[section.name]
        reloadable = (
            {f.name for f in dataclasses.fields(tp) if f.metadata.get("reload")}
            if dataclasses.is_dataclass(tp)
            else set()
        )
        if not reloadable:
            sections.append(section.name)
            continue
        kept = {}
        for f in dataclasses.fields(tp):
            if getattr(old, f.name) == getattr(new, f.name):
                continue
            dotted = f"{section.name}.{f.name}"
            if f.name in reloadable:
                wanted.append(dotted)
            else:
                keys.append(dotted)
                kept[f.name] = getattr(old, f.name)
        merged[section.name] = dataclasses.replace(new, **kept)
    refused: dict[str, str] = {}
    if "admission.namespaces" in wanted:
        problem = state.pools.namespace_problem(fresh.admission)
        if problem is not None:
            refused["admission.namespaces"] = problem
            merged["admission"] = dataclasses.replace(
                merged["admission"], namespaces=running.admission.namespaces
            )
        else:
            state.pools.set_namespace_limits(running.admission, fresh.admission)
    config = dataclasses.replace(running, **merged)
    state.config = state.pools.config = config
    applied = [key for key in wanted if key not in refused]
    return ReloadReport(config, applied, sections + keys, refused)
