"""kvfleet: the KV-cache layer for LLM agent fleets (docs/architecture.md)."""

import os

# gRPC's fork handlers off unless the user chose otherwise: kvfleet forks only to exec (a local Ray's head
# processes start from inside a running controller), and with the handlers on, gRPC's event engine
# restarts in the child and crashes it before the exec about one fork in five while RPCs are in flight
# (measured: 66 of 300 children died with them on, 0 of 300 with them off). A local Ray whose GCS server
# died that way made the controller's first session call wait out Ray's 30 s start. gRPC's maintainers
# meant this off by default too (grpc/grpc#41455).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
