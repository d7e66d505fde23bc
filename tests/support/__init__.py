"""The tests' shared support package (importable as `support`: pytest puts tests/ on the path).

    support.controller         tokens files and a real controller on a loopback port (the gRPC tests)
    support.kvfleet_up         `kvfleet up --json` as a real process (the CLI tests)
    support.proxy_fleet        controller + stand-ins + proxy, each stand-in's requests recorded
    support.chaos              the lifecycle chaos harness (kvfleet's router against a lifecycle-blind one)
    support.vllm_vectors       the byte-exact vLLM KV-event and block-hash vectors of shared/reference
    support.vllm_pool_ref      a model of vLLM v1's block pool and KV cache manager (the stand-in's differential tests)
    support.kernels            tiny seeded kernels and token factories for the kernel contract suite
    support.workers            the kernel spec and helpers of the Ray session-fleet tests
    support.blob_store_contract  the BlobStore contract every store backend runs
    support.helm_values        the chart's values table (also a script that rewrites the chart README)

What the demo and the benches share with the tests (a whole fleet on loopback: controller, N vLLM
stand-ins, tokens, registration, proxy) lives in the package itself, fleet.app.testkit.stack.
"""
