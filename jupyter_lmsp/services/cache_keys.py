"""The prompt cache keys a runner served recently (`RecentKeys`): what a standalone worker's
claims from the shared queue prefer (`rules.claim_tasks`'s `prefer`), since the prompt cache
of its own inference worker process holds those requests' prefixes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# How many keys a runner remembers: the most recent ones. A worker's prompt cache holds the
# prefixes of a bounded number of recent prompts; a key older than that has likely left it.
RECENT_KEYS = 256


class RecentKeys:
    """The most recently served of at most `size` keys, newest last. Used on one thread (the
    runner's loop)."""

    def __init__(self, size: int = RECENT_KEYS) -> None:
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, keys: Iterable[str | None]) -> None:
        """Remember these keys as the newest (None, a task without a key, is skipped); the
        oldest go beyond `size`."""
        for key in keys:
            if key is None:
                continue
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def keys(self) -> list[str]:
        """The keys remembered, oldest first."""
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
