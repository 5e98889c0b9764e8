"""The SGLang producer's registry: live requests by request id and by ``bootstrap_room``, transfer
infos that came before their request (the router sends prefill and decode the request at once, so
either may be first), and the end states of recent requests. Used under the producer's lock; every
table is bounded."""
from __future__ import annotations

from collections import OrderedDict

from kv_transfer.base import TransferState
from kv_transfer.sglang import v0_5_23 as wire
from kv_transfer.sglang.target import SGLangRequest
from prefill_server.errors import InvalidRequest


class Rooms:
    def __init__(self, keep_finished: int = 4096, max_parked: int = 4096):
        self.reqs: dict[str, SGLangRequest] = {}
        self._by_room: dict[int, str] = {}
        self._parked: OrderedDict[int, tuple[wire.TransferInfo, float]] = OrderedDict()
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._refused: OrderedDict[int, tuple[str, float]] = OrderedDict()  # room -> (why, when)
        self.keep_finished, self.max_parked = keep_finished, max_parked

    def add(self, p: SGLangRequest) -> wire.TransferInfo | None:
        """Register a new request; returns its room's parked transfer info, if the decode was first."""
        if p.request_id in self.reqs or p.room in self._by_room:
            raise InvalidRequest(f"request {p.request_id} or bootstrap_room {p.room} is already in use here",
                                 field="bootstrap_room")
        self.reqs[p.request_id] = p
        self._by_room[p.room] = p.request_id
        self._finished.pop(p.request_id, None)
        self._refused.pop(p.room, None)
        parked = self._parked.pop(p.room, None)
        return parked[0] if parked else None

    def by_room(self, room: int) -> SGLangRequest | None:
        rid = self._by_room.get(room)
        return self.reqs.get(rid) if rid is not None else None

    def remove(self, p: SGLangRequest, state: TransferState) -> None:
        self.reqs.pop(p.request_id, None)
        if self._by_room.get(p.room) == p.request_id:
            del self._by_room[p.room]
        self._finished[p.request_id] = state
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)

    def finished(self, request_id: str) -> TransferState | None:
        return self._finished.get(request_id)

    def park(self, info: wire.TransferInfo, now: float) -> list[wire.TransferInfo]:
        """Keep a transfer info until its request comes; returns those pushed out (oldest first)."""
        self._parked.pop(info.room, None)
        self._parked[info.room] = (info, now)
        out = []
        while len(self._parked) > self.max_parked:
            out.append(self._parked.popitem(last=False)[1][0])
        return out

    def unpark(self, room: int) -> wire.TransferInfo | None:
        got = self._parked.pop(room, None)
        return got[0] if got else None

    def expired(self, older_than: float) -> list[wire.TransferInfo]:
        """Remove and return the parked infos that arrived before ``older_than``."""
        out = []
        while self._parked:
            room, (info, t) = next(iter(self._parked.items()))
            if t >= older_than:
                break
            del self._parked[room]
            out.append(info)
        return out

    def refuse(self, room: int, why: str, now: float) -> None:
        """A room whose request was refused here: its transfer info, when it comes, gets ``why``."""
        self._refused.pop(room, None)
        self._refused[room] = (why, now)
        while len(self._refused) > self.max_parked:
            self._refused.popitem(last=False)

    def refusal(self, room: int) -> str | None:
        got = self._refused.pop(room, None)
        return got[0] if got else None

    def forget_refusals(self, older_than: float) -> None:
        while self._refused and next(iter(self._refused.values()))[1] < older_than:
            self._refused.popitem(last=False)

    def clear_parked(self) -> None:
        self._parked.clear()
        self._refused.clear()
