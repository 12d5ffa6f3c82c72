"""serve: the long-running sidecar.

- http.py     the HTTP layer: parsing, routing, status codes, the listening
              socket, and `serve()`, the process's main loop.
- service.py  what each endpoint does (ensure, hold, release, gc, status,
              health) and the background work (hold leases, scheduled gc,
              the clone journal, the tokens file's watch and reload).
- policy.py   who may do what: tokens (and those retiring after a rotation),
              scopes, repositories, tightened gc limits.
- metrics.py  the Prometheus registry: every metric declared once (CATALOGUE),
              the store's figures read at each scrape; docs/runbook.md's
              metrics reference is generated from it.
- openapi.json  the API's OpenAPI 3.1 document (served at /openapi.json).
"""
