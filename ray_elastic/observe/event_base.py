"""What every event is: a frozen dataclass with a ``kind``, its JSON form and a dict view.

The kinds themselves, and reading a logged line back into one, are in
:mod:`ray_elastic.observe.event_types`; each kind registers itself here when it is defined.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

KINDS: dict[str, list[type[Event]]] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event(Mapping[Any, Any]):
    """Base of every event: ``ts`` is when it happened (wall clock, ``time.time()``)."""

    kind: ClassVar[str] = ""
    ts: float = dataclasses.field(default_factory=time.time)
    extra: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "kind" in cls.__dict__ and cls.kind:
            KINDS.setdefault(cls.kind, []).insert(0, cls)  # a variant defined later is tried first

    @classmethod
    def accepts(cls, fields: dict[Any, Any]) -> bool:
        """Whether a logged ``fields`` of this kind is this class (kinds with variants override it)."""
        return True

    def fields(self) -> dict[str, Any]:
        """The event's own fields, as logged (without ``ts`` and ``kind``)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("ts", "extra")}
        return {**own, **self.extra}

    @classmethod
    def from_fields(cls, ts: float, fields: dict[Any, Any]) -> Event:
        names = {f.name for f in dataclasses.fields(cls)} - {"ts", "extra"}
        known = {n: fields.pop(n, None) for n in names}  # an older log may lack a field: None
        return cls(ts=ts, extra=fields, **known)

    def to_json(self) -> dict[str, Any]:
        return {"ts": self.ts, "kind": self.kind, **self.fields()}

    # the dict view
    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A line of a kind this version does not know (kept, not dropped)."""

    kind: str  # type: ignore[misc]

    def fields(self) -> dict[str, Any]:
        return dict(self.extra)
