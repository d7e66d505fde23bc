"""Register the chart's vLLM workers with the controller (a Helm post-install/upgrade hook).

Env: KVFLEET_CONTROLLER (host:port), KVFLEET_TOKEN (operator bearer token), KVFLEET_WORKERS (JSON
list of {name, url, kvEvents, replay, model, dpRanks, dpRankStart}), KVFLEET_TLS ("1" for TLS), KVFLEET_CA (CA file),
KVFLEET_TLS_CLIENT_CERT / KVFLEET_TLS_CLIENT_KEY (mutual TLS: this job's certificate and key).
Registering the same spec again is a no-op (upgrades are idempotent); a worker whose values changed
is unregistered and registered with the new spec. Workers removed from the values stay registered.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    from fleet.core.errors import AlreadyExists
    from fleet.sdk import FleetClient

    workers = json.loads(os.environ["KVFLEET_WORKERS"])
    tls = os.environ.get("KVFLEET_TLS") == "1"
    ca = os.environ.get("KVFLEET_CA") or None
    ca = ca if ca and os.path.exists(ca) else None  # a TLS Secret without ca.crt: system roots
    cert, key = os.environ.get("KVFLEET_TLS_CLIENT_CERT"), os.environ.get("KVFLEET_TLS_CLIENT_KEY")
    with FleetClient(os.environ["KVFLEET_CONTROLLER"], token=os.environ["KVFLEET_TOKEN"], tls=tls,
                     root_certificates=ca, client_cert=cert, client_key=key, timeout=30.0) as client:
        for w in workers:
            spec = dict(url=w["url"], kv_events=w["kvEvents"], replay=w.get("replay", ""), model=w.get("model", ""),
                        dp_ranks=w.get("dpRanks", 1), dp_rank_start=w.get("dpRankStart", 0))
            try:
                client.register_worker(w["name"], **spec)
                print(f"registered {w['name']}: {w['url']} kv-events {w['kvEvents']}")
            except AlreadyExists:  # registered with another spec: the values changed, so replace it
                client.unregister_worker(w["name"])
                client.register_worker(w["name"], **spec)
                print(f"re-registered {w['name']} with its new spec: {w['url']} kv-events {w['kvEvents']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
