"""The workspace: every path the page names lies inside it, uploads are limited and named safely."""

import asyncio

import pytest

from qatune.ui import PageError
from qatune.ui.workspace import Workspace, upload_name


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


def test_an_upload_lands_in_sheets_under_a_free_name(tmp_path):
    workspace = Workspace(tmp_path)
    first = asyncio.run(workspace.save_upload("faq.csv", chunks(b"question,", b"answer\nq,a\n"), limit=100))
    second = asyncio.run(workspace.save_upload("faq.csv", chunks(b"question,answer\nq,b\n"), limit=100))
    assert (first, second) == ("faq.csv", "faq-2.csv")
    assert (tmp_path / "sheets" / "faq.csv").read_bytes() == b"question,answer\nq,a\n"
    assert workspace.sheets() == ["faq-2.csv", "faq.csv"]


def test_an_upload_over_the_limit_is_refused_and_leaves_nothing(tmp_path):
    workspace = Workspace(tmp_path)
    with pytest.raises(PageError, match="larger than the upload limit") as raised:
        asyncio.run(workspace.save_upload("big.csv", chunks(b"x" * 60, b"x" * 60), limit=100))
    assert raised.value.status == 413
    assert list((tmp_path / "sheets").iterdir()) == []
    with pytest.raises(PageError, match="empty"):
        asyncio.run(workspace.save_upload("empty.csv", chunks(), limit=100))
