"""Block hashes recomputed from token ids match the vectors' (sha256/pickle and sha256_cbor)."""

from __future__ import annotations

import pytest
from support.vllm_vectors import frames, load, unhex

from fleet.core.block_hash import (
    HashConfig,
    calibrates,
    chain,
    external_chain,
    hash_block,
    none_hash,
    to_external,
)
from fleet.core.errors import InvalidArgument

V = load()
HP = V["hash_params"]


def _derivations() -> list[tuple[str, str, dict]]:
    out = []
    for v in V["vectors"]:
        algo = "sha256_cbor" if v["name"] == "sha256_cbor" else "sha256"
        out += [(v["name"], algo, d) for d in v.get("hash_derivation", [])]
    return out


def test_none_hash_matches_reference() -> None:
    assert none_hash("sha256").hex() == HP["none_hash_hex"]
    assert none_hash("sha256_cbor").hex() == HP["none_hash_hex_sha256_cbor"]
    assert none_hash("sha256", "0") != none_hash("sha256")  # a deployed PYTHONHASHSEED changes the seed


@pytest.mark.parametrize("name,algo,d", _derivations(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_derivation_recomputes(name: str, algo: str, d: dict) -> None:
    cfg = HashConfig(algo, None, HP["block_size"])
    parent = bytes.fromhex(d["parent_digest_hex"]) if d["parent_digest_hex"] else None
    extra = unhex(d["extra_keys_hashed"]) if d["extra_keys_hashed"] is not None else None
    got = hash_block(cfg, parent, d["tokens"], extra)
    assert got.hex() == d["digest_hex"] and to_external(got) == d["external_int"]


def test_chains_from_token_ids_match_event_hashes() -> None:
    by = {v["name"]: v for v in V["vectors"]}
    toks, B = V["token_ids"], HP["block_size"]
    sha = HashConfig("sha256", None, B)
    main = chain(sha, toks)
    assert [d.hex() for d in main] == [b["digest_hex"] for b in V["main_chain"]]
    ev = lambda n: list(by[n]["decoded"]["events"][0]["block_hashes"])  # noqa: E731
    assert external_chain(sha, toks[:3 * B]) == ev("stored_root_chain")
    # the continuation needs the FULL parent digest (events carry only 64 bits)
    assert [to_external(d) for d in chain(sha, toks[3 * B:6 * B], parent=main[2], start_block=3)] == \
        ev("stored_continuation")
    assert external_chain(sha, toks[:2 * B], lora=("sql-lora", "/adapters/sql-lora")) == ev("stored_lora")
    assert external_chain(sha, toks[:B], cache_salt="tenant-a") == ev("stored_salt_and_mm")[:1]
    assert external_chain(HashConfig("sha256_cbor", None, B), toks[:2 * B]) == ev("sha256_cbor")
    # controls: each ingredient matters (non-vacuous)
    wrong = {
        "seed": external_chain(HashConfig("sha256", "0", B), toks[:3 * B]),
        "lora_path": external_chain(sha, toks[:2 * B], lora=("sql-lora", "/elsewhere")),
        "salt": external_chain(sha, toks[:B], cache_salt="tenant-b"),
        "algo": external_chain(HashConfig("sha256_cbor", None, B), toks[:3 * B]),
    }
    mism = {k: sum(a != b for a, b in zip(w, ev("stored_lora" if k == "lora_path" else
                                               "stored_salt_and_mm" if k == "salt" else "stored_root_chain"),
                                           strict=False)) for k, w in wrong.items()}
    print("hash recompute: max mismatches 0 with the right config; controls (mismatching blocks):", mism)
    assert all(n > 0 for n in mism.values())


def test_salt_only_on_block_zero() -> None:
    sha, toks = HashConfig(), V["token_ids"][:48]
    a, b = chain(sha, toks, cache_salt="t"), chain(sha, toks)
    assert a[0] != b[0] and hash_block(sha, a[0], toks[16:32]) == a[1]  # block 1 carries no salt key


def test_self_calibration() -> None:
    t, B = V["token_ids"], HP["block_size"]
    h0 = frames(V["vectors"][0])  # parentless, extra-free vector
    first = V["vectors"][0]["decoded"]["events"][0]["block_hashes"][0]
    assert h0, "the vector has frames"
    assert calibrates(HashConfig("sha256", None, B), t, first)
    assert not calibrates(HashConfig("sha256", "42", B), t, first)
    assert not calibrates(HashConfig("sha256", None, 8), t, first)
    assert not calibrates(HashConfig("sha256_cbor", None, B), t, first)


def test_bad_configs_rejected() -> None:
    with pytest.raises(InvalidArgument):
        HashConfig("xxhash")
    with pytest.raises(InvalidArgument):
        HashConfig("sha256", None, 0)


def test_untagged_extra_keys_are_the_plain_strings_vllm_published_before_the_tags() -> None:
    """Releases before the domain tags hashed (lora_name, ..., salt on block 0), the tuple their events publish;
    restated here without block_extra. The tagged form differs (control)."""
    from fleet.core.block_hash import HashConfig, chain, hash_block

    toks = list(range(40))  # two full blocks of 16, and a partial one
    plain, tagged = HashConfig(extra_format="untagged"), HashConfig()
    b0 = hash_block(plain, None, toks[:16], ("sql-lora", "tenant-a"))
    b1 = hash_block(plain, b0, toks[16:32], ("sql-lora",))
    assert chain(plain, toks, lora=("sql-lora", "/adapters/sql"), cache_salt="tenant-a") == [b0, b1]
    assert chain(tagged, toks, lora=("sql-lora", "/adapters/sql"), cache_salt="tenant-a")[0] != b0
    assert chain(plain, toks, cache_salt="") == chain(plain, toks)  # an empty salt adds nothing
