"""Stored responses (a request's ``store``, true by default): what GET / DELETE
/v1/responses/{id} answer, and the conversation a ``previous_response_id`` continues.

In memory, in the ingress replica that answered (a front of several replicas would need a
shared store; Serve's default is one). Bounded: at most ``max_responses``, the least
recently used dropped first; each holds its response object and its conversation as chat
messages (the history it continued, its input, its output; not its instructions, which a
continuation does not inherit), so one entry is at most about one context of text.
A response is its tenant's: another tenant's id answers as an unknown one (404).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.cluster.front.responses.protocol import ResponseObject

MAX_STORED_RESPONSES = 1024


@dataclass(slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict]  # chat messages, the response's own output last
    tenant: str | None


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        del self._entries[response_id]
        return True
