"""The bounded in-memory store behind `store: true` and `previous_response_id` of the Responses API.

Each stored response keeps only its own turn (the input messages it added, then its output as an
assistant message) and the id of the response it continued, so a conversation of n turns costs O(n),
not O(n^2). The least recently used responses go first once the store is over its entry or byte
budget; a conversation whose earlier turn was evicted can no longer be continued, which the caller
answers with a 404 naming the missing response.

Sizes: `hyserve serve --responses-store-size` responses and `--responses-store-mib` MiB of JSON
(`for_server`; defaults from HYSERVE_RESPONSES_STORE_SIZE / _MIB, else 4096 responses and 256 MiB).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hyserve import envs


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object, as GET /v1/responses/{id} returns it
    previous_id: str | None
    messages: list[dict[str, Any]]  # this turn in chat form: its input messages, then its output
    size: int = 0


class MissingResponse(KeyError):
    """A response of the chain is not stored (never stored, deleted, or evicted)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    def __init__(self, max_entries: int = envs.DEFAULT_RESPONSES_STORE_SIZE,
                 max_bytes: int = envs.DEFAULT_RESPONSES_STORE_MIB << 20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    @classmethod
    def for_server(cls, size: int | None, mib: float | None) -> ResponseStore:
        """The store of `hyserve serve`'s --responses-store-size / --responses-store-mib (None: not given)."""
        env = envs.get()
        mib = env.responses_store_mib if mib is None else mib
        return cls(env.responses_store_size if size is None else size, max(1, int(mib * (1 << 20))))

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        entry.size = len(json.dumps([entry.body, entry.messages], ensure_ascii=False))
        self.delete(response_id)
        self._items[response_id] = entry
        self.bytes += entry.size
        while len(self._items) > 1 and (len(self._items) > self.max_entries or self.bytes > self.max_bytes):
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every message up to and including the response's output, oldest first. Raises
        MissingResponse naming the first response of the chain that is not stored."""
        turns: list[list[dict[str, Any]]] = []
        seen: set[str] = set()
        rid: str | None = response_id
        while rid is not None and rid not in seen:
            seen.add(rid)
            entry = self.get(rid)
            if entry is None:
                raise MissingResponse(rid)
            turns.append(entry.messages)
            rid = entry.previous_id
        return [m for turn in reversed(turns) for m in turn]
