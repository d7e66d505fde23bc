"""The labelled prompt-injection data set the quarantine detector's layers are trained and measured on.

Read from public corpora shipped in PyPI wheels (as zip files: nothing is installed or imported from them),
placed into tool results, and split train / validation / test with fixed seeds. `build.build_data` is the
entry point; scripts/train_detector.py lists the sources and their licences. Same inputs, same bytes out.

    sources     wheels, licences, sampling constants, `Example`, the seeded split
    agentdojo   AgentDojo's tool environments and its templates x goals in its injection vectors
    original    bastioncorpus, agent-injection-bench, spikee
    short       the short attack corpora and those added for issue #15, placed into tool results
    benign      real benign text: files from popular wheels, the first packages' docs and code
    build       all of it, with provenance
"""
