"""Every shell and Python block of README.md and docs/*.md runs, in order, page by page,
in a fresh folder that holds what the pages name: `images/` + `boxes.csv`, and
stand-ins for `../shared/data/hymenoptera` and `../shared/data/bccd` (small generated
photos in the same layout, so the pages run in seconds with or without the real sets).
A block preceded by `<!-- not run by the docs test: WHY -->` is skipped, visibly."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import jpeg

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(<!--\s*not run by the docs test:[^>]*-->\s*\n)?```(bash|sh|python)\n(.*?)^```", re.S | re.M)
SKIP_BUDGET = 12  # skipped blocks in all pages together: keep them few


def blocks(page: str) -> list[tuple[str, str, bool]]:
    """(language, code, skipped) for every fenced bash/sh/python block of ``page``."""
    text = (ROOT / page).read_text()
    return [(m[2], m[3], bool(m[1])) for m in FENCE.finditer(text)]


def _photos(folder: Path, n: int, seed: int, h: int = 48, w: int = 64) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = folder / f"{folder.name}_{i:03d}.jpg"
        p.write_bytes(jpeg(h + 4 * (i % 3), w + 6 * (i % 4), seed=seed + i))
        out.append(p)
    return out


def workspace(tmp: Path) -> Path:
    """``tmp/project`` (the working folder) beside ``tmp/shared/data/...`` stand-ins."""
    project = tmp / "project"
    for cls, seed in (("cats", 0), ("dogs", 100)):
        _photos(project / "images" / cls, 8, seed)
    with open(project / "boxes.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["filename", "class", "xmin", "ymin", "xmax", "ymax"])
        for i in range(0, 8, 2):
            w.writerow([f"cats/cats_{i:03d}.jpg", "whisker", 2, 3, 30, 40])
    hym = tmp / "shared" / "data" / "hymenoptera" / "hymenoptera_data"
    for split, n in (("train", 16), ("val", 6)):
        for cls, seed in (("ants", 200), ("bees", 300)):
            _photos(hym / split / cls, n, seed + (split == "val") * 50)
    (hym / "train" / "ants" / "imageNotFound.gif").write_bytes(b"GIF89a" + b"\x00" * 40)
    bccd = tmp / "shared" / "data" / "bccd"
    files = _photos(bccd / "BCCD" / "JPEGImages", 6, 400, h=60, w=80)
    with open(bccd / "test.csv", "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\r\n")
        w.writerow(["filename", "cell_type", "xmin", "xmax", "ymin", "ymax"])
        for i, f in enumerate(files):
            w.writerow([f.name, "RBC", 5, 40, 6, 30])
            w.writerow([f.name, ["WBC", "Platelets"][i % 2], 30, 70, 20, 50])
    return project


def run_page(page: str, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = workspace(tmp)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "examples")}
    ns: dict = {"__name__": f"docs_{Path(page).stem}"}
    for k, (lang, code, skipped) in enumerate(blocks(page)):
        if skipped:
            continue
        where = f"{page}, block {k + 1} ({lang})"
        if lang == "python":
            exec(compile(code, where, "exec"), ns)  # noqa: S102 - the docs' own code
            continue
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=project, env=env, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, f"{where} failed:\n{code}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run(page, tmp_path, monkeypatch):
    if not any(not skipped for _, _, skipped in blocks(page)):
        pytest.skip(f"{page}: no block to run (all marked, or none)")
    run_page(page, tmp_path, monkeypatch)


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for page in re.findall(r"\]\((docs/[\w.-]+\.md)\)", text):
        assert (ROOT / page).is_file(), f"README links to {page}, which does not exist"
    assert all((ROOT / "docs" / p).is_file() for p in ("formats.md", "training.md", "mixing.md", "boxes.md",
                                                       "remote.md", "gpu.md", "doctor.md", "benchmark.md",
                                                       "limits.md", "layout.md"))
    langs = [lang for p in PAGES for lang, _, _ in blocks(p)]
    assert langs.count("python") >= 10 and langs.count("bash") >= 10  # the pattern finds the blocks
    skipped = sum(s for p in PAGES for _, _, s in blocks(p))
    assert skipped <= SKIP_BUDGET, f"{skipped} blocks are marked not to run: run them, or keep the few that must not"
    # shared files are cited as a reader of the project finds them: ../shared/..., beside the checkout
    absolute = [(p, m) for p in PAGES for m in re.findall(r"/work/\S*", (ROOT / p).read_text())]
    assert not absolute, f"cite shared files as ../shared/...: {absolute}"


def test_a_failing_block_fails(tmp_path, monkeypatch):
    page = tmp_path / "bad.md"
    page.write_text("```bash\npackio info no-such.lmdb\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="no-such.lmdb"):
        run_page("bad.md", tmp_path / "w", monkeypatch)


def test_examples_say_what_works_and_warn_of_nothing_on_cpu(tmp_path):
    import packio
    from packio.errors import FormatError

    doc = (ROOT / "examples" / "resumable_training.py").read_text().split('"""')[1]
    names = sorted(set(re.findall(r"\b(\S+\.(?:tar|wds|lmdb|h5|arrays|bmpdir))\b", doc)))
    assert names and "out.tar" not in names
    images = tmp_path / "images" / "a"
    _photos(images, 4, 0)
    _photos(tmp_path / "images" / "b", 4, 10)
    for name in names:  # every dataset name the docstring uses is one convert accepts
        try:
            packio.convert(tmp_path / "images", tmp_path / name, progress=False)
        except FormatError as exc:
            pytest.fail(f"examples/resumable_training.py's docstring uses {name}: {exc}")
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU-only warning check needs a machine without CUDA")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_classifier.py"), str(tmp_path / names[0]),
                        "--steps", "1", "--workers", "0", "--size", "16", "--batch-size", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "loss=" in r.stdout, r.stderr
    assert "Warning" not in r.stderr, r.stderr
