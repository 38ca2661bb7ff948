"""A name → object registry with a decorator, used for tasks, rewards, losses, aggregations."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T], dict):
    """A dict of registered objects; `@REG.register("name")` adds one and refuses duplicates."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = obj
            return obj

        return deco
