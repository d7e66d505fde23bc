"""Test support that ships with the package: the vLLM stand-in (`kvfleet sim-vllm`) and the
lifecycle-blind baseline router that benchmarks and the demo compare kvfleet against.

Top layer (docs/architecture.md, "Layers"): modules here may import anything below; nothing in the
product (fleet's core, store, sdk; workers; controller) may import them.
"""
