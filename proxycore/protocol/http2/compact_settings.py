"""h2's connection settings in a tenth of the memory: a memory optimisation of `H2Server`.

h2 keeps each setting's current value and the values proposed after it (sent, not yet
acknowledged) in a deque; `CompactSettings` keeps them in a list of one or two items instead
(`_Values`), with the same behaviour. It is used for both of the agent side's Settings objects
(connection.py), where idle connections are many.
"""

from __future__ import annotations

import h2.settings

__all__ = ["CompactSettings"]


class _Values(list[int | None]):
    """A setting's current value and the ones proposed after it: what h2 keeps in a deque
    (`[0]`, `append`, `popleft`), in a list of one or two items. A deque allocates a block of
    64 slots (about 760 bytes): h2's two Settings objects held eleven of them, a third of
    what an idle HTTP/2 connection cost (bench/bench_h2.py, memory per idle connection)."""

    __slots__ = ()

    def popleft(self) -> int | None:
        return self.pop(0)


class CompactSettings(h2.settings.Settings):
    """h2's Settings with `_Values` for its deques (the same behaviour, a tenth of the memory)."""

    def __init__(
        self, client: bool = True, initial_values: dict[h2.settings.SettingCodes, int] | None = None
    ) -> None:
        super().__init__(client=client, initial_values=initial_values)
        self._settings = {key: _Values(items) for key, items in self._settings.items()}  # type: ignore[misc]

    def __setitem__(self, key: h2.settings.SettingCodes | int, value: int) -> None:
        if key not in self._settings:
            self._settings[key] = _Values([None])  # type: ignore[assignment]
        super().__setitem__(key, value)
