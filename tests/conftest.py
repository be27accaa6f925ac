"""Every temporary folder the suite's processes make (the spawned ranks' folders, torchrun's logs)
goes under one folder that is removed when the session ends: runs write checkpoints, and a suite
left behind a few GB in /tmp each time before."""

import multiprocessing.util
import os
import shutil
import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_tmpdir():
    # multiprocessing's own folder (the rank fork server's socket) stays where it is: it removes it
    # at exit, after this fixture removed ours.
    multiprocessing.util.get_temp_dir()
    folder = tempfile.mkdtemp(prefix="torchpar_tests_")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder  # mkdtemp in this process; TMPDIR in its children
    cache = os.environ.get("TORCHPAR_CACHE")
    os.environ["TORCHPAR_CACHE"] = os.path.join(folder, "cache")  # the machine probe's, not the user's
    yield
    if cache is None:
        os.environ.pop("TORCHPAR_CACHE", None)
    else:
        os.environ["TORCHPAR_CACHE"] = cache
    tempfile.tempdir = None
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(folder, ignore_errors=True)
