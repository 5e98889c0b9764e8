"""The pool of prefill workers on Ray Serve (``serve --workers N`` / ``--ray-address``): ``pool.py``
(the gateway's PrefillWorker over the pool), ``replica.py`` (one worker), ``router.py`` (which worker
takes a request), ``autoscaling.py`` and ``messages.py`` (what crosses between them). Nothing here
is imported unless the pool is on."""
