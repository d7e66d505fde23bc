"""The pure core: no ray, grpc, redis or zmq (CONTRIBUTING §1)."""
