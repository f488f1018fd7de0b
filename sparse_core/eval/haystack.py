"""Filler text for haystacks: real English news text, or a repeated noise paragraph.

The English text is the Lee background corpus (news articles, one per line) that gensim ships in
its wheel as test data. It is not committed here: `english_text()` downloads the gensim wheel once
with pip and extracts that one file into a cache directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GENSIM_WHEEL = "gensim==4.4.0"
CORPUS_MEMBER = "gensim/test/test_data/lee_background.cor"
# RULER's and the passkey test's noise: the same few sentences over and over.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def cache_dir() -> Path:
    root = os.environ.get("KVSPARSE_EVAL_DATA") or Path.home() / ".cache" / "kvsparse" / "eval"
    return Path(root)


def english_text() -> str:
    """The Lee corpus as one string (articles joined by blank lines), fetched on first use."""
    path = cache_dir() / "lee_background.cor"
    if not path.exists():
        _fetch_corpus(path)
    return "\n\n".join(line.strip() for line in path.read_text().splitlines() if line.strip())


def _fetch_corpus(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["-q", "-d", tmp, GENSIM_WHEEL]
        try:
            subprocess.run(cmd, check=True)
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            raise RuntimeError(
                f"could not download the {GENSIM_WHEEL} wheel for the English haystack text; put "
                f"lee_background.cor (from that wheel, {CORPUS_MEMBER}) into {dest.parent} or set "
                f"KVSPARSE_EVAL_DATA to a directory holding it"
            ) from exc
        wheel = next(Path(tmp).glob("gensim-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            dest.write_bytes(zf.read(CORPUS_MEMBER))


def sentences(text: str) -> list[str]:
    """Split into sentences at '. ' (good enough for news text; needles go between them)."""
    out = []
    for paragraph in text.split("\n\n"):
        parts = paragraph.replace(". ", ".\x00").split("\x00")
        out += [p.strip() for p in parts if p.strip()]
    return out
