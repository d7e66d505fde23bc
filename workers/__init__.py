"""The Ray shells of the session fleet (docs/architecture.md)."""

import fleet  # noqa: F401  - first: its environment defaults (gRPC fork handlers) precede any grpc import
