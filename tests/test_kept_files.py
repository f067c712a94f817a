"""The user's files, put back after the replays (oomdoc.kept_files, and the
replay's audit hook that notes them: oomdoc.capture.replay_writes)."""

import os
import shutil
import sys
import tempfile

import pytest
from conftest import run_as_replay, tree

from oomdoc.capture.replay_writes import WrittenFiles
from oomdoc.kept_files import FileKeeper, put_back


def user_files(root):
    (root / "runs" / "version_0").mkdir(parents=True)
    (root / "runs" / "version_0" / "step-9.pt").write_bytes(b"old checkpoint")
    (root / "last.pt").write_bytes(b"the user's weights")
    (root / "train.log").write_text("an earlier run\n")
    (root / "old").mkdir()
    (root / "old" / "a.txt").write_text("kept")
    os.symlink("last.pt", root / "best.pt")


def replay_writes_as_scripts_do(root):
    """What a training script does to its files, as one replay."""
    with open(root / "train.log", "a") as log:  # appended
        log.write("a replay's step\n")
    os.makedirs(root / "runs" / "version_1")  # a new run folder
    (root / "runs" / "version_1" / "step-0.pt").write_bytes(b"replay")
    (root / "last.pt.tmp").write_bytes(b"replay weights")  # saved atomically
    os.replace(root / "last.pt.tmp", root / "last.pt")
    (root / "runs" / "version_0" / "step-10.pt").write_bytes(b"replay")
    os.remove(root / "runs" / "version_0" / "step-9.pt")  # rotated
    os.rename(root / "runs" / "version_0", root / "runs" / "archived")  # a folder moved
    shutil.rmtree(root / "old")  # a folder removed whole
    os.remove(root / "best.pt")
    os.symlink("runs/version_1/step-0.pt", root / "best.pt")  # a link moved
    with open(root / "new.json", "w") as metrics:  # created
        metrics.write("{}")


def test_a_replay_s_changes_are_all_put_back(tmp_path, monkeypatch):
    root = tmp_path / "work"
    root.mkdir()
    user_files(root)
    before = tree(root)
    monkeypatch.chdir(root)
    written = WrittenFiles([], FileKeeper(str(tmp_path / "kept")))
    sys.addaudithook(lambda event, args: written.hook(event, args) if watching else None)
    watching = True
    try:
        replay_writes_as_scripts_do(root)
    finally:
        watching = False
    assert tree(root) != before
    done = put_back(str(tmp_path / "kept"))
    assert tree(root) == before
    assert not done.failed
    assert str(root / "last.pt") in done.restored
    assert str(root / "new.json") in done.removed
    assert str(root / "runs" / "version_1") in done.removed
    assert str(root / "train.log") in written.fields()["paths"]


def test_the_first_note_of_a_path_is_what_the_user_s_run_left(tmp_path):
    """Two replays (two keepers, one folder) change the same file: the
    note the first took stands, so the second's version is not kept."""
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"user")
    first, second = FileKeeper(str(tmp_path / "kept")), FileKeeper(str(tmp_path / "kept"))
    first.keep(str(path))
    path.write_bytes(b"first replay")
    second.keep(str(path))
    path.write_bytes(b"second replay")
    put_back(str(tmp_path / "kept"))
    assert path.read_bytes() == b"user"


def test_what_cannot_be_put_back_is_named_and_its_copy_kept(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"user")
    FileKeeper(str(tmp_path / "kept")).keep(str(path))
    path.unlink()
    path.mkdir()  # a replay made a folder where the file was
    (path / "inside").write_text("x")
    done = put_back(str(tmp_path / "kept"), rescue_dir=str(tmp_path / "rescue"))
    ((failed, why),) = done.failed
    assert failed == str(path)
    assert "its copy is at" in why
    (rescued,) = (tmp_path / "rescue").iterdir()
    assert rescued.name.startswith("kept-") and rescued.name.endswith("-ckpt.pt")
    assert rescued.read_bytes() == b"user"
    assert str(rescued) in why


def test_a_file_whose_copy_cannot_be_made_is_not_changed(tmp_path):
    """No copy, no change: the replay's open fails, the user's file stays."""
    (tmp_path / "kept").write_text("not a folder")  # the notes cannot go there
    (tmp_path / "ckpt.pt").write_bytes(b"user")
    script = (
        "import os\n"
        "from oomdoc.capture import replay_writes\n"
        f"replay_writes.watch([], {str(tmp_path / 'kept' / 'notes')!r})\n"
        "try:\n"
        "    open('ckpt.pt', 'wb').close()\n"
        "except PermissionError as error:\n"
        "    print('refused:', error)\n"
    )
    result = run_as_replay(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "refused: oomdoc: no copy of" in result.stdout
    assert (tmp_path / "ckpt.pt").read_bytes() == b"user"


@pytest.mark.parametrize("event", ["os.remove", "os.rename", "os.mkdir"])
def test_a_path_relative_to_a_folder_s_descriptor_is_not_taken_from_here(tmp_path, event):
    """shutil.rmtree removes what a folder holds by names relative to the
    folder's descriptor: those are not paths from the working directory
    (the tree was kept whole at rmtree's own event)."""
    written = WrittenFiles([], FileKeeper(str(tmp_path / "kept")))
    args = {
        "os.remove": ("step-1.pt", 3),
        "os.rename": ("a", "b", 3, 4),
        "os.mkdir": ("sub", 511, 3),
    }[event]
    written.hook(event, args)
    assert written.fields()["count"] == 0
    assert put_back(str(tmp_path / "kept")).changed == 0


def test_a_scratch_place_named_on_the_command_line_is_the_user_s(tmp_path, monkeypatch):
    """The temporary folder is libraries' scratch, unless the script's
    arguments name a place in it (`--output_dir /tmp/test-clm`, as the
    Hugging Face examples write it)."""
    monkeypatch.chdir(tmp_path)
    scratch = tempfile.gettempdir()
    output = os.path.join(scratch, "oomdoc-test-clm")
    written = WrittenFiles(
        [], None, ["--output_dir", output, f"--resume={scratch}/ckpt.pt", "--cache", scratch]
    )
    assert written.kept(os.path.join(output, "checkpoint-1", "model.safetensors"))
    assert written.kept(os.path.join(scratch, "ckpt.pt"))
    assert not written.kept(
        os.path.join(scratch, "torchinductor_root", "x.py")
    )  # the root itself: not
    assert not written.kept(os.path.join(scratch, "oomdoc-test-clm-other", "x"))


def test_the_note_names_a_few_paths_it_could_not_put_back_and_counts_the_rest():
    from types import SimpleNamespace

    from oomdoc.kept_files import PutBack
    from oomdoc.replay.written import FILES_NAMED, written_note

    written = SimpleNamespace(paths=["/work/last.pt"], count=1)
    replayer = SimpleNamespace(
        replays=[SimpleNamespace(capture=SimpleNamespace(files_written=written))]
    )
    failed = [(f"/work/f{n}", "a folder the replays made, still holding files") for n in range(7)]
    note = written_note(
        SimpleNamespace(cwd="/work"), replayer, PutBack(restored=["/work/last.pt"], failed=failed)
    )
    assert note.startswith("The replays wrote this file, as the script does when it runs: last.pt.")
    assert "put them back as your run left them: 1 path restored." in note
    assert f"f{FILES_NAMED - 1}: a folder" in note and f"f{FILES_NAMED}:" not in note
    assert f"and {7 - FILES_NAMED} more." in note
