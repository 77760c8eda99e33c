"""benchmarks/common.report_tables: what a run found goes between its tables and "Method:" in
RESULTS.md (and is printed), the method after it."""

from __future__ import annotations

from benchmarks import common


def test_findings_sit_between_the_tables_and_the_method(monkeypatch, capsys):
    written = []
    monkeypatch.setattr(common, "append_results", lambda title, body: written.append((title, body)) or "RESULTS.md")
    common.report_tables([(["a", "b"], [[1, 2]])], "title", ["- how it was run"], write=True,
                         findings=["- ratio 1.01x"])
    ((title, body),) = written
    assert title == "title"
    assert body == "| a | b |\n|---|---|\n| 1 | 2 |\n\n- ratio 1.01x\n\nMethod:\n\n- how it was run"
    assert "- ratio 1.01x" in capsys.readouterr().out


def test_without_findings_the_method_follows_the_tables_as_before(monkeypatch):
    written = []
    monkeypatch.setattr(common, "append_results", lambda title, body: written.append(body) or "RESULTS.md")
    common.report_tables([(["a"], [[1]])], "title", ["- m"], write=True)
    assert written == ["| a |\n|---|\n| 1 |\n\nMethod:\n\n- m"]
