"""benchmarks/transfer_overlap.py's table: a layered transfer shows its open time (doorbell ->
ack, the prefill's compute included) beside its wire time and the wire's GB/s."""

from __future__ import annotations

from benchmarks.transfer_overlap import OVERLAP_HEADERS, OverlapResult, overlap_rows


def test_the_overlap_row_gives_open_and_wire_time_and_gbps_over_the_wire_time():
    r = OverlapResult(512, 1, [2.5, 2.7, 2.6], [0.027, 0.021, 0.030], [0.0015, 0.0054, 0.0017], nbytes=23_592_960,
                      open_layered_s=[2.09, 2.2, 2.0], wire_layered_s=[0.04, 0.05, 0.03])
    (row,) = overlap_rows([r])
    assert dict(zip(OVERLAP_HEADERS, row)) == {
        "prompt tokens": 512, "prefill steps (chunks)": 1, "prefill ms": "2600",
        "one-shot: token -> KV at D ms": "27.0", "layered: token -> KV at D ms": "1.7",
        "share of transfer hidden": "94%", "one-shot per run ms": "27.0 / 21.0 / 30.0",
        "layered per run ms": "1.5 / 5.4 / 1.7", "layered: open ms (doorbell -> ack)": "2090.0",
        "layered: wire ms": "40.0", "layered: wire GB/s": "0.59"}
