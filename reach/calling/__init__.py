"""The caller's side of a call, one concern a module; ``reach.client.ReachClient`` puts
them together.

- ``result``: ``CallResult``, what a call returns;
- ``state``: ``CallState``, one call across its attempts;
- ``plan``: call planning: candidates, deadline, contract pre-check, the encoded request;
- ``attempt``: one attempt: the instance chosen, its call token, request/reply, the
  error of a failed reply, breakers and latency told what happened;
- ``retry``: the retry policy: which failures are retried, the retry budget, backoff,
  and waiting for an instance while the fabric settles after a reconnect;
- ``fallbacks``: what a failed call answers with instead (``reach.fallback`` configures it).

The call's audit event is written by ``reach.audit.recording``; an async-mode call's job
is looked up through ``reach.jobs``.
"""
