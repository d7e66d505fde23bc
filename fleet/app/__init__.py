"""The top layer: the CLI, the demo and the test kit (the vLLM stand-in, the local stack)."""
