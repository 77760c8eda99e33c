"""The per-call proof of the cluster secret on internal gRPC (proto/internal_auth.py)."""

from __future__ import annotations

import pytest

from proto.internal_auth import AUTH_METADATA_KEY, MAX_SKEW_S, auth_metadata, check_proof, make_proof

SECRET = b"s3cret-of-this-cluster"
DECODE = "/pdserve.v1.DecodeWorker/Decode"
NOW = 1_800_000_000.0


def test_a_proof_made_with_the_secret_verifies_for_its_method():
    assert check_proof(SECRET, DECODE, make_proof(SECRET, DECODE, NOW), NOW) is None


def test_a_proof_made_with_another_secret_is_refused():
    proof = make_proof(b"another-secret", DECODE, NOW)
    assert check_proof(SECRET, DECODE, proof, NOW) == (
        "the cluster secret's proof does not verify (wrong secret?)")


def test_a_proof_for_one_method_does_not_open_another():
    proof = make_proof(SECRET, "/pdserve.v1.DecodeWorker/GetLoad", NOW)
    assert check_proof(SECRET, DECODE, proof, NOW) == (
        "the cluster secret's proof does not verify (wrong secret?)")


def test_a_proof_older_than_the_skew_limit_is_refused():
    proof = make_proof(SECRET, DECODE, NOW)
    assert check_proof(SECRET, DECODE, proof, NOW + MAX_SKEW_S - 1) is None
    assert check_proof(SECRET, DECODE, proof, NOW + MAX_SKEW_S + 10) == (
        "the proof is 310s away from this worker's clock (limit 300s)")


@pytest.mark.parametrize("value", ["", "v1", "v2 1 2 3", "v1 abc nonce mac", "v1 1 2 3 4", "secret"])
def test_missing_or_malformed_metadata_is_refused_without_echoing_it(value):
    reason = check_proof(SECRET, DECODE, value, NOW)
    expected = (f"missing {AUTH_METADATA_KEY} metadata (the cluster secret's proof)" if not value
                else f"malformed {AUTH_METADATA_KEY} metadata")
    assert reason == expected


def test_two_proofs_for_the_same_call_differ_and_never_contain_the_secret():
    (key, first), ((_, second),) = auth_metadata(SECRET, DECODE)[0], auth_metadata(SECRET, DECODE)
    assert key == AUTH_METADATA_KEY
    assert first != second
    assert SECRET.decode() not in first + second
