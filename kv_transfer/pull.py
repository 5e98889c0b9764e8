"""Pull fallback of connector mode: the decode asked for it (``Register.transfer_mode == "pull"``,
e.g. our connector's ``kv_connector_extra_config.transfer_mode``), so the prefill computes the
prompt into its own pool as in nixl-compat mode, holds the blocks under a lease and lets the decode
READ them. This is the prefill side: ``PullLeases``, owned by ``kv_transfer.push.PushProducer``
(which shares its side channel and NIXL agent). The decode's side of the READ is
``kv_transfer.offer`` (used by ``kv_transfer.receiver.PushReceiver``).

Per request (prefill ``TransferState``)::

    expect(rid) EXPECTING --Register{pull}--> READY (engine: whole prompt into pool blocks, chunked)
    engine: publish(rid, blocks)  -> LEASED (pool lease), notification "psv1 ready rid -" to the decode
    decode --Fetch--> side channel: lease extended to lease_ttl_s, signed Offer back
    decode ==READ with notification "psv1 read rid <token>"==> RELEASED (lease ends, blocks freed)
    lease deadline passes: EXPIRED (blocks freed), the decode gets "psv1 fail rid ..."
    computed first (route LEASE_FOR_LATER): hold(rid, blocks) -> LEASED with no
    decode yet; a later Register{pull, same num_tokens} attaches its decode (``attach``): the
    "ready" notification goes then and the rest is as above; nobody registers: EXPIRED
    Cancel from the decode: ABORTED, freed at once (the decode sends it only with no READ in flight)
    abort on the prefill: ABORTED; freed at once unless the Offer went out (a READ may be in flight:
    then the blocks stay leased until the "read" notification or the deadline)

The release token (random, only in the signed Offer) and the sender's agent name authenticate the
"read" notification: a stranger cannot free someone else's blocks.
Thread-safety: every ``PullLeases`` method is called with the producer's lock held.
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer import layout, wire
from kv_transfer.base import KVPages, StatsCounter, TransferState
from kv_transfer.nixl import device_id_of, mem_type_of

log = logging.getLogger(__name__)

Notify = Callable[[str, bytes], None]  # (remote agent name, message)


@dataclass
class _Lease:
    request_id: str
    remote: str  # the decode's NIXL agent ("": computed first, no decode registered yet)
    num_tokens: int
    token: str = ""  # set once the Offer went out
    aborted: str = ""  # aborted on the prefill after the Offer: freed by the READ's notification


class PullLeases:
    def __init__(self, pool: KVPages, lease_ttl_s: float, stats: StatsCounter,
                 on_end: Callable[[str, TransferState], None]):
        """``on_end(request_id, terminal state)``: called once a lease has ended and its blocks are
        free (the producer remembers the state)."""
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.pool, self.lease_ttl_s, self._stats, self._on_end = pool, lease_ttl_s, stats, on_end
        self._leases: dict[str, _Lease] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def publish(self, request_id: str, remote: str, block_ids: list[int], num_tokens: int,
                notify: Notify) -> None:
        """Lease ``block_ids`` (they hold the prompt's KV) and tell the decode to fetch them. Raises
        (and leases nothing) if the decode cannot be told."""
        self.pool.lease(request_id, block_ids, self.lease_ttl_s, num_tokens)
        try:
            notify(remote, wire.ready_notif(request_id))
        except Exception:
            self.pool.release(request_id)
            raise
        self._leases[request_id] = _Lease(request_id, remote, num_tokens)
        self._stats.add(published_total=1, bytes_offered_total=self._bytes(num_tokens))

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        """Lease ``block_ids`` (they hold the prompt's KV) for a decode that registers later
        (``attach``); until then nobody is told, and the lease's deadline frees them."""
        self.pool.lease(request_id, block_ids, self.lease_ttl_s, num_tokens)
        self._leases[request_id] = _Lease(request_id, "", num_tokens)
        self._stats.add(published_total=1, bytes_offered_total=self._bytes(num_tokens))

    def is_unattached(self, request_id: str) -> bool:
        """A lease from ``hold`` that no decode has registered for yet."""
        lz = self._leases.get(request_id)
        return lz is not None and not lz.remote and not lz.aborted

    def attach_refusal(self, request_id: str, mode: str, num_tokens: int) -> str | None:
        """Why a decode's Register (``mode``, ``num_tokens``) cannot have a held lease, or None."""
        lz = self._leases.get(request_id)
        if lz is None or lz.remote or lz.aborted:
            return f"request {request_id} has no KV leased here awaiting a decode (already registered?)"
        if mode != "pull":
            return (f"request {request_id} was computed before its decode registered: its KV can only "
                    f"be pulled (register with transfer_mode \"pull\", not {mode!r})")
        if num_tokens != lz.num_tokens:
            return (f"the decode asks for {num_tokens} tokens, the prefill computed {lz.num_tokens}: "
                    "pass kv_transfer_params' num_tokens unchanged")
        return None

    def attach(self, request_id: str, remote: str, notify: Notify) -> str | None:
        """A decode registered for a held lease (``attach_refusal`` said yes): tell it to fetch.
        The lease's clock restarts (the decode may have come late in it). Why not, or None."""
        try:
            notify(remote, wire.ready_notif(request_id))
        except Exception as e:  # noqa: BLE001 - the lease stays, unattached, until its deadline
            return f"could not notify the decode: {type(e).__name__}: {e}"
        self._leases[request_id].remote = remote
        self.pool.extend(request_id, self.lease_ttl_s)
        return None

    def offer(self, fetch: wire.Fetch, agent_name: str, agent_metadata: bytes) -> wire.Offer | str:
        """The (unsigned) Offer answering ``fetch``, or why there is none. Extends the lease."""
        lz, lease = self._leases.get(fetch.request_id), self.pool.get_lease(fetch.request_id)
        if lz is None or lease is None or lz.aborted:
            return f"request {fetch.request_id} has no KV leased here (never published, freed or expired)"
        if not lz.remote:  # (only a decode that registered for it may READ it)
            return f"request {fetch.request_id}: no decode has registered for its KV"
        self.pool.extend(fetch.request_id, self.lease_ttl_s)
        lz.token = lz.token or secrets.token_hex(16)
        p = self.pool
        row = 2 * p.head_dim * p.kv.element_size()
        hs, ts = layout.dense_strides(wire.PLAIN_PAGE, p.num_kv_heads, p.block_size, row)
        return wire.Offer(
            version=wire.PROTOCOL_VERSION, request_id=fetch.request_id, agent_name=agent_name,
            agent_metadata=agent_metadata, page_layout=wire.PLAIN_PAGE,
            mem_type=mem_type_of(p.kv), device_id=device_id_of(p.kv),
            layer_addrs=[p.layer_base_addr(layer) for layer in range(p.num_layers)],
            block_stride=p.block_bytes, head_stride=hs, token_stride=ts, block_ids=list(lease.block_ids),
            num_tokens=lz.num_tokens, lease_s=self.lease_ttl_s, release_token=lz.token, nonce=fetch.nonce)

    def on_notif(self, agent: str, msg: bytes) -> bool:
        """Handle a "read" notification (True if it was one, valid or not)."""
        parsed = wire.parse_notif(msg)
        if parsed is None or parsed[0] != "read":
            return False
        _, rid, token = parsed
        lz = self._leases.get(rid)
        if lz is None or not lz.token or agent != lz.remote or not secrets.compare_digest(token, lz.token):
            log.warning("ignored a 'read' notification for %s from %s (unknown request or bad token)", rid, agent)
            self._stats.add(bad_notifications_total=1)
            return True
        self._end(lz, TransferState.ABORTED if lz.aborted else TransferState.RELEASED)
        self._stats.add(notifications_total=1)
        if not lz.aborted:
            self._stats.add(released_total=1, bytes_released_total=self._bytes(lz.num_tokens))
        return True

    def expire(self, notify: Notify, now: float | None = None) -> None:
        """End the leases past their deadline (the pool frees them); their decodes are told."""
        for rid in self.pool.expire(now):
            lz = self._leases.pop(rid, None)
            if lz is None:
                continue
            self._on_end(rid, TransferState.EXPIRED)
            self._stats.add(leases_expired_total=1)
            if not lz.aborted:
                _tell(notify, lz, f"the prefill's lease ran out after {self.lease_ttl_s:.0f} s "
                                  "before the decode read the KV")

    def cancel(self, request_id: str) -> bool:
        """The decode cancelled (it has no READ in flight): free now."""
        lz = self._leases.get(request_id)
        if lz is None:
            return False
        self._end(lz, TransferState.ABORTED)
        return True

    def abort(self, request_id: str, reason: str, notify: Notify) -> bool:
        """The prefill gives up on the request: free now if the decode cannot be reading it (no
        Offer out yet), else when its READ is over."""
        lz = self._leases.get(request_id)
        if lz is None or lz.aborted:
            return False
        _tell(notify, lz, reason)
        lz.aborted = reason
        if not lz.token:
            self._end(lz, TransferState.ABORTED)
        self._stats.add(aborted_total=1)
        return True

    def stop(self) -> None:
        for lz in list(self._leases.values()):
            self._end(lz, TransferState.ABORTED)

    def _end(self, lz: _Lease, state: TransferState) -> None:
        self._leases.pop(lz.request_id, None)
        self.pool.release(lz.request_id)
        self._on_end(lz.request_id, state)

    def _bytes(self, num_tokens: int) -> int:
        p = self.pool
        return p.blocks_needed(num_tokens) * p.block_bytes * p.num_layers


def _tell(notify: Notify, lz: _Lease, reason: str) -> None:
    if not lz.remote:
        return  # no decode registered: nobody to tell
    try:
        notify(lz.remote, wire.fail_notif(lz.request_id, reason))
    except Exception:  # noqa: BLE001 - the decode's timeout covers it
        log.warning("could not tell decode %s that %s failed", lz.remote, lz.request_id)
