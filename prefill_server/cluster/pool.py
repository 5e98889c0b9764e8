"""The gateway's PrefillWorker over a pool of workers on Ray Serve: the same calls as the engine in
this process (``engine/worker.py``), answered by whichever worker the router picks.

    start()            ray.init (local, or --ray-address), Serve without its HTTP proxy, the
                       deployment (one replica per worker, each in its own placement group); returns
                       once one worker runs (the rest may still load, or wait for a free GPU)
    submit(req)        a future of the PrefillResult; the worker that computed it keeps its KV
    start_stream(req)  (future of kv_transfer_params, future of the result)
    release(rid)       to the worker that holds the request (cancel, or end its lease); held back
                       while that worker is silent, dropped once it is gone
    keep(rids, ttl)    to each worker holding some of these leases: hold them ttl more

Recovery: a worker that dies is replaced by Serve (one that hangs too: its health check fails). A
request on it fails with ``WorkerLost`` (503), or is run once more on another worker when the decode
was told nothing yet (a LEASE request before its result; a STREAM request before its params went
out). Its leases die with it. A worker counts as lost for a request when Ray says it died, when it
sent no event for ``WORKER_SILENT_S`` (it sends one every second while it lives), or when it did not
take the request within ``ACCEPT_S``. A request no worker takes within --max-queue-wait, because none
is running, fails with ``NoWorker`` (503). A worker being removed (``set_workers``, autoscaling, a
rolling update) first finishes what it holds.

Calls to Ray run on this object's own event loop thread, so callers on any thread get
``concurrent.futures.Future``s (the engine's contract) and cancelling one cancels the request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from prefill_server.cluster import messages as msg
from prefill_server.cluster import pool_metrics, routers
from prefill_server.cluster.autoscaling import POLICY
from prefill_server.cluster.replica import PrefillReplica, ReplicaSpec, mark_read
from prefill_server.cluster.router import PrefillRouter, prefix_hashes
from prefill_server.config import EngineConfig, PoolConfig, ServerConfig
from prefill_server.engine import build
from prefill_server.engine.prefix_cache import with_client_salt
from prefill_server.engine.types import PrefillRequest, WorkerLoad
from prefill_server.engine.worker import Progress, context_len
from prefill_server.errors import NoWorker, PrefillError, WorkerLost
from prefill_server.metrics import Metrics

log = logging.getLogger(__name__)
APP, DEPLOYMENT = "prefill", "PrefillReplica"
START_TIMEOUT_S = 900.0  # the first worker loads its model (minutes for a large one on a GPU)
CALL_TIMEOUT_S = 10.0  # a control call (release, metrics, info) to one worker
# a worker sends an event at least every replica.HEARTBEAT_S while it lives: one silent this long is
# hung (or gone without Ray noticing yet), and its requests are treated as on a dead worker
WORKER_SILENT_S = 30.0
# a running worker takes a request at once; one sent to a hung worker (Serve reserves a slot there
# first, and that call never returns) is taken back after this long and sent elsewhere
ACCEPT_S = 10.0
RELEASE_WAIT_S = 600.0  # a release waits this long for its silent worker to answer or be replaced
_LEASES_REMEMBERED = 100_000  # request id -> worker, for release; far longer than any lease lives


class RayPool:
    def __init__(self, spec: ReplicaSpec, loaded: build.LoadedModel, max_model_len: int, block_size: int):
        self.spec, self.loaded = spec, loaded
        self.max_model_len, self.block_size = max_model_len, block_size
        self.config: PoolConfig = spec.server.pool
        # the workers' prefix caches name blocks under this salt: the router's hints too (start()
        # adopts a worker's own, as --quantization auto resolves on the worker's device)
        self.cache_salt = build.cache_salt(loaded, block_size, spec.engine.kv_cache_dtype)
        self.metrics = Metrics()  # the gateway's; each worker has its own engine metrics
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ray-pool", daemon=True)
        self._handle = None
        self._started_ray = False
        self._leases: OrderedDict[str, str] = OrderedDict()  # request id -> worker id
        self._progress: dict[str, Progress] = {}
        self._total_blocks = 0
        self._gpus = 0.0

    # ---- life ----
    def start(self) -> None:
        if self._handle is not None:
            return
        import ray
        from ray import serve

        c = self.config
        if not ray.is_initialized():
            # a local Ray's workers run at normal priority: they compute (Ray's default of nice 15
            # lost a third of a CPU worker's throughput to the gateway and Ray's own processes)
            local = {} if c.ray_address else {"include_dashboard": False, "_system_config": {"worker_niceness": 0}}
            ray.init(address=c.ray_address, logging_level=logging.WARNING, log_to_driver=True, **local)
            self._started_ray = True
        self._gpus = c.worker_gpus if c.worker_gpus is not None else (1.0 if ray.cluster_resources().get("GPU") else 0.0)
        try:
            serve.start(http_options={"location": "NoServer"})
            self._thread.start()
            self._deploy(self.config.bounds()[0])
            self._handle = self._wait_for_a_worker()
        except BaseException:
            if self._started_ray:
                ray.shutdown()
            raise
        info = self._call("info", {}, timeout_s=60.0)
        self._total_blocks = int(info["total_blocks"])
        if info.get("cache_salt"):
            self.cache_salt = bytes.fromhex(info["cache_salt"])
        log.info("pool: %d worker(s) asked, %s GPU(s) each; first worker %s on %s", self.config.bounds()[0],
                 self._gpus, info["worker"], info["node_ip"])

    def stop(self) -> None:
        if self._handle is None:
            return
        import ray
        from ray import serve

        # each worker drains first (PrefillReplica.__del__); a Ray already gone (its processes got the
        # terminal's Ctrl-C too) would make this wait forever
        deleting = threading.Thread(target=_quietly, args=(serve.delete, APP), name="ray-pool-stop", daemon=True)
        deleting.start()
        deleting.join(self.spec.server.drain_timeout_s + 15.0)
        if deleting.is_alive():
            log.warning("pool: the workers did not stop in time")
        if self._started_ray:
            ray.shutdown()  # stops the local Ray this pool started, workers included
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._handle = None

    def set_workers(self, n: int) -> None:
        """Redeploy with ``n`` workers (a rolling update: old workers finish what they hold first).
        Returns once Serve has the new target."""
        self._deploy(n)

    def _deploy(self, num_workers: int) -> None:
        """(Re)deploy with this many workers, without waiting for them (one waiting for a GPU may
        never come): start() waits for one. A redeploy is a rolling update: each old worker drains."""
        from ray import serve
        from ray.serve.api import RunTarget

        app = deployment(self.spec, self._gpus, num_workers).bind(self.spec)
        serve.run_many([RunTarget(app, name=APP, route_prefix=None)], wait_for_applications_running=False)

    def _wait_for_a_worker(self):
        from ray import serve

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._replica_states().get("RUNNING", 0) > 0:
                return serve.get_app_handle(APP)
            app = serve.status().applications.get(APP)
            if app is not None and str(getattr(app.status, "value", app.status)) == "DEPLOY_FAILED":
                raise PrefillError(f"the prefill workers failed to start: {app.message}")
            time.sleep(0.5)
        raise PrefillError(f"no prefill worker started within {START_TIMEOUT_S:g} s: {self.not_ready()}")

    def _replica_states(self) -> dict[str, int]:
        from ray import serve

        try:
            app = serve.status().applications.get(APP)
            dep = app.deployments.get(DEPLOYMENT) if app else None
            return {str(getattr(k, "value", k)): v for k, v in (dep.replica_states if dep else {}).items()}
        except Exception:  # noqa: BLE001 - the controller may be restarting
            return {}

    # ---- requests ----
    def submit(self, req: PrefillRequest) -> Future:
        return asyncio.run_coroutine_threadsafe(self._run(req, None), self._loop)

    def start_stream(self, req: PrefillRequest) -> tuple[Future, Future]:
        params: Future = Future()
        result = asyncio.run_coroutine_threadsafe(self._run(req, params), self._loop)
        result.add_done_callback(lambda f: _fail_if_pending(params, f))
        return params, result

    async def _run(self, req: PrefillRequest, params: Future | None):
        """One request's events from its worker; a worker lost before the decode was told anything
        (no params sent) gets the request run once more on another (see the module's Recovery)."""
        from ray.exceptions import RayActorError

        body = msg.request_to_dict(req)
        hints: dict[str, Any] = {"num_tokens": len(req.prompt_token_ids), "request_id": req.request_id}
        if self.config.routing == "prefix":
            hints["prefix"] = prefix_hashes(req.prompt_token_ids, self.block_size,
                                             with_client_salt(self.cache_salt, req.cache_salt))
        accept_s = self.spec.engine.max_queue_wait_s
        worker = None
        for attempt in (1, 2):
            gen = self._handle.options(stream=True).run.remote({**body, "_hints": hints})
            events, nxt, sent = gen.__aiter__(), None, time.monotonic()
            try:
                while True:
                    nxt = asyncio.ensure_future(events.__anext__())
                    while not (await asyncio.wait({nxt}, timeout=WORKER_SILENT_S if worker else ACCEPT_S))[0]:
                        if worker is None and not self._running_ids() and time.monotonic() - sent < accept_s:
                            continue  # no worker runs yet: Serve holds the request until one does
                        _abandon(nxt, gen)
                        if worker is None and not self._running_ids():
                            raise NoWorker(f"no prefill worker took the request within --max-queue-wait {accept_s:g} "
                                           "s (none is running): retry later", retry_after_s=5.0)
                        raise _WorkerSilent(worker)
                    try:
                        ev = nxt.result()
                    except StopAsyncIteration:
                        raise WorkerLost(f"prefill worker {worker} ended request {req.request_id} without a "
                                         "result; retry") from None
                    kind = ev["event"]
                    if kind == "accepted":
                        worker = ev["worker"]
                        self._remember(req.request_id, worker)
                    elif kind == "params":
                        if params is not None and params.set_running_or_notify_cancel():
                            params.set_result(ev["params"])
                    elif kind == "progress":
                        self._progress[req.request_id] = msg.progress_from_event(ev)
                    elif kind == "result":
                        return msg.result_from_dict(ev["result"])
                    elif kind == "error":
                        raise msg.error_from_event(ev)
            except (RayActorError, _WorkerSilent) as e:
                if isinstance(e, RayActorError):
                    how = f"prefill worker {worker or '?'} died while computing this request ({type(e).__name__})"
                elif worker is None:
                    how = f"the prefill worker this request went to did not take it within {ACCEPT_S:g} s"
                else:
                    how = f"prefill worker {worker} sent nothing for {WORKER_SILENT_S:g} s while computing this request"
                # a worker that has the request (said so, or Serve sent it there) may still hold its
                # id: the run again goes elsewhere, or not at all
                held = worker or ((r := self._router()) and r.routed_to(req.request_id))
                others = self._running_ids() - {held}
                if attempt == 2 or (params is not None and params.done()) or not others:
                    raise WorkerLost(f"{how}; the pool replaces it: retry") from None
                log.warning("pool: %s (%s): running it on another", how, req.request_id)
                hints["avoid"] = [held] if held else []
                worker = None
            except asyncio.CancelledError:
                _abandon(nxt, gen)  # the worker cancels the request and frees its blocks
                raise
            finally:
                self._progress.pop(req.request_id, None)

    def _remember(self, request_id: str, worker: str) -> None:
        self._leases[request_id] = worker
        self._leases.move_to_end(request_id)
        while len(self._leases) > _LEASES_REMEMBERED:
            self._leases.popitem(last=False)

    def release(self, request_id: str) -> bool:
        worker = self._leases.pop(request_id, None)
        if worker is None or worker not in self._running_ids():
            return False
        asyncio.run_coroutine_threadsafe(self._release(request_id, worker), self._loop)
        return True

    async def _release(self, request_id: str, worker: str) -> None:
        # Sent to a hung worker, the call would hold one of Serve's routing tasks (two per worker) until
        # it timed out, delaying every other request's routing: it waits until the worker answers again
        # (a slow one keeps its KV otherwise) or is gone (its leases went with it)
        deadline = time.monotonic() + RELEASE_WAIT_S
        while not ((r := self._router()) and r.answering(worker)):
            if r is None or worker not in r.running_ids():
                return
            if time.monotonic() > deadline:
                log.warning("pool: release of %s not sent: worker %s silent for %g s", request_id, worker,
                            RELEASE_WAIT_S)
                return
            await asyncio.sleep(0.5)
        try:
            await asyncio.wait_for(self._handle.release.remote({"request_id": request_id,
                                                                "_hints": {"replica": worker}}), CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a worker gone meanwhile took its leases with it
            log.info("pool: release of %s on %s failed (%s)", request_id, worker, type(e).__name__)

    def keep(self, request_ids: list[str], ttl_s: float) -> None:
        """One call to each worker holding some of these leases (those of gone workers went with them)."""
        by_worker: dict[str, list[str]] = {}
        running = self._running_ids()
        for rid in request_ids:
            if (worker := self._leases.get(rid)) is not None and worker in running:
                by_worker.setdefault(worker, []).append(rid)
        for worker, ids in by_worker.items():
            asyncio.run_coroutine_threadsafe(self._keep(ids, ttl_s, worker), self._loop)

    async def _keep(self, request_ids: list[str], ttl_s: float, worker: str) -> None:
        try:
            await asyncio.wait_for(self._handle.keep.remote({"request_ids": request_ids, "ttl_s": ttl_s,
                                                             "_hints": {"replica": worker}}), CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a worker gone or hung: the next round tries again
            log.info("pool: keeping %d leases on %s failed (%s)", len(request_ids), worker, type(e).__name__)

    def progress(self, request_id: str) -> Progress | None:
        return self._progress.get(request_id)

    # ---- state ----
    def _router(self) -> PrefillRouter | None:
        return routers.LIVE[-1] if routers.LIVE else None

    def _running_ids(self) -> set[str]:
        r = self._router()
        return r.running_ids() if r else set()

    def workers(self) -> list[dict[str, Any]]:
        """Each running worker and its load (GET /v1/pool), plus the count of those starting or
        waiting for resources."""
        r = self._router()
        return r.workers() if r else []

    def pool_status(self) -> dict[str, Any]:
        return {"routing": self.config.routing, "worker_gpus": self._gpus, "bounds": list(self.config.bounds()[1:]),
                "replica_states": self._replica_states(), "workers": self.workers()}

    def load(self) -> WorkerLoad:
        workers = self.workers()
        stats = [w["stats"] for w in workers if w["stats"]]
        return WorkerLoad(waiting=sum(s.get("waiting", 0) for s in stats), running=sum(s.get("running", 0) for s in stats),
                          pending_tokens=sum(w["outstanding_tokens"] for w in workers),
                          free_blocks=sum(s.get("free_blocks", 0) for s in stats),
                          total_blocks=sum(s.get("total_blocks", 0) for s in stats), block_size=self.block_size,
                          tokens_per_s=sum(s.get("tokens_per_s") or 0.0 for s in stats) or None)

    def alive(self) -> bool:
        return self._handle is not None and self._thread.is_alive()

    def not_ready(self) -> list[str]:
        if self._handle is not None and self.workers():
            return []
        states = self._replica_states()
        return [f"no prefill worker is running (replicas: {states or 'none'})"]

    def fits_whole(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self._total_blocks

    def render_metrics(self) -> bytes:
        texts: dict[str, bytes] = {}
        pending = {w["worker"]: w["outstanding_tokens"] for w in self.workers()}
        futs = {w: asyncio.run_coroutine_threadsafe(self._metrics_of(w), self._loop) for w in pending}
        for w, f in futs.items():
            try:
                texts[w] = f.result(CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a worker going away is not a metrics error
                log.info("pool: no metrics from %s (%s)", w, type(e).__name__)
        return pool_metrics.merge(self.metrics.render(), texts, pending)

    def check_admission(self) -> None:
        """Nothing here: each worker admits its own requests, and routing may find one with room."""

    def reset_prefix_cache(self) -> int:
        """Every running worker forgets its cached blocks; returns the blocks freed, summed (a worker
        that does not answer in time is logged and left out)."""
        futs = {w["worker"]: asyncio.run_coroutine_threadsafe(self._reset_on(w["worker"]), self._loop)
                for w in self.workers()}
        if (r := self._router()) is not None:
            r.forget_prefixes()
        freed = 0
        for w, f in futs.items():
            try:
                freed += int(f.result(CALL_TIMEOUT_S + 1))
            except Exception as e:  # noqa: BLE001 - a worker going away has no cache to reset
                log.warning("pool: prefix cache reset on %s failed (%s)", w, type(e).__name__)
        return freed

    async def _reset_on(self, worker: str) -> int:
        return await asyncio.wait_for(self._handle.reset_prefix_cache.remote({"_hints": {"replica": worker}}),
                                      CALL_TIMEOUT_S)

    async def _metrics_of(self, worker: str) -> bytes:
        return await asyncio.wait_for(self._handle.metrics_text.remote({"_hints": {"replica": worker}}), CALL_TIMEOUT_S)

    def _call(self, method: str, body: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S):
        async def call():
            return await getattr(self._handle, method).remote(body)
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(call(), timeout_s), self._loop).result(timeout_s + 1)


class _WorkerSilent(Exception):
    """The worker holding a request sent nothing for WORKER_SILENT_S (or none took it in ACCEPT_S)."""


def _abandon(nxt: asyncio.Future | None, gen) -> None:
    """Stop waiting on a worker's stream and cancel the request there (if it can still hear)."""
    if nxt is not None:
        nxt.add_done_callback(mark_read)  # it ends RequestCancelledError
        nxt.cancel()
    gen.cancel()


def _quietly(f, *args) -> None:
    try:
        f(*args)
    except Exception as e:  # noqa: BLE001 - stopping: nothing to do about it but say so
        log.warning("pool: %s failed while stopping (%s: %s)", getattr(f, "__name__", f), type(e).__name__, e)


def _fail_if_pending(params: Future, result: Future) -> None:
    """A request that ended before its params went out: the params' waiter learns why."""
    if params.done():
        return
    if result.cancelled():
        params.cancel()
    elif (e := result.exception()) is not None and params.set_running_or_notify_cancel():
        params.set_exception(e)
    elif params.set_running_or_notify_cancel():
        params.set_exception(PrefillError("the request ended before its kv_transfer_params were sent"))


def deployment(spec: ReplicaSpec, gpus: float, num_workers: int):
    """The Serve deployment of the workers: one replica per worker, each in its own placement group
    (its GPU and CPUs reserved together), health-checked, routed by PrefillRouter."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    c, scfg = spec.server.pool, spec.server
    bundle = {"CPU": c.worker_cpus, **({"GPU": gpus} if gpus else {})}
    _, lo, hi = c.bounds()
    scaling: dict[str, Any] = {"num_replicas": num_workers}
    if lo < hi:
        scaling = {"autoscaling_config": {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": num_workers,
            "upscale_delay_s": 5.0, "downscale_delay_s": 60.0,
            "policy": {"policy_function": POLICY, "policy_kwargs": {"target_tokens": c.autoscale_tokens}}}}
    return serve.deployment(PrefillReplica).options(
        name=DEPLOYMENT, ray_actor_options={"num_cpus": c.worker_cpus, "num_gpus": gpus},
        placement_group_bundles=[bundle], placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=100_000,  # the engine queues and sheds (429) itself
        # a hung worker fails three checks in a row (~30 s), then gets the graceful stop's timeout
        health_check_period_s=2.0, health_check_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=1.0, graceful_shutdown_timeout_s=scfg.drain_timeout_s + 5.0,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefillRouter,
            request_router_kwargs={"policy": c.routing, "prefix_slack_tokens": c.prefix_slack_tokens},
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0),
        logging_config={"enable_access_log": False}, **scaling)


def build_ray_pool(ecfg: EngineConfig, scfg: ServerConfig, fleet) -> RayPool:
    """The pool for these configs (started by ``start``): the gateway reads the model's config and
    tokenizer only; each worker loads the weights."""
    loaded = build.describe(ecfg)
    block_size = ecfg.block_size or next((f.block_size for f in fleet if f.block_size), None) or build.DEFAULT_BLOCK_SIZE
    # every worker the same block size; the API key stays here (the spec is kept by Serve's controller)
    spec = ReplicaSpec(dataclasses.replace(ecfg, block_size=block_size), dataclasses.replace(scfg, api_key=None),
                       tuple(fleet))
    return RayPool(spec, loaded, context_len(loaded.config, fleet), block_size)
